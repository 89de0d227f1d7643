"""Runtime on 4 gloo ranks: heterogeneous strategies give the single-process losses and parameters, their
point-to-point operations (movement, pipelines of 2 and 4 stages, overlapped or not) in an order NCCL completes
(``tests/p2p_order.py``)."""

import pytest
import torch
from dist_util import LateOwner, run_ranks
from p2p_order import p2p_problems
from staged_lm import StagedPrograms, init_params, reference_loss

from passes.plan.ir import CostModel, ParallelScheme, SchemeCost, Strategy
from passes.plan.placement import assign_ranks
from passes.plan.policies import Planner

STRATEGIES = ["4x(tp1)", "1x(tp1,pp2)+2x(tp1)", "2x(tp1,pp2)", "1x(tp1,pp4)"]
CPU_MODEL = CostModel(name="cpu-toy", gpus_per_node=4, entries=tuple(
    SchemeCost(scheme=ParallelScheme(tp=1, pp=pp), a=1e-5, b=0.05 / pp, c=1.0, max_tokens=512)
    for pp in (1, 2, 4)))


def batches():
    g = torch.Generator().manual_seed(1)
    lens = [[5, 9, 17, 3, 30, 2, 11], [40, 8, 8, 8, 1, 25], [13, 13, 13, 13, 60, 7, 2, 9]]
    return [[torch.randint(0, 61, (n,), generator=g) for n in step] for step in lens]


def _train(rank, world, strategies, lr, take_turns=False, overlap=False):
    """The steps, and every point-to-point operation this rank posted."""
    from p2p_order import P2PRecorder

    with P2PRecorder() as rec:
        out = _steps(rank, world, strategies, lr, take_turns, overlap)
    return out, rec.ops


def _steps(rank, world, strategies, lr, take_turns, overlap):
    from runtime.distributed import DistContext
    from runtime.executor import Executor
    from runtime.fixed_layout import FixedLayout
    from runtime.measure import TakeTurns
    from runtime.topology import Cluster

    ctx = DistContext(rank=rank, world_size=world, dist_backend="gloo", device=torch.device("cpu"))
    layout = FixedLayout.from_tensors(init_params(0), rank, world)
    hooks = [TakeTurns()] if take_turns else [LateOwner()] if overlap else []
    ex = Executor(ctx, Cluster.local(world), layout, torch.optim.SGD([layout.shard], lr=lr), hooks=hooks,
                  overlap=overlap is not False, windows=3,
                  **({} if overlap is False or overlap is True else {"inflight_bytes": overlap}))
    programs = StagedPrograms()
    planner = Planner(CPU_MODEL, world, [Strategy.parse("4x(tp1)")], fixed=Strategy.parse("4x(tp1)"))
    out = []
    for strategy, batch in zip(strategies, batches()):
        plan = planner.plan([len(s) for s in batch], strategy=Strategy.parse(strategy))
        stats = ex.run_step(plan, batch, programs.program(plan, rank))
        out.append((stats.loss, stats.strategy, stats.tokens_computed, layout.full_state_dict()))
    return out


@pytest.mark.parametrize(("strategies", "take_turns", "overlap"), [
    (STRATEGIES[:3], False, False), ([STRATEGIES[3], STRATEGIES[1], STRATEGIES[0]], False, False),
    (STRATEGIES[:3], True, False),  # replicas computing one after the other give the same step
    # movement overlapped with compute, an owner late: every window waited for before its first use; one
    # message in flight at a time (inflight_bytes=0) under pipelines of 2 and 4 stages: no order deadlocks
    (STRATEGIES[:3], False, True), ([STRATEGIES[3], STRATEGIES[1], STRATEGIES[0]], False, 0),
])
def test_heterogeneous_steps_match_single_process_sgd(tmp_path, strategies, take_turns, overlap):
    lr = 0.5
    per_rank = run_ranks(4, tmp_path, _train, strategies, lr, take_turns, overlap)
    assert p2p_problems([ops for _, ops in per_rank]) == []
    results = [steps for steps, _ in per_rank]
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(0).items()}
    for step, batch in enumerate(batches()):
        loss = reference_loss(params, batch)
        loss.backward()
        loss = float(loss.detach())
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None
        for rank_result in results:
            got_loss, strategy, tokens, state = rank_result[step]
            assert got_loss == pytest.approx(loss, rel=1e-5)
            for name, p in params.items():
                torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6)
        # exactly once: summed over replicas (one rank each), the tokens computed are the batch's tokens
        assert strategy == Strategy.parse(strategies[step]).describe()
        first_ranks = [ranks[0] for ranks in assign_ranks(Strategy.parse(strategy), 4)]
        assert sum(tokens[r] for r in first_ranks) == sum(len(s) for s in batch)
