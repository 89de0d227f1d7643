"""Token mixing (issue 56 item 0): every op that reads other tokens of the sequence besides attention is found in
the packed graph and refused by name before step 1, at any model size and with the self-check off: small models
(a convolution over tokens, a cumulative sum, a roll, a shift, a reduction over tokens) against the same model
without it; Hugging Face LFM2 (short causal convolutions) and Jamba (a Mamba layer: a causal convolution and a
selective scan) refused by the trainer with ``self_check=False``; tp2 and pipeline lowerings refuse too; the
project's own LLaMA and GPT and Hugging Face families that train today (a mixture of experts included) untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hcompile
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.lowering import decide_lowerings, lower_graph
from passes.graph.normalize import CANONICAL_PASSES
from passes.graph.packed_attention import rewrite_packed_attention_pass
from passes.graph.pass_runner import PassContext, PassError, copy_graph_module, run_passes
from passes.graph.token_mixing import token_mixing_sites
from passes.graph.variant import TokenBuckets
from passes.plan.ir import ParallelScheme

T = 24


class _Toy(nn.Module):
    """Embedding, one op over the tokens (``mix``), causal SDPA over 2 heads, a head; ``mix`` names the op."""

    def __init__(self, mix: str = "none"):
        super().__init__()
        self.mix = mix
        self.emb = nn.Embedding(32, 16)
        self.conv = nn.Conv1d(16, 16, kernel_size=3 if mix != "conv_k1" else 1, groups=16,
                              padding=2 if mix != "conv_k1" else 0)
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def _mixed(self, x: torch.Tensor) -> torch.Tensor:  # x (1, T, 16)
        t = x.shape[1]
        if self.mix in ("conv", "conv_k1"):
            return self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)
        if self.mix == "cumsum":
            return torch.cumsum(x, dim=1)
        if self.mix == "roll":
            return torch.roll(x, 1, dims=1)
        if self.mix == "shift":
            return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        if self.mix == "index_shift":  # a gather of the previous token
            return x[:, (torch.arange(t) - 1).clamp(min=0)]
        if self.mix == "pad":
            return F.pad(x, (0, 0, 1, 0))[:, :t]
        if self.mix == "mean_tokens":
            return x - x.mean(dim=1, keepdim=True)
        if self.mix == "softmax_tokens":
            return x * x.softmax(dim=-2)
        if self.mix == "token_matmul":
            return torch.ones(t, t).tril() @ x / t  # a running mean over the tokens
        if self.mix == "features":  # per token: reductions, softmax and matmuls over features only
            return x * x.softmax(-1) + x.mean(-1, keepdim=True) + torch.cumsum(x, dim=-1)
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._mixed(self.emb(ids))
        q, k, v = (p(x).view(1, ids.shape[1], 2, 8).transpose(1, 2) for p in (self.q, self.k, self.v))  # (1,2,T,8)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(out.transpose(1, 2).reshape(1, ids.shape[1], 16) + x)


def _packed(model: nn.Module, tokens: int = T):
    gm = hcompile.capture(model, torch.zeros(1, tokens, dtype=torch.long)).graph_module
    out, _ = run_passes(copy_graph_module(gm), [*CANONICAL_PASSES, rewrite_packed_attention_pass], PassContext())
    return out


@pytest.mark.parametrize("mix, op", [("conv", "conv1d"), ("cumsum", "cumsum"), ("roll", "roll"), ("shift", "getitem"),
                                     ("pad", "pad"), ("index_shift", "getitem"), ("mean_tokens", "mean"),
                                     ("softmax_tokens", "softmax"), ("token_matmul", "matmul")])
def test_an_op_over_the_tokens_is_found_by_name(mix, op):
    sites = token_mixing_sites(_packed(_Toy(mix)))
    assert sites, mix
    assert sites[0].op == op, [s.describe() for s in sites]
    assert "token dim" in sites[0].why
    assert "test_token_mixing.py:" in sites[0].source  # the model's own line
    if mix == "conv":
        assert sites[0].module == "conv (Conv1d)" and "kernel 3" in sites[0].why


@pytest.mark.parametrize("mix", ["none", "features", "conv_k1"])
def test_per_token_ops_pass(mix):
    """Reductions, softmaxes, cumulative sums over features and a kernel-1 convolution keep tokens apart."""
    assert token_mixing_sites(_packed(_Toy(mix))) == []


def test_the_projects_own_models_pass():
    llama = init_weights_(Llama(LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)), seed=0)
    gpt = init_weights_(GPT(GPTConfig(layers=2, heads=4, vocab=64)), seed=0)
    for model in (llama, gpt):
        assert token_mixing_sites(_packed(model)) == [], type(model).__name__


def test_every_lowering_refuses_it_by_name():
    """The check is a lowering pass: tp1, tp2 and pipeline stages alike, whatever the self-check would do."""
    gm = hcompile.capture(_Toy("cumsum"), torch.zeros(1, T, dtype=torch.long)).graph_module
    with pytest.raises(PassError, match=r"token mixing: .*cumsum in <top> at test_token_mixing.py:\d+"):
        lower_graph(gm, ParallelScheme(tp=1, pp=1))
    for scheme in (ParallelScheme(tp=2, pp=1), ParallelScheme(tp=1, pp=2)):
        with pytest.raises(PassError, match="cumsum"):
            decide_lowerings(gm, scheme, tp_group="tp")
    lower_graph(hcompile.capture(_Toy(), torch.zeros(1, T, dtype=torch.long)).graph_module, ParallelScheme(tp=1, pp=1))


transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _lfm2() -> nn.Module:
    """LFM2: a short causal convolution layer, then an attention layer."""
    torch.manual_seed(0)
    config = transformers.Lfm2Config(layer_types=["conv", "full_attention"], max_position_embeddings=256, **_SMALL)
    return transformers.Lfm2ForCausalLM(config)


def _jamba() -> nn.Module:
    """Jamba: a Mamba layer (causal convolution, selective scan on the PyTorch path), then an attention layer."""
    torch.manual_seed(0)
    config = transformers.JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
                                      expert_layer_offset=99, num_experts=1, mamba_d_state=4, mamba_d_conv=4,
                                      mamba_expand=2, mamba_dt_rank=4, **_SMALL)
    return transformers.JambaForCausalLM(config)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_oss", "llama4_chunked"])
def test_hf_families_that_train_today_pass(name):
    """A few of ``benchmarks.hf_families``' families: rotary and learned positions, fused projections, complex
    rotary (Llama 4), a mixture of experts routing tokens by a sort of the chosen experts (GPT-OSS)."""
    from benchmarks import hf_families

    assert token_mixing_sites(_packed(hf_families.make_model(name), 32)) == []


def test_a_mamba2_hybrid_is_found_by_name():
    """Falcon-H1 (attention and a Mamba 2 mixer side by side in every layer, the PyTorch path): its causal
    convolution and its chunked scan."""
    torch.manual_seed(0)
    config = transformers.FalconH1Config(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=4,
                                         mamba_d_head=16, mamba_d_ssm=64, mamba_n_groups=1, mamba_chunk_size=16,
                                         **_SMALL)
    sites = token_mixing_sites(_packed(transformers.FalconH1ForCausalLM(config), 32))
    found = {(s.op, s.module) for s in sites}
    for layer in (0, 1):
        assert ("conv1d", f"model.layers.{layer}.mamba (FalconH1Mixer)") in found, found
        assert ("tensor_split", f"model.layers.{layer}.mamba (FalconH1Mixer)") in found, found


@pytest.mark.parametrize("make, module, ops", [(_lfm2, "model.layers.0.conv (Lfm2ShortConv)", ["conv1d"]),
                                               (_jamba, "model.layers.0.mamba (JambaMambaMixer)",
                                                ["conv1d", "tensor_split"])])
def test_hf_hybrids_are_refused_by_name_before_any_step_with_the_self_check_off(make, module, ops):
    model = make()
    trainer = hcompile.compile(model, buckets=TokenBuckets(sizes=(32,))).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=["1x(tp1)"],
        tokens_per_rank=32, self_check=False, calibrate=False)
    before = trainer.full_state_dict()
    batch = [torch.randint(0, 64, (n,)) for n in (20, 9, 30)]
    with pytest.raises(hcompile.LoweringError) as refused:
        trainer.train_step(batch, strategy="1x(tp1)")
    message = str(refused.value)
    assert "token mixing" in message and module in message, message
    for op in ops:
        assert f"{op} in {module}" in message, message
    assert all(torch.equal(before[n], p) for n, p in trainer.full_state_dict().items())
