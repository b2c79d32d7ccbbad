"""hvd.barrier is exact: no rank leaves before the last one entered, on the world and on process
sets, thousands of times with random ranks arriving late. (What Horovod's own barrier tests also
time, a rank's previous collective ending when its peers' does, is
tests/comm/test_symmetric_completion.py.)"""

import time

import numpy as np
import pytest
import torch

import terrapipe.horovod as hvd


def _barriers(rounds: int, process_set, seed: int) -> np.ndarray:
    """(rounds, 2) monotonic ns: when this rank entered and left each barrier. Before entering,
    a random member (the same on every rank: a shared seed) sleeps a random 0-2 ms, and every
    rank now and then yields for a few microseconds more."""
    g = np.random.default_rng(seed)
    late = g.integers(0, process_set.size(), rounds)
    pause = g.uniform(0, 0.002, rounds)
    jitter = np.random.default_rng(seed + 1 + hvd.rank()).uniform(0, 1, rounds)
    me = process_set.rank()
    times = np.empty((rounds, 2), np.int64)
    for k in range(rounds):
        if me == late[k]:
            time.sleep(pause[k])
        elif jitter[k] < 0.1:
            time.sleep(0)
        times[k, 0] = time.monotonic_ns()
        hvd.barrier(process_set=process_set)
        times[k, 1] = time.monotonic_ns()
    return times


def _assert_exact(per_rank: list[np.ndarray], what: str) -> None:
    stack = np.stack(per_rank)  # (ranks, rounds, 2)
    last_in = stack[:, :, 0].max(axis=0)
    early = np.nonzero((stack[:, :, 1] < last_in).any(axis=0))[0]
    assert early.size == 0, (
        f"{what}: a rank left barrier {int(early[0])} before the last one entered "
        f"({len(early)} of {stack.shape[1]} barriers)")


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_no_rank_leaves_a_barrier_before_the_last_one_entered(mpi_comm):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    odds = hvd.add_process_set([q for q in range(n) if q % 2 == 1])
    rounds = 2000 if n == 2 else 1000
    world = _barriers(rounds, hvd.global_process_set, seed=11)
    _assert_exact(mpi_comm.allgather(world), "world")
    mine = evens if r % 2 == 0 else odds
    times = _barriers(rounds // 2, mine, seed=13 + r % 2)
    everyone = mpi_comm.allgather((r % 2, times))
    for parity, what in ((0, "even ranks"), (1, "odd ranks")):
        members = [t for p, t in everyone if p == parity]
        if len(members) > 1:
            _assert_exact(members, what)
    # barriers of one set interleaved with async collectives outstanding on the world
    handles = [hvd.allreduce_async(torch.full((64,), float(r)), name=f"outstanding.{k}") for k in range(8)]
    _assert_exact(mpi_comm.allgather(_barriers(50, hvd.global_process_set, seed=17)), "with async")
    for h in handles:
        assert torch.equal(hvd.synchronize(h), torch.full((64,), (n - 1) / 2))
    hvd.remove_process_set(evens)
    hvd.remove_process_set(odds)
    hvd.shutdown()
