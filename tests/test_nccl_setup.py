"""Setting up a job on GPUs, checked without one: which backend strings run on NCCL (``cpu:gloo,cuda:nccl``
included, which a comparison with ``"nccl"`` never matched), which CUDA device each rank computes on
(``cuda_device_for``: ``LOCAL_RANK``, or a clear refusal where a rank would land on another rank's device), the
cluster's ranks per node from ``LOCAL_WORLD_SIZE`` (not the whole world on one node), and the collective timeout
of warm-up (``collective_timeout``: every group of the job, sub-groups included, for the block only, also on
ranks outside a sub-group), read from ``HCOMPILE_WARMUP_TIMEOUT_S`` or ``TrainOptions.warmup_timeout_s``."""

from __future__ import annotations

import re

import pytest
import torch
from dist_util import run_ranks

from hcompile.train import TrainOptions
from passes.graph import collectives
from passes.plan.ir import PlanError
from runtime import distributed as comm
from runtime.distributed import DEFAULT_WARMUP_TIMEOUT_S, collective_timeout, cuda_device_for, is_nccl, warmup_timeout_s
from runtime.topology import Cluster

# ---------------------------------------------------------------------------------------------------------------
# Backend strings


@pytest.mark.parametrize(("backend", "nccl"), [
    ("nccl", True), ("cpu:gloo,cuda:nccl", True), ("NCCL", True), ("cuda:nccl,cpu:gloo", True),
    ("cpu:gloo, cuda:nccl", True), ("gloo", False), ("cpu:gloo", False), ("mpi", False), ("", False),
    ("ncclx", False)])
def test_is_nccl_reads_per_device_backend_lists(backend, nccl):
    """``is_nccl`` is true for NCCL alone or inside a per-device list (what ``dist.get_backend`` returns for the
    runtime's GPU groups), in any case and order, and false for gloo, MPI and names that merely contain it;
    the runtime module re-exports the graph module's function."""
    assert is_nccl(backend) is nccl
    assert comm.is_nccl is collectives.is_nccl


@pytest.mark.parametrize("backend", [None, 1, b"nccl", ["nccl"]])
def test_is_nccl_refuses_what_is_not_a_string(backend):
    """A backend that is not a string is a TypeError naming it (not a silent False)."""
    with pytest.raises(TypeError, match="a backend is a string such as 'nccl'.*got " + re.escape(repr(backend))):
        is_nccl(backend)


# ---------------------------------------------------------------------------------------------------------------
# Which CUDA device a rank computes on


@pytest.mark.parametrize("launched", [False, True])
def test_one_visible_device_is_that_device(launched):
    """A launcher that gives each rank its own ``CUDA_VISIBLE_DEVICES``: whatever ``LOCAL_RANK`` and the rank say,
    the one visible device, index 0."""
    for local in (None, "0", "3", "abc"):
        assert cuda_device_for(5, 8, local, 1, 0, launched=launched) == 0


@pytest.mark.parametrize("launched", [False, True])
def test_local_rank_picks_the_device(launched):
    """With several visible devices, ``LOCAL_RANK`` is the device, not the global rank (rank 9 of a 16-rank job,
    local rank 1 on its node of 8), whether the device is still the default ``cuda:0`` or already set to it."""
    assert cuda_device_for(9, 16, "1", 8, 0, launched=launched) == 1
    assert cuda_device_for(9, 16, "1", 8, 1, launched=launched) == 1
    assert cuda_device_for(0, 16, "0", 8, 0, launched=launched) == 0
    assert cuda_device_for(7, 8, "7", 8, 0, launched=launched) == 7


@pytest.mark.parametrize(("local", "message"), [
    ("8", "rank 3: LOCAL_RANK=8 but this process sees 8 CUDA devices \\(0..7\\)"),
    ("-1", "rank 3: LOCAL_RANK=-1 but this process sees 8 CUDA devices"),
    ("abc", "rank 3: LOCAL_RANK must be an integer, got 'abc'"),
    ("1.5", "rank 3: LOCAL_RANK must be an integer, got '1.5'"),
    ("", "rank 3: LOCAL_RANK must be an integer, got ''")])
