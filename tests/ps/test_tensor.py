"""ShardedTensor under load: concurrent adds are exact, reads are never torn within a chunk, a
completed push is seen by every later pull, errors name what is wrong. Every body runs over
several groups (mpi4py's way): the world on one node (shared memory), one emulated node per rank
(every shard behind another rank's wire thread), even/odd splits, and at 4 ranks two nodes of
two (both paths at once)."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from terrapipe import ps
from terrapipe.comm import CollectiveTimeoutError, CommError, Group

CHUNK = 1 << 12  # bytes: 512 float64 / int64 per chunk, so small tensors span many chunks


def _groups(mpi_comm):
    """(name, Group) per topology; each group closed by the caller."""
    from mpi4py import MPI

    p = mpi_comm.Get_size()
    yield "world", Group(mpi_comm.Dup(), 60)
    yield "node per rank", Group(mpi_comm.Dup(), 60, node_size=1)
    yield "split", Group(mpi_comm.Split(mpi_comm.Get_rank() % 2), 60)
    shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    pairs_share = mpi_comm.allreduce(shared.Get_size() % 2, op=MPI.MAX) == 0  # not at 4 nodes of 1
    shared.Free()
    if p == 4 and pairs_share:
        yield "two nodes of two", Group(mpi_comm.Dup(), 60, node_size=2)
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _over_groups(mpi_comm, body):
    for name, g in _groups(mpi_comm):
        try:
            body(g)
        except AssertionError as e:
            raise AssertionError(f"[{name}] {e}") from e
        finally:
            g.close()


# Element counts across the path thresholds: fewer elements than ranks (empty shards), one
# chunk, chunk boundaries, many chunks, and one 64 MiB tensor.
SIZES = [1, 3, 511, 512, 513, 4 * 512 + 7, 100_003]


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_concurrent_adds_from_every_rank_are_exact(mpi_comm):
    def body(g):
        r, p = g.rank, g.size
        for n in SIZES:
            for dtype in (np.int64, np.float64, np.int32, np.float32):
                t = ps.ShardedTensor(np.zeros(n, dtype), g, chunk_bytes=CHUNK)
                srcs = [np.arange(n, dtype=dtype) % 7 + (r + 1) * (i + 1) for i in range(4)]
                handles = [t.push(srcs[i % 4], "add") for i in range(40)]  # all outstanding
                for h in handles:
                    assert h.wait() is None
                g.comm.Barrier()
                got = t.pull().wait()
                base = (np.arange(n) % 7).astype(np.int64)
                expect = 40 * p * base + 10 * sum((q + 1) for q in range(p)) * 10
                assert got.dtype == dtype and np.array_equal(got, expect.astype(dtype)), (n, dtype)
                t.close()

    _over_groups(mpi_comm, body)


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_a_64_mib_tensor_in_a_loop_of_push_pulls(mpi_comm):
    def body(g):
        n = (64 << 20) // 8
        t = ps.ShardedTensor(np.zeros(n, np.int64), g)  # default 1 MiB chunks
        x = np.full(n, g.rank + 1, np.int64)
        out = np.empty(n, np.int64)
        for _ in range(8):
            t.push_pull(x, "add", out=out).wait()
            assert out.min() >= g.rank + 1
        g.comm.Barrier()
        assert np.all(t.pull(out).wait() == 8 * g.size * (g.size + 1) // 2)
        t.close()

    for name, g in _groups(mpi_comm):
        if name in ("world", "node per rank"):
            body(g)
        g.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=240, ci_ranks=(2,))
def test_push_pull_is_a_fetch_and_add(mpi_comm):
    # Every push_pull of +1 on a counter returns the count after it: across all ranks and
    # hundreds of calls each value appears exactly once, or some update was lost or torn.
    def body(g):
        t = ps.ShardedTensor(np.zeros(1, np.int64), g)
        one, seen = np.ones(1, np.int64), []
        for _ in range(300):
            seen.append(int(t.push_pull(one, "add").wait()[0]))
        everyone = sorted(sum(g.comm.allgather(seen), []))
        assert everyone == list(range(1, 300 * g.size + 1))
        t.close()

    _over_groups(mpi_comm, body)


@pytest.mark.mpi(ranks=(2, 4), timeout=240, ci_ranks=(2,))
def test_reads_are_never_torn_within_a_chunk(mpi_comm):
    # Rank 0 copies uniform values (all i) in a loop while every other rank pulls: each pulled
    # chunk must be uniform, and the values seen never go backwards.
    def body(g):
        per = CHUNK // 8
        n = per * 3 * g.size
        t = ps.ShardedTensor(np.zeros(n, np.int64), g, chunk_bytes=CHUNK)
        g.comm.Barrier()
        if g.rank == 0:
            for i in range(1, 301):
                t.push(np.full(n, i, np.int64), "copy")
            t.pull().wait()
        else:
            last = np.zeros(n // per, np.int64)
            out = np.empty(n, np.int64)
            for _ in range(300):
                chunks = t.pull(out).wait().reshape(-1, per)
                assert np.all(chunks.min(1) == chunks.max(1)), "a chunk mixes two pushes"
                assert np.all(chunks[:, 0] >= last)
                last = chunks[:, 0].copy()
        g.comm.Barrier()
        assert np.all(t.pull().wait() == 300)
        t.close()

    _over_groups(mpi_comm, body)


@pytest.mark.mpi(ranks=(1, 2), timeout=180)
def test_a_completed_push_is_seen_by_every_later_pull_and_rules(mpi_comm):
    def body(g):
        r, p = g.rank, g.size
        init = torch.arange(2000, dtype=torch.float32).reshape(40, 50)
        t = ps.ShardedTensor(init, g, chunk_bytes=CHUNK)
        assert t.pull().wait().shape == (40, 50) and torch.equal(t.pull().wait(), init)
        g.comm.Barrier()  # every rank has read the initial values before anyone writes
        for writer in range(p):
            if r == writer:
                t.push(torch.full((40, 50), float(writer)), "copy").wait()
            g.comm.Barrier()
            assert torch.all(t.pull().wait() == writer)
            # every rank has pulled before the next writer writes (without this barrier a slow
            # rank's pull could be served after the next push and see its values)
            g.comm.Barrier()
        # Issue order on one rank: a pull right after a push (no wait) sees it.
        if r == 0:
            t.push(None, "zero")
            t.push(torch.ones(40, 50), "add", scale=-2.5)
            assert torch.all(t.pull().wait() == -2.5)
        g.comm.Barrier()
        out = torch.empty(40, 50)
        assert t.pull(out).wait() is out and torch.all(out == -2.5)
        t.close()

    _over_groups(mpi_comm, body)


@pytest.mark.mpi(ranks=(1, 2), timeout=120)
def test_bad_input_names_the_argument_and_the_rank(mpi_comm):
    g = Group(mpi_comm.Dup(), 60)
    t = ps.ShardedTensor(np.zeros((4, 5), np.float32), g)
    with pytest.raises(ValueError, match="x has 21 elements .* the tensor has 20"):
        t.push(np.zeros(21, np.float32))
    with pytest.raises(TypeError, match="x has dtype float64; the tensor's is float32"):
        t.push(np.zeros(20))
    with pytest.raises(ValueError, match="rule must be one of"):
        t.push(np.zeros(20, np.float32), "mul")
    with pytest.raises(ValueError, match="x is required for rule 'copy'"):
        t.push(None, "copy")
    with pytest.raises(ValueError, match="out has 3 elements"):
        t.pull(np.zeros(3, np.float32))
    t.close()
    with pytest.raises(CommError, match="closed"):
        t.pull()
    ti = ps.ShardedTensor(torch.zeros(6, dtype=torch.int64), g)
    with pytest.raises(ValueError, match="scale must be an integer for a int64 tensor"):
        ti.push(torch.ones(6, dtype=torch.int64), scale=0.5)
    ti.close()
    with pytest.raises(TypeError, match="init has dtype float16"):
        ps.ShardedTensor(np.zeros(3, np.float16), g)
    if g.size > 1:
        with pytest.raises(ValueError, match=r"rank 1 has \(\(4,\), 'float32'"):
            ps.ShardedTensor(np.zeros(3 if g.rank == 0 else 4, np.float32), g)
    g.close()


def test_a_lock_held_by_a_dead_process_is_named():
    import subprocess
    import sys

    from terrapipe.kernels.shard import LOCK_STRIDE
    from terrapipe.ps.layout import Layout
    from terrapipe.ps.node_shards import NodeShards

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    layout = Layout(100, 2, 8, 64)
    shards = NodeShards(None, [0, 1], 0, layout, np.dtype(np.int64), timeout=60)
    shards.pids[1] = dead.pid
    shards.locks[2 * LOCK_STRIDE] = 2  # rank 1 holds chunk 2 of rank 0's shard
    died = rf"chunk 2 of rank 0's shard is locked by rank 1 \(pid {dead.pid}\), which died"
    with pytest.raises(CollectiveTimeoutError, match=died):
        shards.apply(0, 16, 24, 2, 0, np.int64(1), np.ones(8, np.int64), None, "push")
    shards.pids[1] = os.getpid()  # alive: a timeout instead, naming the holder
    shards.timeout = 0.2
    with pytest.raises(CollectiveTimeoutError, match="timed out after 0.2s .* held by rank 1"):
        shards.apply(0, 16, 24, 2, 0, np.int64(1), np.ones(8, np.int64), None, "push")


def _endpoint(rank, peers, servers, clients, timeout):
    """An endpoint of a 1000-element float64 tensor over two ranks (8 elements per chunk),
    its shard in private memory, served by this process's wire thread."""
    from terrapipe.ps.connections import Endpoint
    from terrapipe.ps.layout import Layout
    from terrapipe.ps.node_shards import NodeShards
    from terrapipe.ps.wire_thread import wire_thread

    layout = Layout(1000, 2, 8, 64)
    shards = NodeShards(None, [rank], rank, layout, np.dtype(np.float64), timeout)
    ep = Endpoint(rank, shards, layout, np.float64, peers, timeout, "ps tensor t", servers, clients)
    wire_thread().register(ep)
    return ep


