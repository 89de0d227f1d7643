"""Every split of a list into non-empty groups: the exhaustive optima of small planner instances enumerate them."""

from __future__ import annotations

from typing import Iterator


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every split of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for groups in partitions(rest):
        yield [[first], *groups]
        for k in range(len(groups)):
            yield [*groups[:k], [first, *groups[k]], *groups[k + 1:]]
