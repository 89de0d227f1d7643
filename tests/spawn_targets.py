"""Module-level rank functions for tests/test_spawn.py (spawned ranks import them by name)."""

import time


def rank_and_world(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, float(t), torch.get_num_threads()


def fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)  # the job must end early because rank 1 died, not wait for this


def hang(rank, world):
    time.sleep(60)


def all_reduce_cpu_ms(rank, world):
    """(rank CPU clock ms, computing-thread ms) over 16 all-reduces of 512 KiB."""
    import torch
    import torch.distributed as dist

    from runtime.cpu_clock import RankCpuClock

    clock, x = RankCpuClock(), torch.randn(1024, 128)
    dist.all_reduce(x)
    dist.barrier()
    started, thread_started = clock.seconds(), time.thread_time()
    for _ in range(16):
        dist.all_reduce(x)
    return (clock.seconds() - started) * 1e3, (time.thread_time() - thread_started) * 1e3
