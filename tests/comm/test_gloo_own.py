"""A Gloo group of our own (NOTE [Gloo groups of our own] in comm/transports/gloo.py): made by
its members over a store, registered nowhere in torch.distributed (as the torch backend's
across machines is), every collective of GlooTransport through the process group's own
methods, its splits groups of their own too, and a late rank named through its own store."""

import datetime
import socket
import time

import numpy as np
import pytest

from terrapipe.comm import CollectiveTimeoutError
from terrapipe.comm.dtypes import MOVED
from terrapipe.comm.message import Fused
from terrapipe.comm.transports.gloo import GlooTransport
from terrapipe.kernels import reduce as kreduce


def _store(mpi_comm):
    import torch.distributed as dist

    r, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    # rank 0's address as the other ranks reach it: across emulated nodes (--mpi-cluster) too
    host = socket.gethostbyname(socket.gethostname()) if r == 0 else None
    master = dist.TCPStore(host, 0, n, True, datetime.timedelta(seconds=30), wait_for_workers=False) \
        if r == 0 else None
    host, port = mpi_comm.bcast((host, master.port) if r == 0 else None, root=0)
    store = master or dist.TCPStore(host, port, n, False, datetime.timedelta(seconds=30))
    return store


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_every_collective_over_a_gloo_group_no_one_registered(mpi_comm):
    import torch.distributed as dist

    r, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    store = _store(mpi_comm)
    g = GlooTransport.of_its_own(dist.PrefixStore("own/", store), r, n, 30)
    assert not dist.is_initialized() and (g.rank, g.size) == (r, n)
    for i in range(20):  # a loop, sizes on both sides of Gloo's own thresholds
        m = (1, 1000, 300_001)[i % 3]
        x = np.full(m, r + 1.0 + i, np.float32)
        g.allreduce(Fused([x]), Fused([x]), kreduce.SUM, np.float32, 0)  # in place: no copy
        assert x[0] == x[-1] == n * (n + 1) / 2 + n * i
        y = np.full(m, float(r), np.float64)
        out = np.empty_like(y)
        g.allreduce(Fused([y]), Fused([out]), kreduce.MAX, np.float64, 0)
        assert out[-1] == n - 1 and y[0] == r  # out of place: the input is untouched
    b = np.arange(7.0) if r == n - 1 else np.zeros(7)
    g.broadcast(b, n - 1)
    rows = np.empty((n, 3), np.int64)
    g.allgather(np.full(3, r, np.int64), rows)
    gathered = np.zeros((n, 2))
    g.allgather(np.full(2, r + 0.5), gathered, root=1)
    part = np.empty(4)
    g.scatter(np.arange(4.0 * n).reshape(n, 4) if r == 0 else np.empty((n, 4)), part, 0)
    assert np.array_equal(b, np.arange(7.0)) and np.array_equal(rows[:, 0], np.arange(n))
    assert r != 1 or np.array_equal(gathered[:, 0], np.arange(n) + 0.5)
    assert np.array_equal(part, np.arange(4.0) + 4 * r)
    assert g.allgather_objects({"rank": r, "host": "h"}) == [{"rank": q, "host": "h"} for q in range(n)]
    # Every dtype comm moves, moved bit for bit; int16 was refused by Gloo ("Invalid scalar type")
    for name in sorted(MOVED - {"bfloat16"}):
        mine = (np.arange(6) * (r + 3) - 7).astype(name)
        rows = np.zeros((n, 6), name)
        g.allgather(mine, rows)
        g.broadcast(mine, 0)
        want = [(np.arange(6) * (q + 3) - 7).astype(name) for q in range(n)]
        assert np.array_equal(rows, np.stack(want)) and np.array_equal(mine, want[0]), name
    # a split: a group of its own too, members in key order
    sub, colors = g.split(r % 2, -r, 30)
    assert colors[r % 2] == sorted((q for q in range(n) if q % 2 == r % 2), reverse=True)
    z = np.ones(5, np.float32)
    sub.allreduce(Fused([z]), Fused([z]), kreduce.SUM, np.float32, 0)
    assert z[0] == len(colors[r % 2])
    mpi_comm.Barrier()


@pytest.mark.mpi(ranks=(4,), timeout=120)
def test_a_rank_that_never_comes_is_named_through_the_groups_own_store(mpi_comm):
    # NOTE [naming a late rank over Gloo]: the three that arrive sign in on the group's store
    # (no torch.distributed default store exists here) and name the one that did not.
    import torch.distributed as dist

    r = mpi_comm.Get_rank()
    store = _store(mpi_comm)
    g = GlooTransport.of_its_own(dist.PrefixStore("own/", store), r, 4, 2)
    if r != 3:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="rank 3") as e:
            g.allreduce(Fused([np.ones(8, np.float32)]), Fused([np.ones(8, np.float32)]), kreduce.SUM,
                        np.float32, 0)
        assert e.value.ranks == [3] and time.monotonic() - start < 15, e.value
    mpi_comm.Barrier()