def test_a_local_rank_past_the_devices_or_not_an_integer_is_refused_by_value(local, message):
    """A ``LOCAL_RANK`` outside the visible devices or not an integer is a ValueError naming the value (and the
    device count), not a device index that fails later or another rank's device."""
    with pytest.raises(ValueError, match=message):
        cuda_device_for(3, 16, local, 8, 0, launched=True)


def test_a_device_set_by_the_user_that_is_not_local_rank_is_refused():
    """The user set ``cuda:2`` on the rank whose ``LOCAL_RANK`` is 3: two ranks of the node would share a device;
    a ValueError naming both and the call that fixes it."""
    with pytest.raises(ValueError, match="rank 3: the current CUDA device is cuda:2 but LOCAL_RANK=3; call "
                                         "torch.cuda.set_device\\(3\\)"):
        cuda_device_for(3, 8, "3", 8, 2, launched=True)


def test_a_users_group_without_local_rank_or_set_device_is_refused_off_the_first_rank():
    """``init_process_group('nccl')`` by the user, no ``LOCAL_RANK`` and no ``set_device``: every rank but the
    first of each node would compute on ``cuda:0`` beside it, so those are a ValueError telling the user to
    call ``torch.cuda.set_device``; the first rank of a node stays on ``cuda:0``, and a device the user set is
    kept."""
    for rank in (1, 7, 9):
        with pytest.raises(ValueError, match=f"rank {rank} of 16: .*without torch.cuda.set_device and LOCAL_RANK "
                                             f"is not set.*call torch.cuda.set_device"):
            cuda_device_for(rank, 16, None, 8, 0, launched=True)
    assert cuda_device_for(0, 16, None, 8, 0, launched=True) == 0
    assert cuda_device_for(8, 16, None, 8, 0, launched=True) == 0
    assert cuda_device_for(5, 16, None, 8, 5, launched=True) == 5  # set by the user before the group


def test_without_a_launcher_the_runtime_spreads_ranks_over_the_devices():
    """The runtime makes the group itself (``launched=False``) and ``LOCAL_RANK`` is unset: rank % devices; a
    device the process already set, or a world of one, keeps the current device."""
    assert [cuda_device_for(r, 16, None, 8, 0, launched=False) for r in range(16)] == [r % 8 for r in range(16)]
    assert cuda_device_for(3, 16, None, 8, 6, launched=False) == 6
    assert cuda_device_for(0, 1, None, 8, 4, launched=False) == 4
    assert cuda_device_for(0, 1, None, 8, 0, launched=True) == 0


@pytest.mark.parametrize("launched", [False, True])
def test_no_visible_device_is_refused(launched):
    """NCCL with no CUDA device visible is a ValueError saying so, whatever ``LOCAL_RANK`` says."""
    for local in (None, "0"):
        with pytest.raises(ValueError, match="rank 2: NCCL needs a CUDA device, and this process sees none"):
            cuda_device_for(2, 4, local, 0, 0, launched=launched)


# ---------------------------------------------------------------------------------------------------------------
# Ranks per node


