"""Progress of long work on stderr: one tqdm bar per label (``hcompile profile``, ``hcompile plan``, the
compile-and-run harness), updated by absolute counts, closed when the count reaches the total."""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["progress_bar"]

_BARS: dict[str, tqdm] = {}


def progress_bar(label: str, done: int, total: int) -> None:
    """Show ``done`` of ``total`` on the bar named ``label`` (made on first use, closed at the total)."""
    bar = _BARS.get(label)
    if bar is None or bar.total != total:
        if bar is not None:
            bar.close()
        bar = _BARS[label] = tqdm(total=total, desc=label, file=sys.stderr, dynamic_ncols=True, leave=True,
                                  mininterval=0.5)
    bar.update(max(0, done - bar.n))
    if done >= total:
        bar.close()
        del _BARS[label]
