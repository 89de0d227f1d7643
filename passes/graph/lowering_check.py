"""The lowering self-check: a rank's lowered program computes what the model computes, or it is refused.

Owns :func:`check_lowering`, :class:`LoweringReport` and :class:`LoweringError`. A lowering (repeat_kv
folding, tensor parallel, packed attention, pipeline split: ``passes.graph.lowering.lower_graph``) is run, on
every rank of one tensor-parallel group, on a small random probe: a few whole sequences packed into one token
bucket (with the padding the runtime adds), every parameter a random value drawn from its name. The same
sequences go, one at a time and unpacked, through a reference the caller gives (the user's own model, eager).
Compared:

- the logits of every real token;
- the gradient of every parameter under a random projection of the logits, each rank's gradient slice
  weighted as the runtime weights it before the owners sum it (``ParamSlice.grad_weight``), scattered into a
  tensor of the full shape and summed over the group: exactly what training would add up.

Differences above a tolerance (relative to the tensor, and to the gradients' overall size, so a gradient that
is zero in exact arithmetic does not fail on rounding) are reported by parameter name. Dropout is set to 0
for the probe (the reference must run without it too). The probe's collectives run on the TP group only, so
all groups of a strategy check at once; every rank of a group reaches the same verdict. Under context
parallelism the probe's long sequence is spread over the CP group as the runtime spreads it
(``passes.graph.context_parallel.CpShare``): each CP rank compares the logits of its own tokens, and the
gradients are summed over the CP group too.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn

from passes.graph.collectives import all_reduce_tensor
from passes.graph.context_parallel import CpShare
from passes.graph.lowering import Lowered
from passes.graph.pass_runner import PassError
from passes.graph.tensor_parallel import ParamSlice
from passes.graph.variant import retarget_devices
from passes.plan.ir import ParallelScheme

__all__ = ["LoweringError", "LoweringReport", "check_lowering", "probe_lengths", "probe_values", "neutralise_dropout",
           "Reference"]

Reference = Callable[[Mapping[str, torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]
"""``reference(params, sequences)``: the model with these full parameter values (by name) on each 1-D token
sequence alone, without dropout; the logits of all tokens concatenated, (total, vocab)."""

_DROPOUT = (F.dropout, torch.dropout, torch.nn.functional.dropout)


class LoweringError(PassError):
    """A lowering that cannot be built, or that does not compute what the model computes on the probe; the
    same on every rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoweringReport:
    """What the probe found for one (scheme, TP rank)."""

    scheme: ParallelScheme
    """The lowered replica layout."""
    tp_rank: int
    """This rank's index in its TP group."""
    probe_lens: tuple[int, ...]
    """The probe's sequence lengths (packed into one bucket)."""
    tolerance: float
    """Largest accepted relative difference."""
    output_error: float
    """Relative difference of the logits (largest over the group)."""
    grad_errors: tuple[tuple[str, float], ...]
    """Per parameter with a gradient: its relative difference, as judged against the tolerance."""

    @property
    def mismatched(self) -> tuple[tuple[str, float], ...]:
        """The parameters whose gradients differ, worst first."""
        return tuple(sorted(((n, e) for n, e in self.grad_errors if e > self.tolerance), key=lambda x: -x[1]))

    @property
    def ok(self) -> bool:
        """Whether the outputs and every gradient agree."""
        return self.output_error <= self.tolerance and not self.mismatched

    def describe(self) -> str:
        """One line: what differs, or that nothing does."""
        where = f"{self.scheme.describe()} (TP rank {self.tp_rank}), probe of {list(self.probe_lens)} tokens"
        if self.ok:
            return f"{where}: logits and {len(self.grad_errors)} gradients agree"
        parts = []
        if self.output_error > self.tolerance:
            parts.append(f"logits differ (relative error {self.output_error:.2g})")
        bad = self.mismatched
        if bad:
            named = ", ".join(f"{n} ({e:.2g})" for n, e in bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6
                                                                         else "")
            parts.append(f"gradients differ for {named}")
        return f"{where}: {'; '.join(parts)} (tolerance {self.tolerance:.0e})"


