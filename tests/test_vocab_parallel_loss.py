"""The vocabulary-parallel cross-entropy (``runtime.loss.vocab_parallel_loss_sum``) on 2 and 4 gloo ranks against
``F.cross_entropy`` on the whole logits in one process: the loss (the same on every rank) and the gradient of every
logit, in fp32 and bf16, with ignored targets, padding rows, the packed next-token form and the explicit-targets
form, even and uneven vocabulary splits; and the refusals (wrong width, bad ranges, a second backward)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_util import run_ranks
from test_equivalence import reference_sgd

from runtime.loss import (
    IGNORE,
    VocabShard,
    next_token_targets,
    packed_causal_lm_loss_sum,
    targets_loss_sum,
    vocab_parallel_loss_sum,
    vocab_shard_of,
)


def _ranges(vocab: int, world: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering ``vocab``, the first ``vocab % world`` one wider (uneven when it does not divide)."""
    base, extra = divmod(vocab, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _case(vocab: int, tokens: int, dtype: torch.dtype, seed: int):
    """Whole logits (tokens + 3 padding rows), a packed batch's ids and offsets, explicit targets with IGNOREs."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens + 3, vocab, generator=g) * 4).to(dtype)
    ids = torch.randint(0, vocab, (tokens + 3,), generator=g)
    cu = torch.tensor([0, 5, 6, tokens - 4, tokens], dtype=torch.int32)  # a one-token sequence; 3 padding rows after
    targets = torch.randint(0, vocab, (tokens + 3,), generator=g)
    targets[::4] = IGNORE
    return logits, ids, cu, targets


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    whole = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(whole[: targets.shape[0]].float(), targets, ignore_index=IGNORE, reduction="sum")
    (loss * 0.75).backward()
    return loss.detach(), whole.grad


def _worker(rank, world, vocab, dtype):
    group = dist.group.WORLD.group_name
    start, stop = _ranges(vocab, world)[rank]
    shard = VocabShard(start=start, stop=stop, group=group)
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    losses = []
    for seed, tokens in ((0, 17), (1, 30)):
        logits, ids, cu, targets = _case(vocab, tokens, dtype, seed)
        for form, want_targets in (("packed", next_token_targets(ids, cu)), ("targets", targets)):
            want_loss, want_grad = _reference(logits, want_targets)
            mine = logits[:, start:stop].clone().requires_grad_(True)
            loss = (packed_causal_lm_loss_sum(mine, ids, cu, shard) if form == "packed"
                    else targets_loss_sum(mine, targets, shard))
            assert loss.dtype == torch.float32, (form, loss.dtype)
            (loss * 0.75).backward()
            torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=0.0, msg=f"{form} loss")
            assert mine.grad.dtype == dtype
            torch.testing.assert_close(mine.grad, want_grad[:, start:stop], **tol, msg=f"{form} grad")
            assert torch.all(mine.grad[want_targets.shape[0]:] == 0), "padding rows past the targets get no gradient"
            ignored = torch.nonzero(want_targets == IGNORE).flatten()
            assert torch.all(mine.grad[ignored] == 0), "ignored targets get no gradient"
            losses.append(float(loss))
    return losses


def _refusals(rank, world):
    group = dist.group.WORLD.group_name
    shard = VocabShard(start=4 * rank, stop=4 * rank + 4, group=group)
    with pytest.raises(ValueError, match=r"logits must be \(tokens, 4\)"):
        vocab_parallel_loss_sum(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), shard)
    with pytest.raises(ValueError, match=r"targets must be \(3,\)"):
        vocab_parallel_loss_sum(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), shard)
    x = torch.randn(3, 4, requires_grad=True)
    loss = vocab_parallel_loss_sum(x, torch.tensor([0, 5, IGNORE]), shard)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated once"):
        loss.backward()
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_loss_equals_cross_entropy_fp32(world, tmp_path):
    """An even split (96 over 2 or 4) and an uneven one (37 does not divide by 2 or 4): fp32, rtol 1e-6."""
    for vocab in (96, 37):
        losses = run_ranks(world, tmp_path, _worker, vocab, torch.float32, timeout_s=180)
        assert all(r == losses[0] for r in losses), f"every TP rank has the same loss: {losses}"


def test_vocab_parallel_loss_bf16_logits(tmp_path):
    """bf16 logits: the loss in fp32 as ``F.cross_entropy(logits.float())``, the gradient in bf16."""
    losses = run_ranks(2, tmp_path, _worker, 50, torch.bfloat16, timeout_s=180)
    assert losses[0] == losses[1]


def test_vocab_parallel_loss_refusals(tmp_path):
    assert run_ranks(2, tmp_path, _refusals, timeout_s=120) == [True, True]


def test_vocab_shard_validation():
    with pytest.raises(ValueError, match=r"0 <= start < stop, got \[4, 4\)"):
        VocabShard(start=4, stop=4, group="g")
    with pytest.raises(TypeError, match="start must be an int"):
        VocabShard(start=0.0, stop=4, group="g")
    with pytest.raises(ValueError, match="process group's name"):
        VocabShard(start=0, stop=4, group="")


class _Lowering:
    def __init__(self, vocab_range):
        self.vocab_range = vocab_range

    def describe(self):
        return "stand-in"


class _Program:
    def __init__(self, vocab_range, tp_group):
        self.lowering, self.tp_group = _Lowering(vocab_range), tp_group


def test_vocab_shard_of_a_program():
    assert vocab_shard_of(_Program(None, "g")) is None
    assert vocab_shard_of(object()) is None
    assert vocab_shard_of(_Program((8, 16), "g")) == VocabShard(start=8, stop=16, group="g")
    with pytest.raises(ValueError, match="names no tensor-parallel group"):
        vocab_shard_of(_Program((8, 16), None))



def _self_check(rank, world, swap):
    """The lowering self-check of a tp2 LLaMA whose logits this rank holds split by vocabulary (today's vocab-
    parallel head, its gathered output narrowed to this rank's columns, as ``split_logits`` leaves it), the
    logits gathered back by ``hcompile.verify.with_gathered_logits`` for the comparison. ``swap``: each rank
    names the other's columns, which the check must find wrong."""
    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_
    from hcompile.verify import model_reference, with_gathered_logits
    from passes.graph.lowering import LoweringCache, lower_graph
    from passes.graph.lowering_check import check_lowering
    from passes.graph.variant import TokenBuckets
    from passes.plan.ir import ParallelScheme

    group = dist.group.WORLD.group_name
    model = init_weights_(Llama(LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)), seed=2)
    compiled = hcompile.compile(model, buckets=TokenBuckets(sizes=(32,)))
    cache = LoweringCache(lambda tokens: compiled.captured(tokens).graph_module, compiled.buckets, kernel="reference",
                          vocab_parallel=True)
    scheme = ParallelScheme(tp=2)
    lowering = cache.lowering(scheme, 0, rank, group)
    start, stop = _ranges(64, 2)[rank]
    claimed = _ranges(64, 2)[1 - rank] if swap else (start, stop)

    def lower(gm):
        lowered = lower_graph(gm, scheme, tp_rank=rank, tp_group=group, attention_kernel="reference",
                              tensor_parallel=lowering.tensor_parallel)
        graph = lowered.graph_module.graph
        output = next(n for n in graph.nodes if n.op == "output")
        (first, *rest) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        with graph.inserting_before(output):
            mine = graph.call_function(torch.narrow, (first, -1, start, stop - start))
        output.args = ((mine, *rest),) if isinstance(output.args[0], (tuple, list)) else (mine,)
        lowered.graph_module.recompile()
        return with_gathered_logits(lowered, group, claimed, 2)

    report = check_lowering(cache.capture(32), scheme, tp_rank=rank, tp_group=group, lower=lower,
                            reference=model_reference(model, torch.device("cpu")), buffer=lambda n, v: v, vocab=64,
                            device=torch.device("cpu"), dtype=torch.float32)
    return report.ok, report.describe()


def test_self_check_gathers_split_logits(tmp_path):
    """Split logits gathered for the self-check agree with the model (logits and every gradient); the same
    logits claimed as the other rank's columns are refused (the gather places blocks by rank, so the wrong claim
    shows in the gradients it hands back)."""
    for ok, text in run_ranks(2, tmp_path, _self_check, False, timeout_s=180):
        assert ok, text
    for ok, text in run_ranks(2, tmp_path, _self_check, True, timeout_s=180):
        assert not ok and "differ for" in text, text


# End to end: a trainer under 1x(tp2) with vocab_parallel on (the logits split by vocabulary, the loss assembled by
# the vocabulary-parallel cross-entropy) equals plain single-process SGD, loss and every parameter.

E2E_LENS = [[14, 22, 15, 23, 13, 20, 9], [9, 33, 21, 2, 17, 24, 11]]


def _e2e_model(name: str):
    if name.startswith("hf_llama"):
        from benchmarks import hf_families
        model = hf_families.make_model("llama")
        if name == "hf_llama":  # "hf_llama_pad" keeps the pad token's padding_idx
            model.model.embed_tokens.padding_idx = None
        return model, hf_families.VOCAB
    from hcompile.models import GPT, GPTConfig, Llama, LlamaConfig, init_weights_
    if name == "gpt":
        return init_weights_(GPT(GPTConfig(layers=2, heads=4, hidden=32, vocab=64, block_size=256)), seed=3), 64
    return init_weights_(Llama(LlamaConfig(layers=2, heads=4, kv_heads=2, hidden=32, ffn_hidden=64, vocab=64)),
                         seed=3), 64


def _e2e_batches(vocab: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, vocab, (n,), generator=g) for n in lens] for lens in E2E_LENS]


