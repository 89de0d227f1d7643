"""The compute copy of one stage program's parameters on this rank: what a (scheme, pipeline stage, TP rank)
computes with, shared by every token bucket's compiled variant.

Owns one flat buffer in the compute dtype that holds the rank's parameter slices in the fixed layout's flat
order (so the redistribution receives straight into it), one ``nn.Parameter`` per slice viewing it in the
shape the graph expects, and one flat gradient buffer in the same order, in the gradient-accumulation dtype
(float32 by default, Megatron's ``main_grad``: every micro-batch of every bucket adds into one place, and the
buffer is sent to the owners as it is). When that dtype is the compute dtype the Parameters' ``.grad`` view
the buffer and autograd adds into it; otherwise each micro-batch's gradient (compute dtype) is added into the
buffer by a hook as autograd finishes it, and dropped. Storage exists only during a step:
:meth:`StageParams.materialize` before it, :meth:`release` after it, so a rank never keeps the slices of a
strategy it is not running.

Also owns which of the slices this rank pushes (:attr:`StageParams.push_ranges`) and at what factor
(:attr:`StageParams.weights`). A replicated parameter (a slice with ``dim`` None: embeddings, norms, an unsplit
head) has the same gradient on every rank of a TP group after the backward, so with the rank's place in its
TP group known (``tp_rank``) only TP rank 0 pushes it, whole (factor 1), and the other TP ranks push none of it:
one copy per TP group travels instead of ``tp`` copies at ``1/tp``. Partial gradients of one parameter on
different pipeline stages (tied embeddings), replicas or context-parallel ranks are each pushed by their own
group's TP rank 0 and add up at the owner. Without ``tp_rank`` every rank pushes every slice at the factors of
``ParamSlice.weight_regions``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from passes.graph.tensor_parallel import ParamSlice
from passes.plan.movement import merged
from runtime.fixed_layout import FixedLayout

__all__ = ["StageParams"]


class StageParams:
    """One rank's parameter slices of one stage program, in ``dtype`` on ``device``."""

    def __init__(self, layout: FixedLayout, slices: Mapping[str, ParamSlice], tp: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 grad_dtype: torch.dtype | None = None, tp_rank: int | None = None):
        """``dtype``: the compute copy's; ``grad_dtype``: the gradient buffer's, what micro-batches accumulate in
        (None: ``dtype``). ``tp_rank``: this rank's place in its TP group, so that replicated slices are pushed
        by TP rank 0 alone (module docstring); None: by every rank at ``1/tp``."""
        if tp_rank is not None and (isinstance(tp_rank, bool) or not isinstance(tp_rank, int)
                                    or not 0 <= tp_rank < tp):
            raise ValueError(f"tp_rank must be an integer in [0, {tp}) (a place in a TP group of {tp}), got "
                             f"{tp_rank!r}")
        self.tp, self.tp_rank = tp, tp_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.grad_dtype = dtype if grad_dtype is None else grad_dtype
        """dtype of the flat gradient buffer (what every micro-batch's gradient is added into)."""
        self._grad_views: dict[str, torch.Tensor] | None = None
        """By parameter, its region of the gradient buffer, when that is not in the compute dtype (the hook adds
        each micro-batch's gradient there); None: the Parameters' ``.grad`` are those regions."""
        ordered = sorted(slices.values(), key=lambda s: layout.specs[s.name].offset if s.name in layout.specs
                         else _unknown(s.name))
        self._views: list[tuple[str, int, ParamSlice]] = []
        """(name, first element in the flat buffer, slice) in flat order."""
        self.weights: list[tuple[int, int, float]] = []
        """(start, count, factor) of the gradient regions that count with a factor other than 1."""
        ranges: list[tuple[int, int]] = []
        pushed: list[tuple[int, int]] = []
        once = tp_rank is not None and tp > 1  # replicated slices: pushed by TP rank 0 alone, whole
        start = 0
        for slc in ordered:
            numel = math.prod(slc.local_shape)
            self._views.append((slc.name, start, slc))
            held = layout.slice_ranges(slc)
            ranges.extend(held)
            if once and slc.dim is None:
                if tp_rank == 0:
                    pushed.extend(held)
            else:
                pushed.extend(held)
                self.weights += [(start + first, count, w) for first, count, w in slc.weight_regions(tp)
                                 if w != 1.0]
            start += numel
        self.numel = start
        """Elements of all the slices."""
        self.ranges = list(merged(ranges))
        """The flat ranges of the layout the buffer holds, in order (touching ranges joined)."""
        self.push_ranges = list(merged(pushed))
        """The flat ranges whose gradients this rank pushes to their owners (a subset of :attr:`ranges`, touching
        ranges joined): all of them, less the replicated slices on a TP rank other than 0 (module docstring)."""
        self._layout = layout
        self.params: dict[str, nn.Parameter] = {
            name: nn.Parameter(torch.empty(0, dtype=dtype, device=self.device)) for name, _, _ in self._views}
        """The Parameters the stage program computes with; their storage is swapped in by ``materialize``."""
        self.flat: torch.Tensor | None = None
        self.grad_flat: torch.Tensor | None = None
        self.on_accumulated: Callable[[str], None] | None = None
        """Called with a parameter's name after autograd accumulated a gradient into it (None: nobody listens);
        the executor listens during a step's last backward to push each window as soon as it is complete."""
        for name, param in self.params.items():
            param.register_post_accumulate_grad_hook(self._listener(name))

    def _listener(self, name: str) -> Callable[[torch.Tensor], None]:
        def accumulated(param: torch.Tensor) -> None:
            views = self._grad_views
            if views is not None and param.grad is not None:  # accumulate in the buffer's dtype, drop the rest
                views[name].add_(param.grad)
                param.grad = None
            if self.on_accumulated is not None:
                self.on_accumulated(name)
        return accumulated

    def starts(self) -> Iterator[tuple[str, int, int]]:
        """Every parameter's name, the position of its first element in the flat buffers and its element count,
        in flat order."""
        for name, start, slc in self._views:
            yield name, start, math.prod(slc.local_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter buffer."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the gradient buffer (in ``grad_dtype``)."""
        return self.numel * torch.empty((), dtype=self.grad_dtype).element_size()

    def materialize(self) -> torch.Tensor:
        """Fresh (uninitialised) storage for the parameters; returns the flat buffer to fill."""
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for name, view in self._regions(self.flat).items():
            self.params[name].data = view
        return self.flat

    def zero_grads(self) -> None:
        """A zeroed gradient buffer in ``grad_dtype`` that every micro-batch's gradients are added into: the
        Parameters' ``.grad`` view it (autograd adds in place) when it is in the compute dtype; else the
        Parameters' ``.grad`` stay None between micro-batches and a hook adds each one into it."""
        self.grad_flat = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)
        views = self._regions(self.grad_flat)
        same = self.grad_dtype == self.dtype
        self._grad_views = None if same else views
        for name, view in views.items():
            self.params[name].grad = view if same else None

    def weighted_grads(self) -> torch.Tensor:
        """The flat gradient buffer with each region multiplied by its factor (in place): what the owners sum."""
        self.weigh_grads(0, self.numel)
        return self.grad_flat

    def weigh_grads(self, lo: int, hi: int) -> None:
        """Multiply the regions of the gradient buffer inside [lo, hi) by their factors, in place (once per step
        for each region: what the owners sum)."""
        if self.grad_flat is None:
            raise RuntimeError("no gradients: zero_grads() was not called this step")
        for start, count, weight in self.weights:
            a, b = max(start, lo), min(start + count, hi)
            if b > a:
                self.grad_flat[a:b].mul_(weight)

    def fill_from(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's slices of full parameters (by name) into the buffer, without communication (for
        single-group use such as profiling); ``materialize`` first."""
        if self.flat is None:
            raise RuntimeError("materialize() before fill_from()")
        with torch.no_grad():
            for name, _, slc in self._views:
                self.params[name].copy_(slc.take(full[name].detach()))

    def release_data(self) -> None:
        """Drop the parameter storage (the Parameters stay, empty)."""
        for p in self.params.values():
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.flat = None

    def release(self) -> None:
        """Drop the parameter and gradient storage."""
        for p in self.params.values():
            p.grad = None
        self.grad_flat = None
        self._grad_views = None
        self.release_data()

    def _regions(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, start, slc in self._views:
            spec = self._layout.specs[name]
            out[name] = spec.unstore(flat[start:start + math.prod(slc.local_shape)], slc.local_shape)
        return out


def _unknown(name: str) -> int:
    raise KeyError(f"a stage program reads parameter {name!r}, which the fixed layout does not hold")
