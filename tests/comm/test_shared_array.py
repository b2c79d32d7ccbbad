"""Allreduce in place through node-shared arrays (NOTE [shared arrays] in comm/algorithms/shared.py), against
NumPy, over the world, a split and a duplicate of it, at 2 and 4 ranks (4 under make test-full;
in CI the stress test, tests/comm/stress.py, runs shared-array allreduces at 4 ranks)."""

import errno
import os

import numpy as np
import pytest
import torch

import terrapipe.comm as comm
from terrapipe.comm import CollectiveMismatchError
from tests.comm import stress

KIB, MIB = 1 << 10, 1 << 20
# Elements of float32: where the shared path takes over from the one-shot (NOTE [transport
# selection] 6: 128 Ki elements) and the one-shot's limit at 2 and 4 ranks, each with
# neighbours, the 4 MiB chunk (across nodes) with neighbours, odd lengths, several chunks.
LENGTHS = [1, 1000, 128 * KIB - 1, 128 * KIB, 128 * KIB + 1, 256 * KIB - 1, 256 * KIB + 1, 512 * KIB + 3,
           MIB - 1, MIB, MIB + 1, 3 * MIB + 7]


@pytest.fixture
def world(mpi_comm):
    return comm.init(timeout=60)


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_in_place_allreduce_is_exact_over_world_split_and_duplicate(world):
    for name, g in stress.groups_under_test(world).items():
        r, p = g.rank, g.size
        region = g.shared_array(4 * max(LENGTHS) + 64)
        if p == 1:
            assert region is None, "a one-rank group has no shared path"
            continue
        assert region is not None and region.nbytes == 4 * max(LENGTHS) + 64
        for k, n in enumerate(LENGTHS):
            at = 4 * (k % 16)  # element-aligned offsets, not only the row's start
            for op in ("sum", "avg", "max"):
                x = region[at:at + 4 * n].view(np.float32)
                pattern = (np.arange(n) % 13).astype(np.float32)
                x[:] = pattern + r
                want = {"sum": pattern * p + p * (p - 1) / 2, "avg": (pattern * p + p * (p - 1) / 2) / p,
                        "max": pattern + p - 1}[op]
                comm.allreduce(x, op, group=g)
                np.testing.assert_array_equal(x, want.astype(np.float32), err_msg=f"{name}: n={n} {op}")
        # One rank's sync call and another's async call of one piece take one path: the sync
        # latency path declines what the shared path takes (were it not to, this raises a
        # mismatch, "in private memory" vs "in shared array", up to the one-shot's limit).
        for n in LENGTHS:
            x = region[:4 * n].view(np.float32)
            x[:] = r
            if r % 2:
                comm.allreduce(x, "sum", group=g)
            else:
                comm.allreduce(x, "sum", async_op=True, group=g).wait()
            assert x[0] == x[n // 2] == x[-1] == p * (p - 1) / 2, f"{name}: sync and async, n={n}"
        # int64 and a torch view of the same memory (what DistributedGradients' buckets are)
        n = 600_001
        xi = region[8:8 + 8 * n].view(np.int64)
        xi[:] = np.arange(n) * (r + 1)
        comm.allreduce(xi, "sum", group=g)
        np.testing.assert_array_equal(xi, np.arange(n) * (p * (p + 1) // 2))
        # float16: summed in float32 scratch, so the three passes per 4 MiB chunk run on one node
        # too (NOTE [shared arrays] 3); 2.5M elements make two chunks
        h = region[:2 * 2_500_001].view(np.float16)
        h[:] = np.arange(h.size) % 13 + r
        comm.allreduce(h, "sum", group=g)
        np.testing.assert_array_equal(h, ((np.arange(h.size) % 13) * p + p * (p - 1) / 2).astype(np.float16))
        t = torch.from_numpy(region[:4 * n]).view(torch.float32)
        t.fill_(r + 1)
        comm.jit_allreduce([t], "avg", group=g)
        assert bool((t == (p + 1) / 2).all()), name
        g.release_shared(region)
        xi[:] = r  # ordinary paths from now on, same memory
        comm.allreduce(xi, "sum", group=g)
        assert xi[0] == xi[-1] == p * (p - 1) // 2


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_many_async_pieces_outstanding_in_a_loop(world):
    """Hundreds of async allreduces of disjoint pieces, eight in flight, mixed with sync ones."""
    r, p = world.rank, world.size
    n = 700_001  # 2.8 MB: beyond the one-shot at 2 and 4 ranks
    slots = 12  # more than the i values that eight async ops in flight and the new one span
    region = world.shared_array(slots * 4 * n)
    views = [region[4 * n * s:4 * n * (s + 1)].view(np.float32) for s in range(slots)]
    inflight = []
    for i in range(300):
        x = views[i % slots]
        x[:] = i + r
        if i % 5 == 4:
            comm.allreduce(x, "sum")
            assert x[0] == x[-1] == p * i + p * (p - 1) / 2, i
            continue
        inflight.append((i, x, comm.allreduce(x, "sum", async_op=True)))
        if len(inflight) == 8:
            j, y, h = inflight.pop(0)
            h.wait()
            assert y[0] == y[n // 2] == y[-1] == p * j + p * (p - 1) / 2, j
    for j, y, h in inflight:
        h.wait()
        assert y[0] == y[-1] == p * j + p * (p - 1) / 2, j


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_mismatches_raise_everywhere_and_a_full_dev_shm_gives_none(world, monkeypatch):
    r = world.rank
    n = MIB
    region = world.shared_array(8 * n)
    x = region[:4 * n].view(np.float32) if r == 0 else np.zeros(n, np.float32)
    y = region[4 * r:4 * r + 4 * n].view(np.float32)
    if world.local_size > 1:
        # Shared memory on one rank, private on the other: a mismatch naming both, not a hang.
        with pytest.raises(CollectiveMismatchError) as e:
            comm.allreduce(x, "sum")
        assert "shared array" in str(e.value) and "private memory" in str(e.value), str(e.value)
        # Different pieces of the rows: a mismatch too, naming the offsets.
        with pytest.raises(CollectiveMismatchError, match="at byte 0.*at byte 4"):
            comm.allreduce(y, "sum")
    else:  # nodes of one rank (--mpi-cluster 2x1): shared arrays take private memory's paths
        for v in (x, y):
            v[:] = r + 1
            comm.allreduce(v, "sum")
            assert v[0] == v[-1] == 3
    z = region[:4 * n].view(np.float32)  # the group is still usable
    z[:] = 1
    comm.allreduce(z, "sum")
    assert z[0] == z[-1] == 2
    # shared_array sizes must agree
    with pytest.raises(CollectiveMismatchError, match="shared_array"):
        world.shared_array(MIB + r)
    # NOTE [shared arrays] 4: a full /dev/shm is refused at creation, not SIGBUS at first touch
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = set(os.listdir("/dev/shm"))
    if world.local_rank == 0:  # only the segment's creator reserves
        monkeypatch.setattr(os, "posix_fallocate", full)
    assert world.shared_array(64 * MIB) is None
    monkeypatch.undo()
    world.barrier()
    assert set(os.listdir("/dev/shm")) - before == set()
    assert world.shared_array(MIB) is not None  # and the group goes on
    x = np.full(MIB, r, np.float32)
    comm.allreduce(x, "sum")
    assert x[0] == 1


def test_one_process_has_no_shared_array():
    assert comm.Group(None).shared_array(MIB) is None



@pytest.mark.mpi(ranks=(2,), timeout=120, one_node=True)
def test_nodes_of_one_rank_reduce_shared_buckets_as_private_memory(mpi_comm):
    # A node's only rank has no one to share its row with: the in-place path would only add
    # chunked crossings (4 nodes x 1 over 10gbit: 1.1-2.7x a private bucket's time from 1 to 16
    # MiB), so shared arrays take private memory's whole-group paths there (NOTE [algorithm
    # selection] 6 in comm/select.py), and DistributedGradients' buckets with them.
    from terrapipe.engine.gradients import DistributedGradients

    g = comm.Group(mpi_comm.Dup(), 60.0, node_size=1)
    assert (g.nnodes, g.local_size) == (2, 1)
    log = g.record_algorithms()
    region = g.shared_array(8 * MIB)
    for n in (256 * KIB, MIB, 2 * MIB - 1):  # across SHARED_MIN_BYTES, the one-shot's limit, the ring
        x = region[:4 * n].view(np.float32)
        x[:] = np.arange(n) % 7 + g.rank
        del log[:]
        comm.allreduce(x, "sum", group=g)
        np.testing.assert_array_equal(x, (np.arange(n) % 7) * 2 + 1)
        assert [a for _, a, _ in log] != ["shared"], (n, log)
    g.release_shared(region)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)
    grads = DistributedGradients(model, group=g, bucket_mb=1.0)
    assert grads.shared
    del log[:]
    x = torch.full((4, 512), float(g.rank + 1))
    model(x).sum().backward()
    grads.synchronize()
    # d(sum)/dW = the batch's sum of x: rank r's is 4(r + 1), averaged over 2 ranks: 6
    torch.testing.assert_close(model.weight.grad, torch.full((1024, 512), 6.0))
    assert log and all(a != "shared" for _, a, _ in log), log
    grads.remove()
    g.close()


@pytest.mark.mpi(ranks=(4,), timeout=180, one_node=True)
def test_nodes_of_one_rank_take_shared_pieces_by_the_latency_path(mpi_comm, monkeypatch):
    # Sync allreduces of a shared piece the shared algorithm would not take go by the latency
    # path, as private memory does, not the general path's hand-off to the group's thread (at 4
    # nodes x 1 over 10gbit a 1 MiB gradient bucket took 3.1-3.3 ms that way, a private one
    # 2.1-2.4: allreduce_cluster_4x1_10gbit_2026-11-28_3.json). Four nodes: the one-shot across
    # nodes takes up to 2 MiB there (two take only 64 KiB, below SHARED_MIN_BYTES).
    from terrapipe.comm import select

    g = comm.Group(mpi_comm.Dup(), 60.0, node_size=1)
    assert (g.nnodes, g.local_size) == (4, 1)
    region = g.shared_array(4 * MIB)
    general = []
    views = select.allreduce_views
    monkeypatch.setattr(select, "allreduce_views", lambda *a, **k: general.append(1) or views(*a, **k))
    x = region[:MIB].view(np.float32)  # 1 MiB
    for k in range(3):
        x[:] = k + g.rank
        comm.allreduce(x, "sum", group=g)
        comm.jit_allreduce(torch.from_numpy(x), "sum", group=g)
        assert x[0] == x[-1] == 4 * (4 * k + 6), k
    assert general == [], f"{len(general)} calls took the general path"
    monkeypatch.undo()
    g.release_shared(region)
    g.close()
