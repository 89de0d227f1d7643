"""``hcompile.compile(model).trainer(loss=...)`` in a plain ``python`` process (no launcher, no MASTER_ADDR) trains as a
world of one, and matches single-process SGD."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hcompile.models import Llama, LlamaConfig, init_weights_

SCRIPT = textwrap.dedent("""
    import json, torch, hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_
    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig()), seed=0)).trainer(loss="causal_lm",
                               optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, tokens_per_rank=64)
    g = torch.Generator().manual_seed(0)
    losses = [trainer.train_step([torch.randint(0, 96, (n,), generator=g) for n in (30, 12, 50)]).loss
              for _ in range(2)]
    print(json.dumps({"losses": losses, "strategy": trainer.last_plan.plan.strategy.describe()}))
""")


def test_a_plain_process_is_a_world_of_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["strategy"] == "1x(tp1,pp1)"
    model = init_weights_(Llama(LlamaConfig()), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for got in result["losses"]:
        batch = [torch.randint(0, 96, (n,), generator=g) for n in (30, 12, 50)]
        loss = sum(F.cross_entropy(model(s[None])[0, :-1], s[1:], reduction="sum") for s in batch) / 89
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(float(loss.detach()), rel=1e-5)