def test_cluster_local_reads_local_world_size(monkeypatch):
    """``LOCAL_WORLD_SIZE=8`` in a 64-rank job is 8 nodes of 8 (rank 63 on node 7, a TP group across nodes 0
    and 1 slowed to the uplink); without it the job is one machine; an explicit ``gpus_per_node`` wins."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cluster = Cluster.local(64)
    assert (cluster.gpus_per_node, cluster.nodes, cluster.node_of(63)) == (8, 8, 7)
    assert cluster.slowest_link_gbps((6, 7, 8, 9)) == cluster.inter_node_gbps
    assert cluster.slowest_link_gbps((0, 7)) == cluster.intra_node_gbps
    assert Cluster.local(64, gpus_per_node=4).nodes == 16
    assert Cluster.local(4).nodes == 1  # fewer ranks than a node holds: one node
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    cluster = Cluster.local(64)
    assert (cluster.gpus_per_node, cluster.nodes) == (64, 1)


@pytest.mark.parametrize("value", ["abc", "8.0", "", "0", "-8", "7"])
def test_a_local_world_size_that_is_no_node_size_is_refused_by_value(monkeypatch, value):
    """A ``LOCAL_WORLD_SIZE`` that is not a positive integer, or does not divide a job of several nodes, is a
    PlanError naming the value (not a silent one-node cluster)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(PlanError, match=re.escape(f"LOCAL_WORLD_SIZE must be a positive integer (ranks per node) "
                                                  f"that divides the job's 64 ranks, got {value!r}")):
        Cluster.local(64)


# ---------------------------------------------------------------------------------------------------------------
# The warm-up timeout


@pytest.mark.parametrize("seconds", [0, -1, True, "5", None, float("nan")])
def test_collective_timeout_refuses_what_is_not_a_positive_number(seconds):
    """``collective_timeout`` takes a positive number of seconds; 0, a negative, a bool, a string, None or NaN
    is a ValueError naming it (outside a job too: the check comes first)."""
    with pytest.raises(ValueError, match=f"a collective timeout must be a positive number of seconds, got "
                                         f"{seconds!r}"):
        with collective_timeout(seconds):
            pass


def test_warmup_timeout_s_reads_the_environment(monkeypatch):
    """``HCOMPILE_WARMUP_TIMEOUT_S`` in seconds, else 3600; a value that is not a positive finite number is a
    ValueError naming it."""
    monkeypatch.delenv("HCOMPILE_WARMUP_TIMEOUT_S", raising=False)
    assert warmup_timeout_s() == DEFAULT_WARMUP_TIMEOUT_S == 3600.0
    monkeypatch.setenv("HCOMPILE_WARMUP_TIMEOUT_S", "90")
    assert warmup_timeout_s() == 90.0
    monkeypatch.setenv("HCOMPILE_WARMUP_TIMEOUT_S", "0.5")
    assert warmup_timeout_s() == 0.5
    for bad in ("abc", "0", "inf", "-5", "nan", ""):
        monkeypatch.setenv("HCOMPILE_WARMUP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=re.escape(f"HCOMPILE_WARMUP_TIMEOUT_S={bad!r}: expected a positive "
                                                       f"number of seconds")):
            warmup_timeout_s()


@pytest.mark.parametrize("value", [0, -3, True, "60", float("nan")])
def test_train_options_refuse_a_warmup_timeout_that_is_not_positive(value):
    """``TrainOptions(warmup_timeout_s=...)`` takes None or a positive number of seconds; anything else is a
    ValueError naming it."""
    assert TrainOptions(warmup_timeout_s=45).warmup_timeout_s == 45
    assert TrainOptions().warmup_timeout_s is None
    with pytest.raises(ValueError, match=f"warmup_timeout_s must be a positive number of seconds or None, got "
                                         f"{value!r}"):
        TrainOptions(warmup_timeout_s=value)


def _timeouts(rank, world, member_ranks):
    """On every rank: the timeouts of the default group and of a sub-group of ``member_ranks`` (made before the
    block, as ``GroupCache`` makes its groups) before, inside and after ``collective_timeout(17)``, of a group
    made inside it (inside and after), and nested blocks; collectives on every group work inside and after."""
    from runtime.distributed import _new_group, timeout_of

    member = rank in member_ranks
    sub = _new_group(list(member_ranks))  # collective: every rank; a placeholder on the others

    def seen(*groups):
        return [timeout_of(g) for g in groups]

    out = {"context": comm.joined_context(), "nccl": comm.uses_nccl(), "backend": comm.backend(),
           "before": seen(None, sub) if member else seen(None)}
    with collective_timeout(17):
        inner = _new_group(list(member_ranks))  # collective: every rank, members or not
        out["inside"] = seen(None, sub, inner) if member else seen(None)
        with collective_timeout(5.5):
            out["nested"] = seen(None, sub, inner) if member else seen(None)
        out["after nested"] = seen(None, sub, inner) if member else seen(None)
        comm.barrier()
        if member:
            comm.barrier(sub)
            comm.all_reduce(torch.ones(1), group=inner)
    out["after"] = seen(None, sub, inner) if member else seen(None)
    comm.barrier()
    if member:
        out["sum"] = float(comm.all_reduce(torch.ones(1), group=sub))
    return out