def probe_lengths(bucket: int, cp: int = 1, *, longest: int | None = None, limit: int = 0) -> tuple[int, ...]:
    """The probe's sequences for a micro-batch of ``bucket`` tokens per rank on ``cp`` ranks: one long sequence
    filling most of it (three quarters of ``bucket * cp``, split over the CP ranks), longer than ``limit`` (the
    longest window or chunk of the model) where the scheme trains such sequences, never longer than ``longest``
    (the longest sequence the scheme trains; default ``bucket * cp``), then up to two short ones in what is left
    (they go whole to one CP rank); the rest is the runtime's padding."""
    room = bucket * cp
    longest = room if longest is None else max(1, min(longest, room))
    first = min(max(1, (3 * room) // 4, limit + 2), longest)
    rest = room - first
    shorts = [n for n in (rest // 2, rest // 5) if n >= 1] if rest >= 2 else []
    return (first, *shorts)


def probe_values(shape: Sequence[int], name: str, seed: int = 0) -> torch.Tensor:
    """A random fp32 value for parameter ``name`` (the same on every rank): weights of scale 1/sqrt(fan-in),
    vectors around 1 (norm weights stay norm-like; biases are then large, which only makes the probe sharper)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ seed)
    if len(shape) <= 1:
        return 1.0 + 0.5 * torch.randn(tuple(shape), generator=g)
    return torch.randn(tuple(shape), generator=g) / math.sqrt(shape[-1])


def neutralise_dropout(gm: fx.GraphModule) -> int:
    """Set every dropout's probability to 0 (in place); how many there were with p > 0."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _DROPOUT:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            if p:
                if "p" in node.kwargs:
                    node.kwargs = {**node.kwargs, "p": 0.0}
                else:
                    node.args = (node.args[0], 0.0, *node.args[2:])
                changed += 1
    if changed:
        gm.recompile()
    return changed


def _find_param(gm: nn.Module, name: str) -> nn.Parameter | None:
    """Parameter ``name`` of a lowered program (in the program, or in one of its pipeline stages)."""
    for module in (gm, *(m for n, m in gm.named_children() if n.startswith("stage_"))):
        try:
            return module.get_parameter(name)
        except AttributeError:
            continue
    return None


def _scatter(sl: ParamSlice, grad: torch.Tensor, tp: int) -> torch.Tensor:
    """This rank's weighted contribution to the full gradient of ``sl``'s parameter."""
    weights = sl.range_weights(tp)
    if sl.dim is None:
        return grad.float() * weights[0]
    full = grad.new_zeros(sl.full_shape, dtype=torch.float32)
    offset = 0
    for (a, b), w in zip(sl.ranges, weights):
        full.narrow(sl.dim, a, b - a).copy_(grad.narrow(sl.dim, offset, b - a).float() * w)
        offset += b - a
    return full


def _bind_probe(lowered: Lowered, values: Mapping[str, torch.Tensor],
                buffer: Callable[[str, torch.Tensor], torch.Tensor], device: torch.device) -> None:
    """Give a lowered program (built on the capture as it is, perhaps of meta stand-ins) this rank's slices of
    the probe values and real buffers, as the runtime binds its own: one Parameter per name, shared by every
    stage that reads it, each requiring a gradient as the runtime's do (a frozen parameter too: the runtime
    computes its gradient and drops it at the owner, ``runtime.fixed_layout.FixedLayout.freeze``)."""
    slices = {sl.name: sl for sl in lowered.params}
    made: dict[str, torch.Tensor] = {}
    gm = lowered.graph_module
    modules = [m for n, m in gm.named_children() if n.startswith("stage_")] or [gm]  # stages hold what they read
    for module in modules:
        for name, _ in list(module.named_parameters()):
            if name not in made:
                value = slices[name].take(values[name]).clone()
                made[name] = nn.Parameter(value, requires_grad=value.is_floating_point())
            _owner(module, name).register_parameter(name.rpartition(".")[2], made[name])
        for name, b in list(module.named_buffers()):
            if name not in made:
                made[name] = (buffer(name, b) if b.device.type == "meta" else b).to(device)
            _owner(module, name).register_buffer(name.rpartition(".")[2], made[name])
        if device.type != "meta":
            retarget_devices(module, torch.device("meta"), device)
        neutralise_dropout(module)


def _owner(root: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    return root.get_submodule(path) if path else root


def check_lowering(captured: fx.GraphModule, scheme: ParallelScheme, *, tp_rank: int, tp_group: str | None,
                   lower: Callable[[fx.GraphModule], Lowered], reference: Reference,
                   buffer: Callable[[str, torch.Tensor], torch.Tensor], vocab: int, device: torch.device,
                   dtype: torch.dtype, seed: int = 0, cp_rank: int = 0, cp_group: str | None = None,
                   lens: Sequence[int] | None = None) -> LoweringReport:
    """Run ``lower`` (a graph -> ``passes.graph.lowering.Lowered``) on a copy of ``captured`` (input (1, bucket))
    holding probe values, on a probe of packed sequences (``lens``; default :func:`probe_lengths` of the
    bucket), against ``reference`` on each sequence alone; every rank of the TP group (and of the CP group,
    ``cp_group``, when cp > 1) calls it together. Raises what building the lowering raises."""
    bucket = int(next(n for n in captured.graph.nodes if n.op == "placeholder").meta["val"].shape[-1])
    lens = tuple(lens) if lens is not None else probe_lengths(bucket, scheme.cp)
    if sum(lens) > bucket * scheme.cp:
        raise ValueError(f"a probe of {list(lens)} tokens does not fit {scheme.cp} x {bucket} tokens")
    values = {name: probe_values(p.shape, name, seed).to(device=device, dtype=dtype)
              for name, p in captured.named_parameters()}
    lowered = lower(captured)
    _bind_probe(lowered, values, buffer, device)
    g = torch.Generator().manual_seed(seed + 1)
    seqs = [torch.randint(0, max(vocab, 1), (n,), generator=g) for n in lens]
    total = sum(lens)
    if scheme.cp == 1:
        ids = torch.cat([*seqs, seqs[0].new_zeros(bucket - total)]).to(device)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist(), *([bucket] if total < bucket else [])],
                          dtype=torch.int32, device=device)
        out = lowered.graph_module(ids[None], cu, bucket)
        rows = torch.arange(total, device=device)
    else:  # this CP rank's share of the probe, as the runtime makes it
        share = CpShare.build(seqs, scheme.cp, cp_rank, bucket)
        out = lowered.graph_module(share.ids[None].to(device), share.inputs.cu_seqlens_q.to(device), bucket,
                                   *share.graph_inputs(device))
        rows = share.rows.to(device)
    logits = (out[0] if isinstance(out, (tuple, list)) else out)[0, :rows.numel()]
    ref_params = {name: v.clone().requires_grad_(True) for name, v in values.items()}
    ref_logits = reference(ref_params, [t.to(device) for t in seqs])
    weights = torch.randn(tuple(ref_logits.shape), generator=g).to(device)
    (logits.float() * weights[rows]).sum().backward()
    (ref_logits.float() * weights).sum().backward()
    output_error = _relative(logits.detach().float(), ref_logits.detach().float()[rows], 0.0)
    grads = _reassembled(lowered, scheme.tp, tp_group, device, cp_group)
    errors = _grad_errors(grads, {n: p.grad for n, p in ref_params.items()})
    for group in (tp_group, cp_group):
        if group is not None:
            output_error = float(all_reduce_tensor(torch.tensor([output_error], device=device), group, "max")[0])
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return LoweringReport(scheme=scheme, tp_rank=tp_rank, probe_lens=lens, tolerance=tolerance,
                          output_error=output_error, grad_errors=tuple(errors))


def _reassembled(lowered: Lowered, tp: int, tp_group: str | None, device: torch.device,
                 cp_group: str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient as training would sum it over the TP group, and over the CP group
    when there is one (parameters without a gradient on every rank are left out)."""
    parts, names, has = [], [], []
    for sl in lowered.params:
        p = _find_param(lowered.graph_module, sl.name)
        grad = None if p is None else p.grad
        has.append(grad is not None)
        parts.append(_scatter(sl, grad, tp).flatten() if grad is not None
                     else torch.zeros(math.prod(sl.full_shape), device=device))
        names.append(sl)
    flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
    present = torch.tensor(has, dtype=torch.float32, device=device)
    if tp_group is not None:
        flat = all_reduce_tensor(flat, tp_group, "sum")
        present = all_reduce_tensor(present, tp_group, "sum")
    if cp_group is not None:  # every CP rank saw some tokens: their gradients add up
        flat = all_reduce_tensor(flat, cp_group, "sum")
        present = all_reduce_tensor(present, cp_group, "max")
    out, offset = {}, 0
    for sl, seen in zip(names, present.tolist()):
        n = math.prod(sl.full_shape)
        if seen:
            out[sl.name] = flat[offset:offset + n].view(sl.full_shape)
        offset += n
    return out


def _relative(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    diff = float(torch.linalg.vector_norm(got - want))
    return diff / max(float(torch.linalg.vector_norm(want)) + floor, 1e-30)


def _grad_errors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor | None]
                 ) -> list[tuple[str, float]]:
    """Per parameter, the difference over (its own norm + the gradients' RMS times sqrt(its size)): a
    gradient that is zero in exact arithmetic (a key bias) is judged against the size of gradients in
    general, not against its own rounding."""
    present = {n: g.float() for n, g in want.items() if g is not None}
    total = sum(g.numel() for g in present.values()) or 1
    rms = math.sqrt(sum(float(g.pow(2).sum()) for g in present.values()) / total)
    errors = []
    for name in sorted(set(present) | set(got)):
        if name not in present or name not in got:
            errors.append((name, math.inf))  # a gradient on one side only
            continue
        ref = present[name]
        errors.append((name, _relative(got[name], ref, rms * math.sqrt(ref.numel()))))
    return errors

