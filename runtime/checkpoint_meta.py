"""What a checkpoint's ``meta.json`` must hold, checked before a load changes anything.

Owns the shape of the metadata (:func:`meta_problem`: every field's type, every parameter's pieces covering it
exactly once), the check that a saved param group can stand in for the running optimiser's
(:func:`group_problem`), and :func:`json_problem`, which refuses a value JSON would not give back exactly (a
tuple, a non-string key, a non-finite float, a numpy number), so that the data position a resumed run reads
is the one that was saved. Each returns one line naming the bad value, or None.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["meta_problem", "group_problem", "json_problem"]


def json_problem(value: Any, where: str = "value") -> str | None:
    """Why JSON would not give ``value`` back exactly (None: it would)."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return None
    if kind is float:
        return None if math.isfinite(value) else f"{where} is {value!r}, which JSON does not hold"
    if kind is list:
        return next((p for i, v in enumerate(value) if (p := json_problem(v, f"{where}[{i}]"))), None)
    if kind is dict:
        for key, v in value.items():
            if type(key) is not str:
                return f"{where} has the key {key!r} ({type(key).__name__}); JSON keys are strings"
            if (p := json_problem(v, f"{where}[{key!r}]")) is not None:
                return p
        return None
    hint = "; pass a list" if kind is tuple else ""
    return f"{where} is a {kind.__name__}, which JSON does not give back as it is{hint}"


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _ints(value: Any, n: int) -> bool:
    return type(value) is list and len(value) == n and all(_is_int(v) for v in value)


def _top_problem(meta: dict) -> str | None:
    for key, ok in (("step", _is_int(meta.get("step"))), ("world_size", _is_int(meta.get("world_size"), 1)),
                    ("numel", _is_int(meta.get("numel"))), ("params", type(meta.get("params")) is dict),
                    ("pieces", type(meta.get("pieces")) is dict), ("optimizer", type(meta.get("optimizer")) is dict),
                    ("files", type(meta.get("files")) is dict), ("extra", type(meta.get("extra")) is dict)):
        if not ok:
            return f"'{key}' is {meta.get(key)!r}"
    optimizer = meta["optimizer"]
    if type(optimizer.get("class")) is not str:
        return f"'optimizer.class' is {optimizer.get('class')!r}"
    groups, states = optimizer.get("param_groups"), optimizer.get("per_element")
    if type(groups) is not list or not all(type(g) is dict for g in groups):
        return f"'optimizer.param_groups' is {groups!r}"
    if type(states) is not list or not all(type(s) is str and s and "/" not in s for s in states):
        return f"'optimizer.per_element' is {states!r}"
    for name, entry in meta["files"].items():
        if type(entry) is not dict or type(entry.get("sha256")) is not str or not _is_int(entry.get("bytes")):
            return f"'files.{name}' is {entry!r}"
    return None


def _pieces_problem(name: str, numel: int, pieces: Any, world: int) -> str | None:
    if type(pieces) is not list or not all(_ints(p, 3) for p in pieces):
        return f"'pieces.{name}' is {pieces!r}"
    end = 0
    for rank, lo, hi in sorted(pieces, key=lambda p: p[1]):
        if rank >= world or lo != end or hi <= lo:
            return f"'pieces.{name}' does not cover the parameter's {numel} elements once: {pieces!r}"
        end = hi
    return None if end == numel else f"'pieces.{name}' covers {end} of the parameter's {numel} elements"


def meta_problem(meta: Any) -> str | None:
    """What is wrong with the types or the coverage of a ``meta.json`` (None: nothing)."""
    if type(meta) is not dict:
        return f"it is a {type(meta).__name__}, not an object"
    if (problem := _top_problem(meta)) is not None:
        return problem
    for name, saved in meta["params"].items():
        if (type(saved) is not dict or type(saved.get("shape")) is not list
                or not all(_is_int(d) for d in saved["shape"])
                or not (saved.get("split_dim") is None or _is_int(saved.get("split_dim")))):
            return f"'params.{name}' is {saved!r}"
        numel = math.prod(saved["shape"])
        if (problem := _pieces_problem(name, numel, meta["pieces"].get(name), meta["world_size"])) is not None:
            return problem
    return None


def _same_kind(saved: Any, current: Any) -> bool:
    if current is None:  # unset (``foreach=None``): any plain value
        return saved is None or type(saved) in (bool, int, str) or (type(saved) is float and math.isfinite(saved))
    if type(current) is bool:
        return type(saved) is bool
    if isinstance(current, (int, float)):
        return type(saved) in (int, float) and math.isfinite(saved)
    if isinstance(current, (tuple, list)):
        return (type(saved) is list and len(saved) == len(current)
                and all(_same_kind(s, c) for s, c in zip(saved, current)))
    return type(saved) is type(current)


def group_problem(index: int, saved: dict, current: dict) -> str | None:
    """Why param group ``index`` of a checkpoint cannot replace the running optimiser's (None: it can): every
    entry both have must be of the same kind (a number for a number, a list of as many for a tuple, ...)."""
    for key, value in saved.items():
        if key in current and key != "params" and not _same_kind(value, current[key]):
            return f"param group {index} has {key}={value!r}, this optimiser's is {current[key]!r}"
    return None
