"""Runtime on 4 gloo ranks: planning overlapped on rank 0 and broadcast, AdamW on the sharded layout
against single-process AdamW, and a checkpoint resume that continues exactly."""

import pytest
import torch
from dist_util import run_ranks
from staged_lm import StagedPrograms, init_params, reference_loss
from test_runtime_executor import CPU_MODEL, batches

from passes.plan.ir import Strategy
from passes.plan.policies import Planner

POOL = [Strategy.parse(s) for s in ["4x(tp1)", "1x(tp1,pp2)+2x(tp1)", "2x(tp1,pp2)"]]


def _setup(rank, world):
    from runtime.distributed import DistContext
    from runtime.executor import Executor
    from runtime.fixed_layout import FixedLayout
    from runtime.topology import Cluster

    ctx = DistContext(rank=rank, world_size=world, dist_backend="gloo", device=torch.device("cpu"))
    layout = FixedLayout.from_tensors(init_params(0), rank, world)
    opt = torch.optim.AdamW([layout.shard], lr=1e-2, weight_decay=0.1)
    return layout, opt, Executor(ctx, Cluster.local(world), layout, opt)


def five_batches():
    g = torch.Generator().manual_seed(9)
    return batches() + [[torch.randint(0, 61, (n,), generator=g) for n in step]
                        for step in ([21, 4, 4, 50, 6], [3, 33, 12, 12, 19, 7])]


def _run(rank, world, ckpt_dir):
    from runtime.checkpoint import load_checkpoint, save_checkpoint
    from runtime.planning import PlanService

    data = five_batches()
    service = PlanService(Planner(CPU_MODEL, world, POOL, fixed=POOL[0]), rank)
    layout, opt, ex = _setup(rank, world)
    programs = StagedPrograms()
    losses, hidden = [], []
    service.submit([len(s) for s in data[0]])
    compute_end = None
    for i, batch in enumerate(data):
        planned = service.take(compute_end)
        if i + 1 < len(data):
            service.submit([len(s) for s in data[i + 1]])  # planned while this step runs
        stats = ex.run_step(planned.plan, batch, programs.program(planned.plan, rank))
        compute_end = stats.compute_window[1]
        losses.append(stats.loss)
        hidden.append(planned.hidden)
        if i == 1:
            save_checkpoint(ckpt_dir, layout, opt, step=2, data_position=2)
            saved_plan = planned.plan
    uninterrupted = layout.full_state_dict()
    # resume from the step-2 checkpoint in a fresh layout and optimiser, run steps 3 to 5 again
    layout2, opt2, ex2 = _setup(rank, world)
    meta = load_checkpoint(ckpt_dir, layout2, opt2)
    planner = Planner(CPU_MODEL, world, POOL, fixed=POOL[0])
    plans = [planner.plan([len(s) for s in batch]) for batch in data[meta["data_position"]:]]
    resumed_losses = [ex2.run_step(plan, batch, programs.program(plan, rank)).loss
                      for plan, batch in zip(plans, data[meta["data_position"]:])]
    return losses, hidden, resumed_losses, uninterrupted, layout2.full_state_dict(), saved_plan.strategy.describe()


def test_overlapped_planning_adamw_and_resume(tmp_path):
    results = run_ranks(4, tmp_path, _run, str(tmp_path / "ckpt"))
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(0).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    expected = []
    for batch in five_batches():
        loss = reference_loss(params, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    for losses, _, resumed_losses, uninterrupted, resumed, _ in results:
        assert losses == pytest.approx(expected, rel=1e-4)
        assert resumed_losses == pytest.approx(losses[2:], rel=1e-6)
        for name, p in params.items():
            # Adam divides by sqrt(v): float noise in near-zero gradients shows up around 1e-5
            torch.testing.assert_close(uninterrupted[name], p.detach(), rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=1e-6, atol=1e-7)
    ckpt = tmp_path / "ckpt"
    version = (ckpt / "LATEST").read_text().strip()
    assert len(results[0][1]) == 5 and not results[0][1][0]  # the first plan: nothing ran while it was planned
    assert (ckpt / version / "meta.json").exists()
    assert [p.name for p in ckpt.iterdir() if p.is_dir()] == [version]  # no temporary folder left
