"""Imports flow one way: codegen <- passes <- runtime <- hcompile <- benchmarks; inside passes, the planner
(``passes.plan``) imports neither torch nor the graph passes, so it runs wherever Python and numpy do."""

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
PLANNER_FORBIDDEN = {"torch", "triton", "codegen", "passes.graph", "runtime", "hcompile"}


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, dotted (``from a.b import c`` gives ``a.b``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _imports(path)} & PROJECT


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


def test_the_planner_imports_no_torch():
    files = sorted((ROOT / "passes" / "plan").rglob("*.py"))
    assert len(files) >= 8
    bad = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f) if any(
        n == forbidden or n.startswith(forbidden + ".") for forbidden in PLANNER_FORBIDDEN)) for f in files}
    bad = {f: names for f, names in bad.items() if names}
    assert not bad, f"passes.plan may not import {sorted(PLANNER_FORBIDDEN)}; found {bad}"


def test_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import runtime.x\nfrom hcompile import y\nfrom passes.graph.variant import z\n")
    assert _imported_packages(bad) == {"runtime", "hcompile", "passes"}
    assert "passes.graph.variant" in _imports(bad)


DISTRIBUTED_MODULES = {"runtime/distributed.py", "passes/graph/collectives.py"}
"""The only modules that may import torch.distributed: the runtime's one communication module, and the
graph's tensor-parallel ops (device tensors by construction)."""


LAUNCHER = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed._tools")
"""torch's launcher (``hcompile launch`` wraps torchrun): starting processes, not communicating; and its memory
tools (``MemTracker``, which the memory model and the rehearsal track fake tensors with)."""


def _uses_torch_distributed(path: Path) -> bool:
    return any((n == "torch.distributed" or n.startswith("torch.distributed."))
               and not n.startswith(LAUNCHER) for n in _imports(path)) or \
        "torch.distributed" in {f"{n}.{a.name}" for node in ast.walk(ast.parse(path.read_text()))
                                if isinstance(node, ast.ImportFrom) and (n := node.module) == "torch"
                                for a in node.names}


def test_only_the_communication_module_calls_torch_distributed():
    files = sorted(f for p in PROJECT for f in (ROOT / p).rglob("*.py"))
    users = {str(f.relative_to(ROOT)) for f in files if _uses_torch_distributed(f)}
    assert users == DISTRIBUTED_MODULES, (f"torch.distributed is used by {sorted(users - DISTRIBUTED_MODULES)}; "
                                          "go through runtime.distributed instead")


def test_the_distributed_check_sees_every_form(tmp_path):
    for text in ("import torch.distributed as dist\n", "from torch import distributed\n",
                 "from torch.distributed import all_reduce\n"):
        f = tmp_path / "m.py"
        f.write_text(text)
        assert _uses_torch_distributed(f), text
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\nfrom torch.distributed.run import main\n"
                                   "from torch.distributed._tools.mem_tracker import MemTracker\n")
    assert not _uses_torch_distributed(tmp_path / "m.py")