def _e2e_train(rank, world, name, strategy, vocab_parallel):
    import hcompile
    import runtime.loss as loss_mod
    from passes.graph.variant import TokenBuckets

    calls = []
    real = loss_mod.vocab_parallel_loss_sum

    def counted(logits, targets, shard):  # the real function, counted: shows the split path ran
        calls.append((shard.start, shard.stop, tuple(logits.shape)))
        return real(logits, targets, shard)

    loss_mod.vocab_parallel_loss_sum = counted
    model, vocab = _e2e_model(name)
    trainer = hcompile.compile(model, buckets=TokenBuckets(sizes=(16, 32, 64))).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, strategies=[strategy],
        tokens_per_rank=32, calibrate=False, vocab_parallel=vocab_parallel)
    out = []
    for batch in _e2e_batches(vocab):
        stats = trainer.train_step(batch, strategy=strategy)
        out.append((stats.loss, trainer.full_state_dict()))
    ranges = {key[1]: getattr(lw[-1], "vocab_range", None) for key, lw in trainer.lowerings._lowerings.items()
              if key[0].tp > 1}  # the last stage's: its logits
    return out, calls, ranges


def _reference_sgd(name: str, lr: float):
    model, vocab = _e2e_model(name)
    return reference_sgd(model, _e2e_batches(vocab), lr)


