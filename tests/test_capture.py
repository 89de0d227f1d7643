"""Capture: one normalised graph per forward, equal to eager; graph breaks and bad outputs are named."""

import collections
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hcompile.capture import CaptureError, capture
from hcompile.models import GPT, Llama, init_weights_


@pytest.mark.parametrize("model_cls", [GPT, Llama])
def test_capture_matches_eager_and_keeps_parameters(model_cls):
    model = init_weights_(model_cls())
    ids = torch.randint(0, 96, (2, 9))
    cap = capture(model, ids)
    gm = cap.graph_module
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 1
    torch.testing.assert_close(gm(ids)[0], model(ids), rtol=0, atol=0)
    # parameters are the model's own objects: gradients land on the model
    first = cap.param_names[0]
    assert gm.get_parameter(first) is model.get_parameter(first)
    assert set(cap.param_names) == {n for n, _ in model.named_parameters()}


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent Python control flow: a graph break
            y = y * 2
        return y


def test_graph_break_is_an_error_naming_the_break():
    where = r"File .*test_capture.py\", line \d+, in forward"  # the break's reason and its place in user code
    with pytest.raises(CaptureError, match=r"_Breaks graph-breaks: .*data-dependent.* \| " + where):
        capture(_Breaks(), torch.randn(2, 4))


@dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor


class _ObjectOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return _Out(logits=h * 3, aux=h.sum())


def test_output_object_with_logits_is_found():
    model = _ObjectOut()
    x = torch.randn(3, 4)
    cap = capture(model, x)
    torch.testing.assert_close(cap.graph_module(x)[0], model(x).logits)


_CacheOut = collections.namedtuple("_CacheOut", "logits extra")


class _WithCache(nn.Module):
    """A model that concatenates to an empty cache, returns extra outputs and has a Hugging Face-like config."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.config = type("Config", (), {"use_cache": True})()
        self.seen_use_cache = None

    def forward(self, x):
        self.seen_use_cache = self.config.use_cache
        past = torch.tensor([], dtype=x.dtype)
        k = torch.cat([past, self.proj(x)], dim=-2) if past.dim() == 1 else self.proj(x)
        k = torch.cat([torch.empty(1, 0, 8), k], dim=1)
        return _CacheOut(logits=k * 2, extra=k.sum())


def test_capture_keeps_the_logits_only_without_cache_concatenation():
    model = _WithCache()
    x = torch.randn(1, 5, 8)
    cap = capture(model, x)
    assert model.seen_use_cache is False and model.config.use_cache is True  # traced without, then restored
    nodes = list(cap.graph_module.graph.nodes)
    assert not any(n.op == "call_function" and n.target is torch.cat for n in nodes)
    assert len(nodes[-1].args[0]) == 1  # the logits alone
    torch.testing.assert_close(cap.graph_module(x)[0], model(x).logits)


class _InPlace(nn.Module):
    """Updates an intermediate in place (as Hugging Face's expert layers add their biases) and overwrites a buffer
    it then reads (as longrope updates ``inv_freq``); ``view`` updates a slice of an activation in place."""

    def __init__(self, view: bool = False):
        super().__init__()
        self.view = view
        self.proj = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        out = self.proj(x)
        out.add_(self.bias)  # the result is unused: only the update matters
        out.clamp_(-1.0, 1.0)
        self.scale.copy_(torch.full((8,), 3.0))
        if self.view:
            out[..., :4].mul_(2.0)
        return out * self.scale


def test_in_place_updates_and_buffer_writes_are_kept():
    model = _InPlace()
    x = torch.randn(1, 5, 8)
    cap = capture(model, x)
    model.scale.fill_(1.0)  # the graph computes the written value, not what the buffer holds
    methods = {n.target for n in cap.graph_module.graph.nodes if n.op == "call_method"}
    assert {"add", "clamp"} <= methods and not any(t.endswith("_") for t in methods)
    expected = (torch.clamp(model.proj(x) + model.bias, -1.0, 1.0)) * 3.0
    torch.testing.assert_close(cap.graph_module(x)[0], expected)


def test_an_in_place_update_of_a_view_is_refused():
    with pytest.raises(CaptureError, match="updates 'getitem' in place \\(mul_\\), which shares memory"):
        capture(_InPlace(view=True), torch.randn(1, 5, 8))


class _Outputs(nn.Module):
    """Token ids -> a scalar, (B, T) scores, integer (B, T, 1) ids, or logits (B, T, V)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids):
        logits = self.head(self.emb(ids))
        return {"scalar": logits.sum(), "bt": logits.sum(-1), "ints": logits.argmax(-1, keepdim=True),
                "logits": logits}[self.kind]


class _NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)


@pytest.mark.parametrize(("kind", "found"), [("scalar", "a scalar of torch.float32"),
                                             ("bt", r"a tensor of shape \(1, 8\) of torch.float32"),
                                             ("ints", r"a tensor of shape \(1, 8, 1\) of torch.int64")])
def test_an_output_that_is_not_logits_is_named_where_logits_are_expected(kind, found):
    import hcompile

    model = _Outputs(kind)
    capture(model, torch.zeros(1, 8, dtype=torch.long))  # a plain capture takes any tensor
    with pytest.raises(CaptureError, match=f"_Outputs returned {found} for input_ids of shape \\(1, 8\\): expected "
                                           r"floating-point logits of shape \(batch, tokens, vocab\) = \(1, 8, vocab"):
        hcompile.compile(model).captured(8)
    assert hcompile.compile(_Outputs("logits")).captured(8).graph_module is not None


def test_a_module_without_forward_is_named():
    import hcompile

    with pytest.raises(CaptureError, match=r"_NoForward has no forward: nn.Module subclasses define forward\(self, "
                                           r"input_ids\) returning logits"):
        hcompile.compile(_NoForward()).captured(8)
