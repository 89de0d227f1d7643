"""Imports flow one way: codegen <- passes <- runtime <- hcompile (DESIGN.md section 4)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"codegen", "passes", "runtime", "hcompile", "benchmarks"}
ALLOWED = {
    "codegen": set(),
    "passes": {"codegen"},
    "runtime": {"passes", "codegen"},
    "hcompile": {"runtime", "passes", "codegen"},
    "benchmarks": {"hcompile", "runtime", "passes", "codegen"},
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    bad = {
        str(f.relative_to(ROOT)): sorted(_imported_packages(f) - ALLOWED[package] - {package})
        for f in files
    }
    bad = {f: pkgs for f, pkgs in bad.items() if pkgs}
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}; found {bad}"


def test_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import runtime.x\nfrom hcompile import y\n")
    assert _imported_packages(bad) == {"runtime", "hcompile"}
