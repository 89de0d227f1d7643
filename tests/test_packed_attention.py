"""Packed attention rewrite: golden graph, equality with per-sequence eager (forward and gradients), errors."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import codegen
import hcompile
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.packed_attention import packed_positions, rewrite_packed_attention_pass
from passes.graph.pass_runner import PassContext, PassError, propagate_vals, run_passes
from passes.graph.variant import TokenBuckets


def _hand_built(**sdpa_kwargs) -> fx.GraphModule:
    """x (1, 6, 32) + arange(6) positions -> 2 heads of 16 -> causal SDPA, as capture would record it."""
    g = fx.Graph()
    x = g.placeholder("x")
    pos = g.call_function(torch.arange, (6,))
    pos3 = g.call_function(operator.getitem, (pos, (None, slice(None), None)))
    view = g.call_method("view", (g.call_function(operator.add, (x, pos3)), 1, 6, 2, 16))
    q = g.call_method("transpose", (view, 1, 2))
    g.output(g.call_function(F.scaled_dot_product_attention, (q, q, q), sdpa_kwargs or {"is_causal": True}))
    gm = fx.GraphModule(nn.Module(), g)
    propagate_vals(gm, [torch.randn(1, 6, 32)])
    return gm


def _eager(x):
    q = (x + torch.arange(x.shape[1])[None, :, None]).view(1, x.shape[1], 2, 16).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


GOLDEN = """\
graph():
    %x : [num_users=1] = placeholder[target=x]
    %cu_seqlens : torch.Tensor [num_users=2] = placeholder[target=cu_seqlens]
    %max_seqlen : int [num_users=1] = placeholder[target=max_seqlen]
    %packed_positions : [num_users=1] = call_function[target=passes.graph.attention_masks.packed_positions](args = (%cu_seqlens, 6), kwargs = {dtype: torch.int64})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%packed_positions, (None, slice(None, None, None), None)), kwargs = {})
    %add : [num_users=1] = call_function[target=operator.add](args = (%x, %getitem), kwargs = {})
    %view : [num_users=1] = call_method[target=view](args = (%add, 1, 6, 2, 16), kwargs = {})
    %transpose : [num_users=3] = call_method[target=transpose](args = (%view, 1, 2), kwargs = {})
    %squeeze : [num_users=1] = call_method[target=squeeze](args = (%transpose, 0), kwargs = {})
    %transpose_1 : [num_users=1] = call_method[target=transpose](args = (%squeeze, 0, 1), kwargs = {})
    %squeeze_1 : [num_users=1] = call_method[target=squeeze](args = (%transpose, 0), kwargs = {})
    %transpose_2 : [num_users=1] = call_method[target=transpose](args = (%squeeze_1, 0, 1), kwargs = {})
    %squeeze_2 : [num_users=1] = call_method[target=squeeze](args = (%transpose, 0), kwargs = {})
    %transpose_3 : [num_users=1] = call_method[target=transpose](args = (%squeeze_2, 0, 1), kwargs = {})
    %packed_attention : [num_users=1] = call_function[target=codegen.op.packed_attention](args = (%transpose_1, %transpose_2, %transpose_3, %cu_seqlens, %max_seqlen), kwargs = {causal: True, softmax_scale: None, kernel: auto, validate: False})
    %transpose_4 : [num_users=1] = call_method[target=transpose](args = (%packed_attention, 0, 1), kwargs = {})
    %unsqueeze : [num_users=1] = call_method[target=unsqueeze](args = (%transpose_4, 0), kwargs = {})
    return unsqueeze"""


def test_golden_graph_on_a_hand_built_graph():
    gm = _hand_built()
    out, records = run_passes(gm, [rewrite_packed_attention_pass], PassContext())
    assert records[0].modified and records[0].info == {"attention_sites": 1, "positions": 1, "tokens": 6}
    assert str(out.graph).strip() == GOLDEN
    x = torch.randn(1, 6, 32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    expected = torch.cat([_eager(x[:, :2]), _eager(x[:, 2:])], dim=2)
    torch.testing.assert_close(out(x, cu, 4), expected)


def test_already_packed_graph_is_returned_unchanged():
    gm, _ = run_passes(_hand_built(), [rewrite_packed_attention_pass], PassContext())
    again, records = run_passes(gm, [rewrite_packed_attention_pass], PassContext())
    assert again is gm and records[0].modified is False


def test_packed_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    assert packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def _no_attention() -> fx.GraphModule:
    gm = fx.symbolic_trace(lambda x: x * 2)
    propagate_vals(gm, [torch.randn(1, 6, 32)])
    return gm


class _SlicedTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(64, 32))

    def forward(self, x):  # x: (1, 6, 32)
        q = (x + self.table[:6]).view(1, 6, 2, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _sliced_table() -> fx.GraphModule:
    return hcompile.capture(_SlicedTable(), torch.randn(1, 6, 32)).graph_module


@pytest.mark.parametrize("build, message", [
    (_sliced_table, "node '.*' .* slices a position table to the sequence length \\(6\\)"),
    (_no_attention, "no scaled_dot_product_attention call found"),
    (lambda: _hand_built(is_causal=False), "node 'scaled_dot_product_attention' .* is not causal"),
    (lambda: _hand_built(is_causal=True, dropout_p=0.1), "node 'scaled_dot_product_attention' .* dropout 0.1"),
])
def test_out_of_scope_is_a_named_error(build, message):
    with pytest.raises(PassError, match=message):
        rewrite_packed_attention_pass(build(), PassContext())


def _packed_batch(lens, vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


@pytest.mark.parametrize("model_cls", [GPT, Llama])
@pytest.mark.parametrize("buckets", [None, TokenBuckets(sizes=(16, 32))])
def test_packed_equals_per_sequence_eager_forward_and_gradients(model_cls, buckets):
    lens = [5, 1, 9, 3, 7]
    ids, cu = _packed_batch(lens)
    model = init_weights_(model_cls())
    compiled = hcompile.compile(model, buckets=buckets)
    targets = ids.roll(-1)
    out = compiled.packed(ids, cu)
    F.cross_entropy(out, targets, reduction="sum").backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.cat([model(seq[None])[0] for seq in ids.split(lens)])
    F.cross_entropy(ref, targets, reduction="sum").backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():  # fp32 sums of O(10) values: relative 1e-5 as well
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


class _MaskedAttention(nn.Module):
    """Attention whose mask is built from positions the way Hugging Face models build it: causal and within
    the sequences that positions restarting at 0 delimit, and inside a sliding window of ``window`` tokens."""

    def __init__(self, window: int, causal: bool = True):
        super().__init__()
        self.window, self.causal = window, causal

    def forward(self, x):  # x: (1, T, 32)
        t = x.shape[1]
        pos = torch.arange(t)[None]  # (1, T) positions
        seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # (1, T) sequence ids
        q_idx, kv_idx = torch.arange(t)[:, None], torch.arange(t)[None, :]  # index aranges
        qp, kp = pos[0][q_idx], pos[0][kv_idx]
        mask = (kp > qp - self.window) & (seq[0][q_idx] == seq[0][kv_idx])
        if self.causal:
            mask = mask & (kp <= qp)
        q = (x + pos[..., None]).view(1, t, 2, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask[None, None])


@pytest.mark.parametrize("window, kept", [(1000, None), (24, None), (4, 3)])
def test_a_mask_built_from_positions_becomes_the_ops_window(window, kept):
    """Evaluated on one sequence and on a probe of packed sequences, the mask is causal within each sequence and a
    window of ``window`` tokens, so packed attention with window ``window - 1`` replaces it (a window longer than
    any sequence is none); the packed program equals the model on each sequence alone."""
    model = _MaskedAttention(window)
    gm = hcompile.capture(model, torch.randn(1, 24, 32)).graph_module
    out, records = run_passes(gm, [rewrite_packed_attention_pass], PassContext())
    assert records[0].modified and records[0].info["positions"] == 1  # the index aranges stay
    assert not any(n.target is torch.diff for n in out.graph.nodes), "the mask is gone"
    op = next(n for n in out.graph.nodes if n.target is codegen.packed_attention)
    assert op.kwargs.get("window") == kept
    x = torch.randn(1, 24, 32)
    cu = torch.tensor([0, 10, 17, 24], dtype=torch.int32)
    expected = torch.cat([model(x[:, a:b]) for a, b in [(0, 10), (10, 17), (17, 24)]], dim=2)
    torch.testing.assert_close(out(x, cu, 10)[0], expected, rtol=1e-5, atol=1e-5)


def test_a_mask_that_is_not_causal_is_a_named_error():
    gm = hcompile.capture(_MaskedAttention(window=1000, causal=False), torch.randn(1, 24, 32)).graph_module
    with pytest.raises(PassError, match="is not causal: query 0 sees the later key 1"):
        rewrite_packed_attention_pass(gm, PassContext())


class _InputMask(nn.Module):
    def forward(self, x):  # the mask depends on the data: out of scope
        q = x.view(1, 6, 2, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=(x.sum(-1) > 0)[:, None, :, None])


def test_a_mask_read_from_the_inputs_is_a_named_error():
    gm = hcompile.capture(_InputMask(), torch.randn(1, 6, 32)).graph_module
    with pytest.raises(PassError, match="not built from positions alone .*graph input"):
        rewrite_packed_attention_pass(gm, PassContext())


def _counted_positions(x):  # positions as a cumulative count of ones (1..T), as OPT builds them
    pos = torch.cumsum(torch.ones(1, x.shape[1], dtype=torch.long), dim=1) - 1
    q = (x + pos[..., None]).view(1, x.shape[1], 2, 16).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class _Counted(nn.Module):
    def forward(self, x):
        return _counted_positions(x)


@pytest.mark.parametrize("build", ["gpt", "llama", "window", "counted"])
def test_the_rewrite_gives_vals_to_its_new_nodes_alone_and_they_equal_a_full_propagation(build, monkeypatch):
    """The rewrite keeps every value it replaces (attention outputs, positions) in shape, dtype and strides, so it
    gives vals only to the nodes it adds (``fill_vals``) and never propagates the whole graph again; every
    node's val, the output's included, equals what a full propagation of the rewritten graph gives."""
    import passes.graph.pass_runner as runner
    from passes.graph.pass_runner import same_val

    if build in ("gpt", "llama"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=64)) if build == "gpt" else \
            Llama(LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64))
        gm = hcompile.capture(model, torch.zeros(1, 24, dtype=torch.long)).graph_module
    else:
        model = _MaskedAttention(4) if build == "window" else _Counted()
        gm = hcompile.capture(model, torch.randn(1, 24, 32)).graph_module

    def whole_graph(*args, **kwargs):
        raise AssertionError("the rewrite propagated the whole graph again")

    monkeypatch.setattr(runner, "propagate_vals", whole_graph)
    out, records = run_passes(gm, [rewrite_packed_attention_pass], PassContext())
    assert records[0].modified and (build != "counted" or records[0].info["positions"] == 1)
    filled = {n.name: n.meta.get("val") for n in out.graph.nodes}
    assert all(v is not None for n, v in filled.items() if n != "output") and filled["output"] is not None
    propagate_vals(out)
    for node in out.graph.nodes:
        assert same_val(filled[node.name], node.meta.get("val")), node.format_node()


def test_a_replaced_value_of_other_strides_makes_the_rewrite_propagate_the_whole_graph(monkeypatch):
    """Gemma 2's attention (a score cap, written out by hand) ends in a value whose strides differ from those of
    the packed attention's output, so the nodes after it would keep stale strides: the rewrite notices and
    propagates the whole graph, and every val equals a full propagation's."""
    pytest.importorskip("transformers")
    import passes.graph.pass_runner as runner
    from benchmarks.hf_families import make_model
    from passes.graph.normalize import canonical_graph
    from passes.graph.pass_runner import same_val

    calls = []
    whole = runner.propagate_vals
    monkeypatch.setattr(runner, "propagate_vals", lambda *a, **k: calls.append(1) or whole(*a, **k))
    gm = canonical_graph(hcompile.capture(make_model("gemma2"), torch.zeros(1, 16, dtype=torch.long)).graph_module)
    out, _ = run_passes(gm, [rewrite_packed_attention_pass], PassContext())
    assert calls == [1]
    filled = {n.name: n.meta.get("val") for n in out.graph.nodes}
    propagate_vals(out)
    for node in out.graph.nodes:
        assert same_val(filled[node.name], node.meta.get("val")), node.format_node()
