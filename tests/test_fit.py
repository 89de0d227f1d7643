"""The README's training loop overlaps planning by itself: from the second step on, each step's plan was computed
while the previous step ran (planning started before that step's compute ended and finished before the plan was
needed), each batch is checked once, and no batch past the last step is taken; a plain ``train_step(batch)``
loop never claims a hidden plan."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks
from fault_round_four import Tokens, position_after
from fault_round_four import data as _data

transformers = pytest.importorskip("transformers")

TEXT = ["def f(x):\n    return x * 2\n" * 3, "class A:\n    pass\n" * 5, "import os\nprint(os.getcwd())\n" * 4,
        "for i in range(10):\n    print(i)\n" * 6, "x = [1, 2, 3]\n" * 9, "while True:\n    break\n" * 7]


def _readme_loop(rank, world):
    import hcompile
    from hcompile.data import ByteTokenizer, Corpus, TokenBatches

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa"))
    trainer = hcompile.compile(model).trainer(loss="causal_lm", optimizer=torch.optim.AdamW,
                                              optimizer_kwargs={"lr": 3e-3}, strategies="auto",
                                              tokens_per_rank=128, calibrate=False)
    data = TokenBatches(Corpus(TEXT), ByteTokenizer(), tokens_per_batch=384, max_len=128, seed=0)
    checked = []
    check = trainer._check
    trainer._check = lambda batch, **kw: (batch is not None and checked.append(len(batch))) or check(batch, **kw)
    stats = []
    trainer.fit(data, steps=5, on_step=lambda step, s: stats.append(s))
    position, fit_checks = data.state_dict(), len(checked)
    reference = TokenBatches(Corpus(TEXT), ByteTokenizer(), tokens_per_batch=384, max_len=128, seed=0)
    for _ in range(5):
        reference.next_batch()
    plain = [trainer.train_step(data.next_batch()) for _ in range(2)]
    return ([(s.plan_hidden, s.plan_window, s.compute_window) for s in stats], fit_checks,
            position == reference.state_dict(), [s.plan_hidden for s in plain])


def test_the_readme_loop_hides_planning_from_the_second_step(tmp_path):
    for rank, (steps, checks, position_kept, plain) in enumerate(run_ranks(2, tmp_path, _readme_loop,
                                                                          timeout_s=240)):
        assert len(steps) == 5 and checks == 5, (len(steps), checks)  # each batch checked once
        assert position_kept  # fit took no batch past its fifth step
        assert steps[0][0] is False  # the first plan: no step ran while it was planned
        assert plain == [False, False]  # planned when asked: nothing hid it
        if rank == 0:  # the planning and compute windows are rank 0's clock
            for previous, (hidden, (started, finished, needed), _) in zip(steps, steps[1:]):
                compute_end = previous[2][1]
                assert started < compute_end and finished <= needed, (started, compute_end, finished, needed)
                assert hidden
        assert all(hidden for hidden, _, _ in steps[1:])  # rank 0's verdict, broadcast with the plan


def _fit_after_errors(rank, world):
    import hcompile
    from hcompile.data import DataError
    from hcompile.models import Llama, LlamaConfig, init_weights_

    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(vocab=64)), seed=0)).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=["1x(tp1)"],
        tokens_per_rank=128, calibrate=False)
    out = {}
    # A: the tokenizer raises inside next_batch while fit fetches batch 4 (batch 3 held, untrained)
    reference, probe = _data(), Tokens()
    reference.tokenizer = probe
    for _ in range(4):
        reference.next_batch()
    data, trained, positions = _data(Tokens(fail_rank=0, fail_at=probe.calls + 1)), [], []
    try:
        trainer.fit(data, steps=10, on_step=lambda step, s: (trained.append(step),
                                                             positions.append(trainer.data_position(data))))
    except DataError as exc:
        out["a"] = [str(exc), type(exc.__cause__).__name__, len(trained), data.state_dict() == position_after(3),
                    positions == [position_after(n) for n in (1, 2, 3)]]
    # resumed from that position, the next batch is batch 3
    out["a_resumes"] = all(torch.equal(x, y) for x, y in zip(next(data), _next_batch_after(3)))
    # B: on_step raises after step 1: the batch fit held is put back
    data = _data()

    def stop(step, stats):
        if step == 1:
            raise KeyboardInterrupt("stop")
    try:
        trainer.fit(data, on_step=stop)
    except KeyboardInterrupt:
        out["b"] = data.state_dict() == position_after(2)
    # C: a plain generator that raises: the batch held is in trainer.untrained
    def gen():
        source = _data()
        for _ in range(3):
            yield source.next_batch()
        raise OSError("the disk went away")
    try:
        trainer.fit(gen())
    except DataError as exc:
        expected = _data()
        batches = [expected.next_batch() for _ in range(3)]
        out["c"] = [str(exc), type(exc.__cause__).__name__, len(trainer.untrained),
                    all(torch.equal(x, y) for x, y in zip(trainer.untrained[0], batches[2]))]
    # D: a source that ends: fit returns, nothing held
    out["d"] = trainer.fit(iter([_data().next_batch()])) is not None and trainer.untrained == []
    return out


def _next_batch_after(n: int):
    data = _data()
    for _ in range(n):
        data.next_batch()
    return data.next_batch()


def test_fit_after_an_error_leaves_the_source_at_the_first_untrained_batch(tmp_path):
    """The source's position after ``fit`` ends by an exception (its tokenizer's inside ``next_batch``, an
    ``on_step``'s) is the first batch no step trained, and ``data_position`` in ``on_step`` is too; a plain
    iterator's untrained batches are in ``trainer.untrained``; an iterator's error is a ``DataError`` chained
    to it."""
    (out,) = run_ranks(1, tmp_path, _fit_after_errors, timeout_s=240)
    message, cause, trained, at_first_untrained, positions = out["a"]
    assert message.startswith("the batches raised on rank 0: ValueError: corrupt record in encode call")
    assert cause == "ValueError" and trained == 3 and at_first_untrained and positions
    assert out["a_resumes"] and out["b"]
    assert out["c"] == ["the batches raised on rank 0: OSError: the disk went away", "OSError", 1, True]
    assert out["d"]