def _stand_in(sock):
    """A process holding the far end of ``sock`` and never answering (the parent's copy closed)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             pass_fds=(sock.fileno(),))
    sock.close()
    return child


def test_a_server_that_never_answers_or_dies_is_named():
    import socket

    from terrapipe.kernels import shard as kshard
    from terrapipe.ps.connections import Request
    from terrapipe.ps.wire import Peer
    from terrapipe.ps.wire_thread import wire_thread

    me = os.uname().nodename
    for fate in ("silent", "killed"):
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        child = _stand_in(theirs)
        try:
            timeout = 0.5 if fate == "silent" else 60
            ep = _endpoint(0, [Peer(0, me, os.getpid()), Peer(1, me, child.pid)], {1: mine}, {}, timeout)
            dst = np.empty(1000)
            req = wire_thread().submit(Request(ep, 1, 3, 1.0, None, dst, 1, "pull (shard of rank 1)"))
            if fate == "silent":
                expected = "pull \\(shard of rank 1\\): timed out after 0.5s waiting for rank 1"
            else:
                time.sleep(0.2)
                child.kill()
                child.wait()
                # Its connection ends as it exits, maybe before its pid is gone: either names it.
                expected = (rf"rank 1 \(pid {child.pid}\) died"
                            rf"|lost the connection to rank 1 on .* \(pid {child.pid}\)")
            start = time.monotonic()
            with pytest.raises(CollectiveTimeoutError, match=expected):
                req.wait()
            assert time.monotonic() - start < 10
            # The tensor is unusable from then on: the next request fails at once, same error.
            again = wire_thread().submit(Request(ep, 1, kshard.ADD, 1.0, np.ones(1000), None, 2, "push"))
            with pytest.raises(CollectiveTimeoutError, match=expected):
                again.wait()
            wire_thread().drop(ep, CommError("closed"))
        finally:
            child.kill()
            child.wait()
    _no_ps_thread_within(10)


def test_a_client_that_dies_mid_request_is_named_and_its_partial_chunk_never_lands():
    import socket

    from terrapipe.kernels import shard as kshard
    from terrapipe.ps.wire import REQUEST, Peer
    from terrapipe.ps.wire_thread import wire_thread

    me = os.uname().nodename
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    ep = _endpoint(1, [Peer(0, me, os.getpid()), Peer(1, me, os.getpid())], {}, {0: mine}, 60)
    # Rank 0 asks to add ones to the whole 500-element shard, sends 250 of them and is gone.
    theirs.sendall(REQUEST.pack(kshard.ADD, 0, 500, 1.0, 1) + np.ones(250).tobytes())
    theirs.close()
    deadline = time.monotonic() + 10
    while ep.error is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "rank 0" in ep.error and "lost the connection" in ep.error, ep.error
    shard = ep.shards.shards[1]
    assert (shard[:248] == 1).all() and (shard[248:] == 0).all()  # 31 whole chunks of 8, no more
    with pytest.raises(CollectiveTimeoutError, match="lost the connection to rank 0"):
        wire_thread().close(ep)
    _no_ps_thread_within(10)


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_close_leaves_no_thread_and_no_segment(mpi_comm):
    from tests.leftovers import made_by, segments

    before, job = segments(), mpi_comm.allgather(os.getpid())
    g = Group(mpi_comm.Dup(), 60, node_size=1)
    t = ps.ShardedTensor(np.zeros(10_000, np.float32), g)
    assert any(th.name == "terrapipe-ps-wire" for th in threading.enumerate())
    t.push(np.ones(10_000, np.float32)).wait()
    t.close()
    t.close()  # idempotent
    _no_ps_thread_within(10)
    # A tensor made unusable by a failure closes without the barrier, and its wire thread ends.
    t = ps.ShardedTensor(np.zeros(10_000, np.float32), g)
    t.push(np.ones(10_000, np.float32)).wait()
    g.comm.Barrier()  # both ranks' pushes served before either stops serving
    t._failed = "a peer timed out"  # what a request that timed out leaves (NOTE [one thread on the wire] 3)
    t.close()
    _no_ps_thread_within(10)
    assert not made_by(job, before)
    # No connection outlives its tensor (the wire thread's own wake-up pair lives on).
    sockets = _sockets()
    for _ in range(3):
        with ps.ShardedTensor(np.zeros(10_000, np.float32), g) as t:
            t.push_pull(np.ones(10_000, np.float32)).wait()
    _no_ps_thread_within(10)
    assert _sockets() == sockets
    g.close()


def _sockets() -> int:
    """Sockets this process holds, the MPI library's own aside (they come and go by themselves)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _no_ps_thread_within(seconds: float) -> None:
    """The wire thread ends on its next round once its last tensor closed; the clients' with
    their pools."""
    deadline = time.monotonic() + seconds
    while names := [th.name for th in threading.enumerate() if th.name.startswith("terrapipe-ps")]:
        assert time.monotonic() < deadline, names
        time.sleep(0.01)
