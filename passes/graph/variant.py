"""Variants: the compiled callable for one (scheme, pipeline stage, token bucket) and what it expects.

Owns :class:`TokenBuckets` (total tokens are padded up to a bucket so that varying lengths reuse one
compiled graph), :class:`VariantKey`, :class:`Variant` (one lowered stage at one bucket, compiled once with
``torch.compile``: static token count, dynamic sequence count) and :func:`pad_to_bucket`. Variants are made
from lowerings by :mod:`passes.graph.lowering`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

import codegen
from passes.graph.pass_runner import PassRecord
from passes.graph.tensor_parallel import ParamSlice
from passes.plan.ir import ParallelScheme

__all__ = ["TokenBuckets", "VariantKey", "Variant", "CompileCounter", "pad_to_bucket", "retarget_devices"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBuckets:
    """Allowed token counts of one micro-batch, ascending; a batch is padded up to the next bucket."""

    sizes: tuple[int, ...]
    """Bucket sizes in tokens, strictly ascending."""

    def __post_init__(self) -> None:
        if not self.sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.sizes):
            raise ValueError(f"bucket sizes must be positive integers, got {self.sizes!r}")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"bucket sizes must be strictly ascending, got {self.sizes!r}")

    @classmethod
    def powers_of_two(cls, smallest: int, largest: int) -> "TokenBuckets":
        """Buckets ``smallest, 2*smallest, ...`` up to and including the first >= ``largest``."""
        sizes = [smallest]
        while sizes[-1] < largest:
            sizes.append(sizes[-1] * 2)
        return cls(sizes=tuple(sizes))

    def bucket_for(self, tokens: int) -> int:
        """The smallest bucket that holds ``tokens``; more than the largest is an error quoting both."""
        i = bisect.bisect_left(self.sizes, tokens)
        if i == len(self.sizes):
            raise ValueError(f"{tokens} tokens exceed the largest bucket {self.sizes[-1]}")
        return self.sizes[i]


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class VariantKey:
    """What a variant is compiled for: a replica layout, one of its pipeline stages, a token bucket."""

    scheme: ParallelScheme
    """The replica's layout."""
    stage: int
    """Pipeline stage, 0 <= stage < scheme.pp."""
    bucket: int
    """Tokens of one (padded) micro-batch."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or not 0 <= self.stage < self.scheme.pp:
            raise ValueError(f"stage must be in [0, {self.scheme.pp}) for {self.scheme.describe()}, got {self.stage!r}")
        if isinstance(self.bucket, bool) or not isinstance(self.bucket, int) or self.bucket < 1:
            raise ValueError(f"bucket must be a positive integer, got {self.bucket!r}")

    def describe(self) -> str:
        """E.g. ``(tp2,pp2)/stage1/bucket4096``."""
        return f"{self.scheme.describe()}/stage{self.stage}/bucket{self.bucket}"


class CompileCounter:
    """A torch.compile backend that counts the graphs it compiles, then hands them to ``backend``."""

    def __init__(self, backend: str = "eager") -> None:
        self.backend = backend
        self.count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.count += 1
        if self.backend == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.backend)(gm, example_inputs)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Variant:
    """The compiled stage of one (scheme, stage, bucket) on one rank, and the parameter slices it expects."""

    key: VariantKey
    """What it was built for."""
    tp_rank: int
    """This rank's index in its tensor-parallel group."""
    graph_module: fx.GraphModule
    """The rewritten stage; holds this rank's parameter slices (the model's own Parameters when tp == 1, until
    ``bind_`` gives it the runtime's)."""
    params: tuple[ParamSlice, ...]
    """Per parameter the stage reads: which slice of the full tensor it holds."""
    inputs: tuple[str, ...]
    """User inputs the stage takes, from ``("input_ids", "cu_seqlens", "max_seqlen")``."""
    boundary_in: tuple[str, ...]
    """Activations received from the previous stage, in argument order after the inputs."""
    boundary_out: tuple[str, ...]
    """What the stage returns (the last stage: the model's outputs)."""
    records: tuple[PassRecord, ...]
    """What each pass did while building it."""
    counter: CompileCounter = field(default_factory=CompileCounter)
    """Counts torch.compile compilations of this variant (1 after warm-up, unchanged after; 0 with the
    ``eager`` backend, which compiles nothing)."""
    compiled: Callable = field(default=None)
    """``torch.compile`` of ``graph_module`` (``graph_module`` itself with the ``eager`` backend); for a stage cut
    into pieces, the module that runs the pieces in turn, each compiled on its own."""
    pieces: tuple[fx.GraphModule, ...] = ()
    """The stage's pieces when it is cut for overlapped movement (each holds the Parameters it reads), else
    empty."""
    piece_params: tuple[tuple[str, ...], ...] = ()
    """Per piece, the parameters it reads."""
    gate: list = field(default_factory=lambda: [None])
    """``gate[0]``: called with a piece's parameter names before the piece runs (None: nothing to wait for)."""
    vocab_range: tuple[int, int] | None = None
    """The last stage of a vocab-parallel head whose logits stay split: (start, stop) of the vocabulary columns
    this rank's logits hold (its TP group: the lowering's ``tp_group``); None: the logits are whole."""

    def __call__(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, *boundary: torch.Tensor,
                 cp_inputs: tuple[torch.Tensor, ...] | None = None, max_seqlen: int | None = None) -> tuple:
        """Run the stage on a packed micro-batch (padded here to the bucket); returns the stage's outputs.
        ``cp_inputs`` (context parallelism): positions, gathered key rows and key offsets, for a micro-batch
        that already fills the bucket (its padding is a span whose keys are its own rows). ``max_seqlen``: the
        micro-batch's longest span (None: the bucket), what sizes the attention kernels' grid; it reaches the
        graph as a 0-d host tensor, so a new value compiles nothing."""
        ids, cu = pad_to_bucket(input_ids, cu_seqlens, self.key.bucket)
        if self.counter.backend != "eager":  # torch.compile: the sequence count is dynamic
            torch._dynamo.mark_dynamic(cu, 0)
        longest = self.key.bucket if max_seqlen is None else max(max_seqlen, self.key.bucket - int(input_ids.shape[0]))
        if not 0 <= longest <= self.key.bucket:
            raise ValueError(f"variant {self.key.describe()}: max_seqlen={max_seqlen} must be in [0, "
                             f"{self.key.bucket}]")
        given: dict[str, Any] = {"input_ids": ids.unsqueeze(0), "cu_seqlens": cu,
                                 "max_seqlen": codegen.host_length(longest)}  # the padding span's length too
        if cp_inputs is not None:
            if int(input_ids.shape[0]) != self.key.bucket:
                raise ValueError(f"variant {self.key.describe()}: a context-parallel micro-batch must fill the "
                                 f"bucket ({self.key.bucket} tokens), got {int(input_ids.shape[0])}")
            positions, key_rows, cu_k = cp_inputs
            cu_k = torch.cat([cu_k, cu_k[-1:]])  # the empty span pad_to_bucket appended has no keys either
            if self.counter.backend != "eager":
                torch._dynamo.mark_dynamic(key_rows, 0)
                torch._dynamo.mark_dynamic(cu_k, 0)
            given.update(cp_positions=positions, cp_key_rows=key_rows, cp_cu_seqlens_k=cu_k)
        if len(boundary) != len(self.boundary_in):
            raise ValueError(f"variant {self.key.describe()} takes {len(self.boundary_in)} boundary tensors "
                             f"{self.boundary_in}, got {len(boundary)}")
        return self.compiled(*(given[name] for name in self.inputs), *boundary)

    def boundary_in_specs(self) -> list:
        """What the stage receives, per boundary item: ``(shape, dtype)``, or a list of them for a tuple."""
        vals = [n.meta.get("val") for n in self.graph_module.graph.nodes if n.op == "placeholder"][len(self.inputs):]

        def spec(v: Any) -> Any:
            if isinstance(v, (tuple, list)):
                return [spec(x) for x in v]
            return tuple(int(d) for d in v.shape), v.dtype

        return [spec(v) for v in vals]

    def logits(self, outputs: tuple, total: int) -> torch.Tensor:
        """The (total, vocab) logits of the real tokens, from the last stage's outputs (the capture keeps the
        logits as the graph's one output)."""
        return outputs[0][0, :total]

    def bind_(self, params: Mapping[str, nn.Parameter],
              buffer: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        """Compute with ``params`` (this rank's slices by parameter name, e.g. the runtime's compute copy
        shared by every bucket of a stage) instead of the Parameters the rewrite made; ``buffer(name, t)``
        gives the tensor to use for each buffer (moved or cast). Call before the first run."""
        modules = self.pieces or (self.graph_module,)
        for sl in self.params:
            p = params[sl.name]
            if tuple(p.shape) != sl.local_shape:
                raise ValueError(f"variant {self.key.describe()}: parameter {sl.name!r} must have shape "
                                 f"{sl.local_shape}, got {tuple(p.shape)}")
            for module in modules:
                if module is self.graph_module or sl.name in dict(module.named_parameters()):
                    owner, leaf = _owner(module, sl.name)
                    owner.register_parameter(leaf, p)
        device = next((p.device for p in params.values()), None)
        for module in modules:
            if buffer is not None:
                for name, value in list(module.named_buffers()):
                    owner, leaf = _owner(module, name)
                    owner.register_buffer(leaf, buffer(name, value))
            if device is not None and device.type != "meta":
                retarget_devices(module, torch.device("meta"), device)



def retarget_devices(gm: fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Replace every ``old`` device constant in the graph's arguments (``device=...`` of factory calls that a
    trace of meta stand-ins baked in) by ``new``."""
    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value == old:
            return new
        if isinstance(value, str) and value == old.type:
            return str(new)
        return value

    changed = False
    for node in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding attribute ``name`` (dotted) and the attribute's own name."""
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def pad_to_bucket(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad (T,) ids to ``bucket`` tokens; the padding is one extra sequence appended to ``cu_seqlens``, empty
    when T fills the bucket: ``cu_seqlens`` then always has at least 3 entries, so a compiler that meets one
    sequence first does not specialise the (dynamic) sequence count to it. ``cu_seqlens`` is not read (a
    device tensor would synchronise): the packed op checks host offsets, the runtime builds its own; nor is
    anything copied from the host (the padding's offset is filled on the device: ``new_tensor`` would copy it
    from pageable memory, which blocks the host on a GPU, in every micro-batch)."""
    total = int(input_ids.shape[0])
    if input_ids.dim() != 1 or total > bucket:
        raise ValueError(f"input_ids must be (T,) with T <= bucket {bucket}, got shape {tuple(input_ids.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D int32, got {tuple(cu_seqlens.shape)} ({cu_seqlens.dtype})")
    ids = input_ids if total == bucket else torch.cat([input_ids, input_ids.new_zeros(bucket - total)])
    return ids, torch.cat([cu_seqlens, cu_seqlens.new_full((1,), bucket)])
