"""Every rank holds the same well-formed global batch before a step touches anything: a malformed batch or one
that differs on some rank is the same clear error on every rank, nothing changes, and the next step runs."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from runtime.batch_check import BatchError, agree_on_batch, local_batch_problem


@pytest.mark.parametrize("batch, needle", [
    ([], "non-empty list"),
    ("tokens", "non-empty list of 1-D token tensors, got str"),
    ([torch.zeros(2, 3, dtype=torch.long)], "sequence 0 .* 1-D integer tensor"),
    ([torch.ones(4, dtype=torch.long), torch.zeros(3)], "sequence 1 .* torch.float32"),
    ([torch.tensor([1, 2, 64])], "token id 64, outside the vocabulary \\[0, 64\\)"),
    ([torch.tensor([3, -1])], "token id -1"),
])
def test_local_problems_are_named(batch, needle):
    import re

    assert re.search(needle, local_batch_problem(batch, 64))
    with pytest.raises(BatchError):
        agree_on_batch(batch, 64)


def test_a_good_batch_gives_its_lengths():
    assert agree_on_batch([torch.tensor([1, 2, 3]), torch.tensor([5], dtype=torch.int32)], 64) == [3, 1]


def _cut(lengths, ids):
    return list(torch.split(ids, lengths))


IDS = torch.arange(90) % 64
SAME_TOKENS_OTHER_CUT = (_cut([20, 40, 30], IDS), _cut([30, 20, 40], IDS))
_CHANGED = IDS.clone()
_CHANGED[0] += 2  # position weights 1 and 2: a weighted sum of the ids is unchanged
_CHANGED[1] -= 1
TWO_IDS_CHANGED = (_cut([20, 40, 30], IDS), _cut([20, 40, 30], _CHANGED))


@pytest.mark.parametrize("pair", [SAME_TOKENS_OTHER_CUT, TWO_IDS_CHANGED])
def test_the_digest_tells_apart_what_a_linear_checksum_does_not(pair):
    from runtime.batch_check import _digest

    a, b = pair
    assert not torch.equal(_digest(a, None), _digest(b, None))
    assert torch.equal(_digest(a, None), _digest([t.to(torch.int32) for t in a], None))  # ids, not their dtype


def _mismatch(rank, world):
    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_

    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(loss="causal_lm",
                               optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=["2x(tp1)"],
                               tokens_per_rank=64, calibrate=False)
    good = [torch.arange(10) % 64, torch.arange(7) % 64]
    errors = []
    before = trainer.full_state_dict()
    for bad in ([torch.arange(10) % 64, torch.arange(7) % 64 + (rank == 1)],  # rank 1: other token ids
                [torch.arange(10) % 64] if rank == 1 else good,  # rank 1: other lengths
                [torch.arange(10) % 64, torch.tensor([1, 99])] if rank == 1 else good,  # rank 1: out of vocab
                *(pair[rank] for pair in (SAME_TOKENS_OTHER_CUT, TWO_IDS_CHANGED))):
        try:
            trainer.train_step(bad)
            errors.append(None)
        except BatchError as exc:
            errors.append(str(exc))
    unchanged = all(torch.equal(before[n], t) for n, t in trainer.full_state_dict().items())
    loss = trainer.train_step(good).loss  # the next good step runs
    return errors, unchanged, loss


def test_ranks_with_different_batches_all_raise_the_same_error(tmp_path):
    (e0, unchanged0, loss0), (e1, unchanged1, loss1) = run_ranks(2, tmp_path, _mismatch)
    assert e0 == e1 and all(e is not None for e in e0), e0
    assert "rank 1 was given another global batch than rank 0" in e0[0]
    assert "1 sequences, 10 tokens against 2, 17" in e0[1]
    assert "rank 1: sequence 1 holds token id 99, outside the vocabulary [0, 64)" in e0[2]
    assert all("rank 1 was given another global batch than rank 0 (3 sequences, 90 tokens" in e for e in e0[3:])
    assert unchanged0 and unchanged1 and loss0 == loss1 > 0
