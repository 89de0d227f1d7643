"""What every benchmark stamps on its JSON lines: the git commit of the code that ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["commit"]


def commit() -> str:
    """The short git commit of the working tree (``unknown`` outside a checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
