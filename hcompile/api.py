"""What users touch: ``hcompile.compile(model)`` and the ``@hcompile.hydraulis`` class decorator.

Owns :class:`CompiledModel`, the compiled face of a model: ``packed(input_ids, cu_seqlens)`` runs n whole
sequences packed along the token axis and equals running the model on each alone. The packed graph is
captured once per token bucket (total tokens are padded up to the bucket; the padding is one extra
sequence whose output is dropped) and rewritten by the packed-attention pass; ``lowerings(...)`` gives a
:class:`passes.graph.lowering.LoweringCache` over the same captures, which lowers the model per (scheme,
stage, TP rank) and builds the variants the runtime runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import fx, nn

from codegen.validation import check_kernel, check_offsets
from hcompile.capture import Captured, capture
from passes.graph.lowering import LoweringCache
from passes.graph.normalize import CANONICAL_PASSES
from passes.graph.packed_attention import rewrite_packed_attention_pass
from passes.graph.pass_runner import PassContext, PassRecord, copy_graph_module, run_passes
from passes.graph.variant import TokenBuckets, pad_to_bucket
from passes.plan.ir import ParallelScheme

if TYPE_CHECKING:
    from hcompile.train import Trainer

__all__ = ["CompiledModel", "compile", "hydraulis"]


class CompiledModel:
    """A model with its packed forward and its variants, compiled lazily and cached per bucket."""

    def __init__(self, model: nn.Module, *, buckets: TokenBuckets | None = None,
                 compile_backend: str = "auto", kernel: str = "auto") -> None:
        check_kernel(kernel)
        if next(model.parameters(), None) is None:
            raise ValueError(f"{type(model).__name__} has no parameters: hcompile compiles a model to train its "
                             f"parameters, and this one has none to train")
        for name, p in model.named_parameters():  # the fixed layout holds fp32 master weights: floats only
            if not p.is_floating_point():
                leaf = name.rpartition(".")[2]
                raise ValueError(f"{type(model).__name__}: parameter {name!r} is {p.dtype}, and hcompile trains "
                                 f"floating-point parameters only (their fp32 master copy would turn it into floats); "
                                 f"hold it as a buffer instead (register_buffer({leaf!r}, tensor) on its module)")
        if not isinstance(compile_backend, str) or not compile_backend:
            raise ValueError(f"compile_backend must be a torch.compile backend name or 'auto', got {compile_backend!r}")
        self.model = model
        self.buckets = buckets
        """Token buckets micro-batches are padded to (None: one graph per exact token count); a trainer without
        buckets of its own uses these."""
        self.compile_backend = compile_backend
        """The torch.compile backend of the variants: ``auto`` is ``inductor`` for variants that run on a GPU and
        ``eager`` (no compilation: the rewritten graphs run as they are) on the CPU."""
        self.kernel = kernel
        """The packed-attention kernel (``auto``: Triton on a GPU, the CPU flash kernel on the CPU; ``triton``,
        ``cpu-flash``, ``reference``)."""
        self._captures: dict[int, Captured] = {}
        self._packed: dict[int, fx.GraphModule] = {}
        self.records: list[PassRecord] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def backend_for(self, device: torch.device | str | None) -> str:
        """The torch.compile backend of variants that run on ``device`` (None: the model's own device)."""
        if self.compile_backend != "auto":
            return self.compile_backend
        device = torch.device(device) if device is not None else next(self.model.parameters()).device
        return "inductor" if device.type == "cuda" else "eager"

    def trainer(self, **options: Any) -> "Trainer":
        """A :class:`hcompile.Trainer` of this model: ``options`` are the fields of
        :class:`hcompile.TrainOptions` (``loss``, ``optimizer``, ``optimizer_kwargs``, ``strategies``,
        ``tokens_per_rank``, ...) and the trainer's own arguments (``cost_model``, ``dataset``, ``cluster``,
        ``init``, ``state_dict``)."""
        from hcompile.train import Trainer, TrainOptions

        extra = {k: options.pop(k) for k in ("cost_model", "dataset", "cluster", "init", "state_dict") if k in options}
        return Trainer(self, TrainOptions(**options), **extra)

    def captured(self, tokens: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> Captured:
        """The forward captured on input (1, tokens), cached. ``dtype``/``device``: those of the compute copies
        that will run it, when they differ from the model's (see :func:`hcompile.capture.capture`)."""
        key = (tokens, *self._compute(dtype, device))
        if key not in self._captures:
            model_device = next(self.model.parameters()).device
            example_device = key[2] if key[2] is not None else model_device
            ids = torch.zeros(1, tokens, dtype=torch.long, device=example_device if example_device.type != "meta"
                              else "cpu")
            self._captures[key] = capture(self.model, ids, dtype=dtype, device=key[2], logits=True)
        return self._captures[key]

    def _compute(self, dtype: torch.dtype | None, device: torch.device | str | None) -> tuple:
        """(dtype, device) with None for what is the model's own (a capture of it as it is)."""
        p = next(self.model.parameters())
        device = None if device is None or torch.device(device) == p.device else torch.device(device)
        return (None if dtype == p.dtype else dtype), device

    def packed_graph(self, tokens: int) -> fx.GraphModule:
        """The packed forward for exactly ``tokens`` tokens: inputs (input_ids (1, T), cu_seqlens, max_seqlen)."""
        if tokens not in self._packed:
            source = self.captured(tokens).graph_module
            gm = copy_graph_module(source, class_name="Packed" + type(self.model).__name__)
            gm, records = run_passes(gm, [*CANONICAL_PASSES, rewrite_packed_attention_pass],
                                     PassContext(options={"rewrite_packed_attention_pass.kernel": self.kernel}))
            self.records.extend(records)
            self._packed[tokens] = gm
        return self._packed[tokens]

    def packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits (T, vocab) of n packed sequences; equals the model on each sequence, concatenated."""
        total = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
        if (cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total):
            raise ValueError(f"cu_seqlens must be int32 ending at {total}, got {cu_seqlens.tolist()}")
        check_offsets(cu_seqlens.cpu(), total, total)  # values: non-decreasing (a host read; not a training path)
        bucket = self.buckets.bucket_for(total) if self.buckets is not None else total
        ids, cu = pad_to_bucket(input_ids, cu_seqlens, bucket)
        max_seqlen = bucket if self.buckets is not None else int((cu[1:] - cu[:-1]).max())
        out = self.packed_graph(bucket)(ids[None], cu, max_seqlen)[0]
        return out[0, :total]

    def lowerings(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
                  buckets: TokenBuckets | None = None,
                  cost_tokens: Callable[[ParallelScheme], int] | None = None, pieces: int = 1,
                  kv_splits: int = 1, vocab_parallel: bool = False) -> LoweringCache:
        """A new cache of lowerings, variants and stage programs of this model, for compute copies in ``dtype``
        on ``device`` (None: the model's own), over ``buckets`` (None: the model's; powers of two from 64 when
        it has none). Variants bind to one set of parameters, so each trainer holds its own cache; they all
        share this model's captures. ``cost_tokens(scheme)``: the longest micro-batch a scheme runs (what the
        pipeline cut is balanced for). ``pieces``: each stage cut into this many pieces (overlapped movement).
        ``kv_splits``: the head groups a CP rank's K/V exchange is pipelined over, at most (1: not pipelined).
        ``vocab_parallel``: under tp > 1 the token embedding and the LM head split by vocabulary over the TP
        group, the logits left split (``split_logits``; ``Lowering.vocab_range``, the loss assembled by
        ``runtime.loss.vocab_parallel_loss_sum``)."""
        buckets = buckets or self.buckets or TokenBuckets.powers_of_two(64, 1 << 20)
        return LoweringCache(lambda tokens: self.captured(tokens, dtype, device).graph_module, buckets,
                             kernel=self.kernel, compile_backend=self.backend_for(device),
                             buffers=dict(self.model.named_buffers()), cost_tokens=cost_tokens,
                             model_name=type(self.model).__name__, pieces=pieces, kv_splits=kv_splits,
                             vocab_parallel=vocab_parallel, split_logits=vocab_parallel)



def compile(model: nn.Module, *, buckets: TokenBuckets | None = None, compile_backend: str = "auto",
            kernel: str = "auto", **unexpected: Any) -> CompiledModel:
    """Compile ``model`` for packed, tensor-parallel and pipeline-split execution (lazily, on first use); train
    it with ``.trainer(...)``.

    ``buckets``: token buckets micro-batches are padded to (None: one graph per exact token count);
    ``compile_backend``: the torch.compile backend of the variants (``auto``: ``inductor`` on GPUs, ``eager``,
    which compiles nothing, on the CPU); ``kernel``: the packed-attention kernel (``auto``, ``triton``,
    ``cpu-flash``, ``reference``)."""
    if unexpected:
        raise TypeError(f"hcompile.compile takes buckets, compile_backend and kernel, got {sorted(unexpected)}; "
                        "training options go to hcompile.compile(model).trainer(...)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"hcompile.compile takes an nn.Module, got {type(model).__name__}")
    return CompiledModel(model, buckets=buckets, compile_backend=compile_backend, kernel=kernel)


def hydraulis(cls: type | None = None, **options: Any) -> Callable[[type], type] | type:
    """Class decorator: instances gain ``packed`` and ``trainer`` (and ``hcompiled``, their ``CompiledModel``),
    compiled on first use with ``options`` (those of :func:`compile`)."""

    def wrap(klass: type) -> type:
        if not (isinstance(klass, type) and issubclass(klass, nn.Module)):
            raise TypeError(f"@hydraulis decorates nn.Module classes, got {klass!r}")

        def compiled(self: nn.Module) -> CompiledModel:
            if "_hcompile" not in self.__dict__:
                self.__dict__["_hcompile"] = CompiledModel(self, **options)
            return self.__dict__["_hcompile"]

        klass.hcompiled = property(compiled)
        klass.packed = lambda self, input_ids, cu_seqlens: compiled(self).packed(input_ids, cu_seqlens)
        klass.trainer = lambda self, **kwargs: compiled(self).trainer(**kwargs)
        return klass

    return wrap(cls) if cls is not None else wrap
