"""Variants: token buckets, zero recompiles after warm-up, packed pipeline stages that chain to the model."""

import pytest
import torch
import torch.nn.functional as F

import hcompile
from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
from passes.graph.variant import TokenBuckets, VariantKey, pad_to_bucket
from passes.plan.ir import ParallelScheme


def _batch(gen, vocab, max_seqs=5, max_len=12):
    n = int(torch.randint(1, max_seqs + 1, (1,), generator=gen))
    lens = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return lens, ids, cu


def test_zero_recompiles_after_warm_up_over_20_batches_of_varying_lengths():
    model = init_weights_(Llama(LlamaConfig(layers=1)))
    compiled = hcompile.compile(model, buckets=TokenBuckets(sizes=(32, 64)), compile_backend="aot_eager")
    scheme = ParallelScheme()
    cache = compiled.lowerings()
    for bucket in (32, 64):  # warm-up: one batch per bucket compiles each variant once
        lens, ids, cu = _batch(torch.Generator().manual_seed(bucket), 96)
        cache.variant(scheme, 0, bucket)(ids, cu)
    variants = [cache.variant(scheme, 0, b) for b in (32, 64)]
    assert [v.counter.count for v in variants] == [1, 1]
    gen = torch.Generator().manual_seed(7)
    seen = set()
    for _ in range(20):
        lens, ids, cu = _batch(gen, 96, max_seqs=6)
        bucket = compiled.buckets.bucket_for(len(ids))
        seen.add((len(lens), len(ids)))
        variant = cache.variant(scheme, 0, bucket)
        out = variant.logits(variant(ids, cu), len(ids))
        ref = torch.cat([model(seq[None])[0] for seq in ids.split(lens)])
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert len(seen) >= 10  # lengths and sequence counts really varied
    assert [v.counter.count for v in variants] == [1, 1]


def test_pipeline_stage_variants_chain_to_the_model_forward_and_backward():
    model = init_weights_(GPT(GPTConfig(layers=4)))
    compiled = hcompile.compile(model, buckets=TokenBuckets(sizes=(32,)))
    scheme = ParallelScheme(pp=2)
    lens, ids, cu = _batch(torch.Generator().manual_seed(1), 96)
    cache = compiled.lowerings()
    first, last = cache.variant(scheme, 0, 32), cache.variant(scheme, 1, 32)
    assert first.boundary_out == last.boundary_in and first.boundary_in == ()
    names = {sl.name for sl in first.params} | {sl.name for sl in last.params}
    assert names == {n for n, _ in model.named_parameters()}
    sent = first(ids, cu)
    received = [t.detach().requires_grad_() for t in sent]
    logits = last.logits(last(ids, cu, *received), len(ids))
    targets = ids.roll(-1)
    F.cross_entropy(logits, targets, reduction="sum").backward()
    torch.autograd.backward(list(sent), [t.grad for t in received])
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.cat([model(seq[None])[0] for seq in ids.split(lens)])
    F.cross_entropy(ref, targets, reduction="sum").backward()
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_buckets_and_keys_validate_and_quote():
    b = TokenBuckets.powers_of_two(16, 100)
    assert b.sizes == (16, 32, 64, 128) and b.bucket_for(17) == 32 and b.bucket_for(16) == 16
    with pytest.raises(ValueError, match="200 tokens exceed the largest bucket 128"):
        b.bucket_for(200)
    with pytest.raises(ValueError, match=r"strictly ascending, got \(4, 2\)"):
        TokenBuckets(sizes=(4, 2))
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\) for \(tp1,pp2\), got 2"):
        VariantKey(scheme=ParallelScheme(pp=2), stage=2, bucket=8)
    assert VariantKey(scheme=ParallelScheme(tp=2, pp=2), stage=1, bucket=64).describe() == "(tp2,pp2)/stage1/bucket64"


def test_pad_to_bucket_appends_one_padding_sequence():
    ids, cu = pad_to_bucket(torch.arange(5), torch.tensor([0, 2, 5], dtype=torch.int32), 8)
    assert ids.tolist() == [0, 1, 2, 3, 4, 0, 0, 0] and cu.tolist() == [0, 2, 5, 8]
