"""The user-facing API: hcompile.compile(), the @hydraulis decorator, input validation, named capture errors."""

import pytest
import torch
from torch import nn

import hcompile
from hcompile.models import GPT, init_weights_
from passes.graph.variant import TokenBuckets


def _packed_batch(lens, vocab=96):
    ids = torch.randint(0, vocab, (sum(lens),), generator=torch.Generator().manual_seed(0))
    return ids, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_decorated_class_compiles_on_first_use_and_keeps_options():
    @hcompile.hydraulis(buckets=TokenBuckets(sizes=(16,)), compile_backend="aot_eager")
    class Tiny(GPT):
        pass

    model = init_weights_(Tiny())
    assert "_hcompile" not in model.__dict__  # nothing compiled until first use
    ids, cu = _packed_batch([4, 6])
    out = model.packed(ids, cu)
    ref = torch.cat([model(seq[None])[0] for seq in ids.split([4, 6])])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert model.hcompiled is model.hcompiled
    assert model.hcompiled.compile_backend == "aot_eager" and callable(model.trainer)
    assert isinstance(model, nn.Module) and model(ids[None]).shape == (1, 10, 96)


def test_bare_decorator_and_compile_function():
    @hcompile.hydraulis
    class Tiny(GPT):
        pass

    assert callable(Tiny.packed)
    compiled = hcompile.compile(init_weights_(GPT()))
    ids, cu = _packed_batch([3])
    torch.testing.assert_close(compiled.packed(ids, cu), compiled(ids[None])[0], rtol=0, atol=1e-5)


def test_bad_inputs_are_named():
    compiled = hcompile.compile(GPT())
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32 ending at 5, got \[0, 4\]"):
        compiled.packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="takes an nn.Module, got function"):
        hcompile.compile(lambda x: x)
    with pytest.raises(TypeError, match="decorates nn.Module classes"):
        hcompile.hydraulis(int)
    with pytest.raises(TypeError, match=r"got \['loss', 'optimizer'\]; training options go to .*\.trainer"):
        hcompile.compile(GPT(), loss="causal_lm", optimizer=torch.optim.SGD)


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        x = self.emb(ids)
        print("side effect")  # a graph break under full-graph capture
        return x


def test_graph_break_surfaces_through_packed():
    with pytest.raises(hcompile.CaptureError, match="_Breaks graph-breaks: .*print"):
        hcompile.compile(_Breaks()).packed(torch.zeros(3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32))