@pytest.mark.parametrize(("world", "members"), [(2, (0, 1)), (4, (1, 2))])
def test_collective_timeout_covers_every_group_for_the_block_only(tmp_path, world, members):
    """Inside ``collective_timeout(17)`` the default group, a sub-group made before and one made inside all time
    out after 17 s; a nested block sets 5.5 s and gives the outer 17 s back; after the block each group has its
    timeout from before (the job's 240 s, also for the group made inside). In a 4-rank job whose sub-group has
    two members, the two other ranks (holding ``new_group``'s placeholder) go through the block too, and every
    collective afterwards still works. Gloo: no NCCL, the CPU device."""
    job = 240.0  # run_ranks' timeout, which the ranks' job is made with
    results = run_ranks(world, tmp_path, _timeouts, members, timeout_s=job)
    for rank, out in enumerate(results):
        assert out["context"] == comm.DistContext(rank=rank, world_size=world, dist_backend="gloo",
                                                  device=torch.device("cpu"))
        assert (out["nccl"], out["backend"]) == (False, "gloo")
        if rank in members:
            assert out["before"] == [job, job], (rank, out)
            assert out["inside"] == [17.0, 17.0, 17.0], (rank, out)
            assert out["nested"] == [5.5, 5.5, 5.5], (rank, out)
            assert out["after nested"] == [17.0, 17.0, 17.0], (rank, out)
            assert out["after"] == [job, job, job], (rank, out)
            assert out["sum"] == 2.0
        else:
            assert (out["before"], out["inside"], out["nested"], out["after nested"], out["after"]) == (
                [job], [17.0], [5.5], [17.0], [job]), (rank, out)


def _warm_up_timeouts(rank, world):
    """A tiny Llama trainer on every rank, ``HCOMPILE_WARMUP_TIMEOUT_S=77`` set before it is built: the default
    group's timeout seen in each step's compute phase, for the warm-up's dry runs and for the real step."""
    import os

    import hcompile
    from hcompile.models import Llama, LlamaConfig, init_weights_

    os.environ["HCOMPILE_WARMUP_TIMEOUT_S"] = "77"
    trainer = hcompile.compile(init_weights_(Llama(LlamaConfig(layers=1, hidden=32, ffn_hidden=64, vocab=64)),
                                             seed=0)).trainer(
        loss="causal_lm", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, strategies=f"{world}x(tp1)",
        tokens_per_rank=64, calibrate=False)
    seen: dict[bool, set[float]] = {True: set(), False: set()}
    trainer.executor.hooks.insert(0, lambda phase, step: seen[step.dry_run].add(comm.timeout_of())
                                  if phase == "compute" else None)
    g = torch.Generator().manual_seed(0)
    trainer.train_step([torch.randint(0, 64, (n,), generator=g) for n in (20, 9, 30)])
    return trainer.warmup_timeout_s, seen, comm.timeout_of()


def test_warm_up_runs_under_its_own_timeout(tmp_path):
    """The trainer reads ``HCOMPILE_WARMUP_TIMEOUT_S`` when it is built; warm-up's dry-run steps (where variants
    compile inside collectives) run under it, the real step and everything after under the job's timeout."""
    job = 240.0
    for stated, seen, after in run_ranks(2, tmp_path, _warm_up_timeouts, timeout_s=job):
        assert stated == 77.0
        assert seen == {True: {77.0}, False: {job}}, seen
        assert after == job
