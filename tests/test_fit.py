"""The README's training loop overlaps planning by itself: from the second step on, each step's plan was computed
while the previous step ran (planning started before that step's compute ended and finished before the plan was
needed), each batch is checked once, and no batch past the last step is taken; a plain ``train_step(batch)``
loop never claims a hidden plan."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

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
    trainer._check = lambda batch: checked.append(len(batch)) or check(batch)
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