@pytest.mark.parametrize("name,strategy,world", [("gpt", "1x(tp2)", 2), ("llama", "1x(tp2)", 2),
                                                 ("hf_llama", "1x(tp2)", 2), ("llama", "1x(tp2,pp2)", 4),
                                                 ("hf_llama_pad", "1x(tp2)", 2)])
def test_tp2_trainer_with_vocab_parallel_matches_single_process_sgd(name, strategy, world, tmp_path):
    """A tp2 replica (alone on 2 gloo ranks, or pipelined over 4), ``vocab_parallel=True``: each last-stage rank's
    logits are half the vocabulary, the loss is the vocabulary-parallel one (through ``runtime.pipeline`` too),
    and the loss of every step and every parameter after it equal plain single-process SGD."""
    per_rank = run_ranks(world, tmp_path, _e2e_train, name, strategy, True, timeout_s=400)
    losses, states = _reference_sgd(name, 0.5)
    vocab = _e2e_model(name)[1]
    assert sum(bool(calls) for _, calls, _ in per_rank) == 2, "the loss runs on the last stage's two TP ranks"
    for rank, (out, calls, ranges) in enumerate(per_rank):
        ((tp_rank, vocab_range),) = ranges.items()  # this rank's lowering: its TP rank and its logits' columns
        assert vocab_range == _ranges(vocab, 2)[tp_rank], f"rank {rank}: the lowering's vocab_range {vocab_range}"
        assert all((a, b) == vocab_range and shape[1] == b - a for a, b, shape in calls), (rank, calls)
        for step, (loss, state) in enumerate(out):
            assert loss == pytest.approx(losses[step], rel=1e-5), (name, rank, step)
            for n, p in states[step].items():
                torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank} step {step} {n}")


def test_trainer_options_are_validated_and_reach_the_lowerings():
    """``vocab_parallel`` is a bool, on by default; ``CompiledModel.lowerings`` hands it to the cache with
    ``split_logits``."""
    import hcompile
    from hcompile.models import Llama, LlamaConfig
    from hcompile.train import TrainOptions

    assert TrainOptions().vocab_parallel is True
    with pytest.raises(ValueError, match="vocab_parallel must be True or False, got 'yes'"):
        TrainOptions(vocab_parallel="yes")
    compiled = hcompile.compile(Llama(LlamaConfig(layers=1, heads=2, kv_heads=2, hidden=16, ffn_hidden=32, vocab=64)))
    for flag in (True, False):
        cache = compiled.lowerings(vocab_parallel=flag)
        assert cache.vocab_parallel is flag and cache.split_logits is flag
