"""Graph analysis: node classes, attention sites, FLOPs against the closed form, the analytic cost model."""

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from hcompile.capture import capture
from hcompile.models import GPT, Llama, LlamaConfig, llama_preset
from passes.graph.analyze import Hardware, OpClass, analytic_cost_model, analyze_graph, attention_sites, classify_node
from passes.graph.pass_runner import propagate_vals
from passes.plan.ir import ParallelScheme

PROFILES = Path(__file__).resolve().parent.parent / "passes" / "plan" / "data" / "profiles"


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, ids):
        x = self.norm(self.emb(ids))
        q, k, v = self.qkv(x).split(8, dim=-1)
        q, k, v = (t.view(1, -1, 2, 4).transpose(1, 2) for t in (q, k, v))
        return F.gelu(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_hand_built_graph_classes_and_golden_summary():
    gm = fx.symbolic_trace(_Tiny())
    propagate_vals(gm, [torch.zeros(1, 5, dtype=torch.long)])
    classes = {n.name: classify_node(n).value for n in gm.graph.nodes if n.op != "call_module"}
    assert classes["gelu"] == "elementwise" and classes["scaled_dot_product_attention"] == "attention"
    assert classes["split"] == "view" and classes["ids"] == "input"
    # call_module nodes are left to capture's normalisation; symbolic_trace keeps them
    (site,) = attention_sites(gm)
    assert (site.heads, site.kv_heads, site.head_dim, site.causal) == (2, 2, 4, True)


def test_captured_gpt_analysis_golden():
    cap = capture(GPT(), torch.zeros(1, 8, dtype=torch.long))
    an = analyze_graph(cap.graph_module)
    assert an.describe() == (
        "layers=2 hidden=64 params=114432 linear_flops/token=2.089e+05 attn_flops/seq^2=256 "
        "ops[attention=2,elementwise=7,embedding=2,input=1,linear=9,norm=5,other=1,output=1,param=28,view=26]"
    )
    norms = [n for n in cap.graph_module.graph.nodes if classify_node(n) is OpClass.NORM]
    assert norms and all(n.target is F.layer_norm for n in norms)


def test_rmsnorm_written_by_hand_is_classified_as_norm():
    cap = capture(Llama(LlamaConfig(layers=1)), torch.zeros(1, 8, dtype=torch.long))
    rsqrt = [n for n in cap.graph_module.graph.nodes if n.target is torch.rsqrt]
    assert rsqrt and all(classify_node(n) is OpClass.NORM for n in rsqrt)
    (site,) = analyze_graph(cap.graph_module).attention
    assert (site.heads, site.kv_heads) == (4, 2) and site.module.endswith("self_attn")


@functools.lru_cache(maxsize=None)
def _meta_analysis(preset):
    with torch.device("meta"):
        model = Llama(llama_preset(preset))
    return analyze_graph(capture(model, torch.zeros(1, 8, dtype=torch.long, device="meta")).graph_module)


@pytest.mark.parametrize("preset", ["7b", "13b", "32b"])
def test_linear_flops_match_closed_form_on_meta(preset):
    profile = json.loads((PROFILES / f"a800-llama-{preset}.json").read_text())["model"]
    cfg = llama_preset(preset)
    assert (cfg.layers, cfg.hidden, cfg.ffn_hidden, cfg.heads, cfg.vocab) == (
        profile["layers"], profile["hidden"], profile["ffn_hidden"], profile["heads"], profile["vocab"])
    an = _meta_analysis(preset)
    L, H, ffn, V = cfg.layers, cfg.hidden, cfg.ffn_hidden, cfg.vocab
    params = L * (4 * H * H + 3 * H * ffn + 2 * H) + 2 * V * H + H  # closed form, untied embeddings
    assert an.param_count == params
    assert abs(an.train_linear_flops_per_token() / (6 * params) - 1) < 0.05
    assert an.layers == L and an.hidden == H
    assert an.attention_flops_per_seq_sq == pytest.approx(L * 2 * H)  # causal: half of 4*H per layer


def test_analytic_cost_model_is_close_to_the_profile():
    an = _meta_analysis("7b")
    schemes = [ParallelScheme(tp=t) for t in (2, 4, 8)] + [ParallelScheme(tp=2, pp=2)]
    cm = analytic_cost_model(an, Hardware.a800(), schemes)
    profile = {(s["tp"], s["pp"]): s for s in json.loads((PROFILES / "a800-llama-7b.json").read_text())["schemes"]}
    for scheme in schemes:
        ours, measured = cm.cost(scheme), profile[(scheme.tp, scheme.pp)]
        assert 0.5 < ours.b / measured["b"] < 2.0, scheme
        assert 0.2 < ours.a / measured["a"] < 5.0, scheme
    assert cm.max_tokens(ParallelScheme(tp=8)) > cm.max_tokens(ParallelScheme(tp=2)) > 0


def test_hardware_validation_quotes_the_value():
    with pytest.raises(ValueError, match="peak_tflops must be a finite number > 0, got -1"):
        Hardware(name="x", peak_tflops=-1)
