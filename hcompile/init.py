"""Models larger than one rank's memory: build them without their parameters, initialise only each rank's shard.

Owns :func:`empty_init`, a context manager under which modules get their parameters on the meta device (no
memory; their buffers stay real, so values computed in ``__init__`` such as rotary frequencies survive), and
:func:`normal_init`, a deterministic per-parameter initialiser for ``hcompile.compile(...).trainer(init=...)``: every
rank draws the same values for a parameter from a generator seeded by the parameter's name, one parameter at
a time, so each rank fills its shard of the fixed layout without the whole model ever existing anywhere.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["empty_init", "normal_init"]


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Within the block, every parameter a module registers is replaced by a meta Parameter of its shape and
    dtype (buffers are left real)::

        with hcompile.empty_init():
            model = LlamaForCausalLM(config)        # no parameter memory
        trainer = hcompile.compile(model).trainer(loss="causal_lm", init=hcompile.normal_init(0.02), ...)
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                 requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def normal_init(std: float = 0.02, seed: int = 0) -> Callable[[str, torch.Tensor], None]:
    """An initialiser: matrices (2 dims or more) from N(0, std^2), biases zero, other vectors (norm scales) one;
    each parameter's draws come from a generator seeded by ``seed`` and its name, so every rank gets the same
    values whatever else it initialises."""
    if not (isinstance(std, (int, float)) and math.isfinite(std) and std > 0):
        raise ValueError(f"std must be a positive finite number, got {std!r}")

    def init(name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            if tensor.dim() >= 2:
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)
            elif name.endswith("bias"):
                tensor.zero_()
            else:
                tensor.fill_(1.0)

    return init
