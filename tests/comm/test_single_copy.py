"""The single-copy allreduce of private memory (NOTE [single-copy allreduce] in
comm/algorithms/single_copy.py): its kernels against NumPy in one process (reading this process's
own memory), then the path against NumPy over the world, a split and a duplicate at 2 and 4
ranks, under load, and its fallbacks."""

import os
import subprocess
import sys
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import terrapipe.comm as comm
from terrapipe.comm.algorithms import oneshot_nodes, single_copy
from terrapipe.comm.errors import CommError
from terrapipe.comm.transports import cma
from terrapipe.kernels import reduce as kreduce
from tests.comm import stress

KIB, MIB = 1 << 10, 1 << 20
DTYPES = ("float32", "float64", "int32", "int64")


def _peers_of_self() -> cma.Peers:
    """Peers whose local rank 1 is this very process: the kernels read our own memory."""
    return cma.Peers(np.array([0, os.getpid()], np.int64), [0, 1])


@settings(deadline=None)  # examples: the profile's (tests/conftest.py; fewer in CI)
@given(dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "prod", "min", "max", "avg"]),
       n=st.integers(1, 70_000), cut=st.floats(0, 1), in_place=st.booleans(), seed=st.integers(0, 2**16))
def test_reduce_part_matches_numpy(dtype, op, n, cut, in_place, seed):
    rng = np.random.default_rng(seed)
    mine = rng.integers(-9, 10, n).astype(dtype)
    theirs = rng.integers(-9, 10, n).astype(dtype)
    lo = int(cut * n) // 2
    hi = n - lo // 3
    peers = _peers_of_self()
    dst = mine if in_place else np.full(n, 77, dtype)
    src = mine.copy() if in_place else mine
    code = kreduce.op_code(op)
    divisor = 2 if op == "avg" else 1
    integer = np.dtype(dtype).kind == "i"
    srcs = np.array([src.ctypes.data, theirs.ctypes.data], np.uint64)
    got = cma.reduce_part(dst, 0, src, peers.pids, srcs, 0, code, lo, hi, divisor, integer,
                          peers.tile(dtype), peers.iov)
    assert got == -1
    ref = {"sum": src + theirs, "avg": src + theirs, "prod": src * theirs,
           "min": np.minimum(src, theirs), "max": np.maximum(src, theirs)}[op]
    if op == "avg":
        ref = ref // 2 if integer else ref / np.asarray(2, dtype)
    np.testing.assert_array_equal(dst[lo:hi], ref[lo:hi].astype(dtype))
    outside = src if in_place else np.full(n, 77, dtype)  # nothing else written
    np.testing.assert_array_equal(dst[:lo], outside[:lo])
    np.testing.assert_array_equal(dst[hi:], outside[hi:])


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 300_000), parts=st.integers(2, 5))
def test_gather_parts_copies_every_other_part(dtype, n, parts):
    theirs = (np.arange(n) % 1000).astype(dtype)
    dst = np.full(n, -1, dtype)
    bounds = np.array([n * q // parts for q in range(parts + 1)], np.int64)
    pids = np.full(parts, os.getpid(), np.int64)
    me = parts // 2
    dsts = np.full(parts, theirs.ctypes.data, np.uint64)
    assert cma.gather_parts(dst, pids, dsts, bounds, me, np.zeros(4, np.uint64)) == -1
    want = theirs.copy()
    want[bounds[me]:bounds[me + 1]] = -1  # my own part is left alone
    np.testing.assert_array_equal(dst, want)


def test_an_unreadable_peer_is_named():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    peers = cma.Peers(np.array([0, dead.pid], np.int64), [4, 9])
    x = np.ones(1000, np.float32)
    srcs = np.array([x.ctypes.data, x.ctypes.data], np.uint64)
    tile = peers.tile(x.dtype)
    assert cma.reduce_part(x, 0, x, peers.pids, srcs, 0, 0, 0, 1000, 1, False, tile, peers.iov) == 1
    err = peers.failed(1, "allreduce", int(srcs[1]))
    assert isinstance(err, CommError)
    assert str(err) == f"allreduce: rank 9 (pid {dead.pid}) died"
    bad = cma.Peers(np.array([0, os.getpid()], np.int64), [4, 9])
    msg = str(bad.failed(1, "allreduce", 8))  # address 8 of a live process: EFAULT
    assert msg.startswith("allreduce: rank 9") and "could not be read (Bad address)" in msg


# -- over ranks --------------------------------------------------------------------------------
# float32 elements around the 2 MiB threshold (single_copy.MIN_BYTES), odd lengths, several tiles.
LENGTHS = [512 * KIB - 1, 512 * KIB, 512 * KIB + 1, 3_000_017]


@pytest.fixture
def world(mpi_comm):
    return comm.init(timeout=60)


class _Counting:
    """The calls of the collectives ``colls`` that ``g`` runs single-copy from now on (to see the
    algorithm is the one selected): ``len`` counts them."""

    def __init__(self, g, colls: tuple[str, ...] = ("allreduce",)) -> None:
        self.log, self.colls = g.record_algorithms(), colls

    def __len__(self) -> int:
        return sum(1 for coll, algorithm, _ in self.log if algorithm == "single_copy" and coll in self.colls)


def _want(op, n, period, p, dtype):
    """The result of ``op`` over every rank's operand of ``n`` elements, rank r's being
    ``base + r`` (``base % 2 + 1`` scaled by ``r % 2 + 1`` for prod), where ``base`` is
    ``arange(n) % period``: computed on one period and repeated (the operands run to megabytes)."""
    base = np.arange(period)
    ranks = np.arange(p)
    cols = [(base + r).astype(np.float64) for r in ranks]
    if op == "prod":
        cols = [(base % 2 + 1) * (r % 2 + 1) for r in ranks]
    red = {"sum": sum, "avg": sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    out = red(cols) if op in ("sum", "avg") else red(np.stack(cols), axis=0)
    if op == "avg":
        out = out // p if np.dtype(dtype).kind == "i" else out / p
    return np.tile(out.astype(dtype), -(-n // period))[:n]


def _single_copy_allreduce(g, nbytes: int) -> bool:
    """Whether a private allreduce of ``nbytes`` on ``g`` goes single-copy (NOTE [algorithm
    selection] 4, 7 in comm/select.py): from MIN_BYTES on one node; across nodes of several
    ranks each beyond the one-shot across nodes too; never on nodes of one rank."""
    if g.nnodes > 1:
        return g.local_size > 1 and nbytes >= single_copy.MIN_BYTES and nbytes > oneshot_nodes.limit(g.shm)
    return nbytes >= single_copy.MIN_BYTES


@pytest.mark.mpi(ranks=(2, 4), timeout=400, ci_ranks=(2,))
def test_allreduce_is_exact_over_world_split_and_duplicate(world):
    available = world.shm.peers is not None
    for name, g in stress.groups_under_test(world).items():
        r, p = g.rank, g.size
        if p == 1:
            continue
        calls = _Counting(g)
        for n in LENGTHS:
            base = np.arange(n) % 13
            for dtype in DTYPES:
                for op in ("sum", "avg", "min", "max", "prod"):
                    x = ((base % 2 + 1) * (r % 2 + 1) if op == "prod" else base + r).astype(dtype)
                    out = np.full_like(x, 5) if op == "max" else None  # out of place too
                    got = comm.allreduce(x, op, out=out, group=g)
                    np.testing.assert_array_equal(got if out is None else out, _want(op, n, 13, p, dtype),
                                                  err_msg=f"{name}: n={n} {dtype} {op}")
        sizes = [n * np.dtype(d).itemsize for n in LENGTHS for d in DTYPES]
        expected = 5 * sum(_single_copy_allreduce(g, nbytes) for nbytes in sizes)
        assert len(calls) == (expected if available else 0), (name, len(calls))
        # an output overlapping the input one element further on: through a private copy
        n = 600_001
        z = np.zeros(n + 1, np.float32)
        z[:n] = np.arange(n) % 5 + r
        comm.allreduce(z[:n], "sum", out=z[1:], group=g)
        np.testing.assert_array_equal(z[1:], (np.arange(n) % 5) * p + p * (p - 1) / 2, err_msg=name)
        # several tensors fused into one message go through one private contiguous copy
        ts = [torch.full((n,), float(r + k)) for k, n in enumerate((700_001, 3, 900_000))]
        comm.jit_allreduce(ts, "sum", group=g)
        for k, t in enumerate(ts):
            assert bool((t == p * k + p * (p - 1) / 2).all()), (name, k)
        # one rank's sync call and another's async call take one path: the latency path declines
        # what the single copy takes (were it not to, 2 MiB at 2 ranks raises a mismatch)
        for n in (512 * KIB, 512 * KIB + 1):
            x = np.full(n, r, np.float32)
            if r % 2:
                comm.allreduce(x, "sum", group=g)  # sync, in place: the latency path's candidate
            else:
                comm.allreduce(x, "sum", async_op=True, group=g).wait()
            assert x[0] == x[n // 2] == x[-1] == p * (p - 1) / 2, (name, n)


@pytest.mark.mpi(ranks=(2, 4), timeout=400, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_many_outstanding_in_a_loop(world):
    """300 allreduces of sizes across the threshold, up to 8 in flight, every fourth one sync, a
    DDP bucket's torch tensor among them; every result exact."""
    g = world
    r, p = g.rank, g.size
    sizes = [512 * KIB - 1, 512 * KIB, 700_001, 2_000_003, 6 * MIB // 4 + 5]
    pending: deque = deque()
    for i in range(300):
        n = sizes[i % len(sizes)]
        x = torch.full((n,), float(r + i % 7)) if i % 3 == 0 else np.full(n, r + i % 7, np.float32)
        want = p * (i % 7) + p * (p - 1) / 2
        if i % 4 == 3:
            comm.allreduce(x, "sum", group=g)
            assert x[0] == x[-1] == want, i
            continue
        pending.append((i, x, want, comm.allreduce(x, "sum", async_op=True, group=g)))
        while len(pending) > 8 or (pending and i == 299):
            j, y, w, h = pending.popleft()
            h.wait()
            assert float(y[0]) == float(y[n // 2 if y.shape[0] > n // 2 else 0]) == float(y[-1]) == w, j


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_the_node_agrees_to_fall_back(world, mpi_comm, monkeypatch):
    """TERRAPIPE_CMA=0 on every rank, or one rank unable to read the others: no rank takes the
    path, and results stay exact."""
    from terrapipe.comm.group import Group

    on = Group(mpi_comm.Dup(), 60)
    if on.shm.peers is None:
        on.close()
        pytest.skip("cross-memory attach is not permitted on this machine")
    on.close()
    monkeypatch.setenv("TERRAPIPE_CMA", "0")
    off = Group(mpi_comm.Dup(), 60)
    monkeypatch.delenv("TERRAPIPE_CMA")
    if mpi_comm.rank == 1:
        monkeypatch.setattr(cma, "read_value", lambda pid, addr: None)
    one_cannot = Group(mpi_comm.Dup(), 60)
    monkeypatch.undo()
    for g in (off, one_cannot):
        assert g.shm.peers is None, "every rank of the node falls back together"
        x = np.full(3_000_017, g.rank + 1, np.float32)
        comm.allreduce(x, "sum", out=x, group=g)
        assert x[0] == x[-1] == 3
        g.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_path_mismatch_raises_on_every_rank(world):
    """A rank whose message goes single-copy beside one whose message does not (different
    lengths across the threshold) gets CollectiveMismatchError naming both, on every rank."""
    from terrapipe.comm import CollectiveMismatchError

    if world.shm.peers is None:
        pytest.skip("cross-memory attach is not permitted on this machine")
    n = 512 * KIB if world.rank == 0 else 512 * KIB - 1
    with pytest.raises(CollectiveMismatchError, match="by single_copy") as e:
        comm.allreduce(np.ones(n, np.float32), "sum", group=world)
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value)


@pytest.mark.mpi(ranks=(2, 4), timeout=400, ci_ranks=(2,))
def test_reduce_scatter_allgather_and_gather_over_world_split_and_duplicate(world):
    """NOTE [single-copy allreduce] 6: the other collectives that read the peers' memory, on
    both sides of their thresholds, against NumPy."""
    available = world.shm.peers is not None
    for name, g in stress.groups_under_test(world).items():
        r, p = g.rank, g.size
        if p == 1:
            continue
        calls = {"allgather": _Counting(g, ("allgather", "gather")),
                 "reduce_scatter": _Counting(g, ("reduce_scatter",))}
        expected = dict.fromkeys(calls, 0)
        for n in (single_copy.REDUCE_SCATTER_MIN_BYTES // 8 - 1, single_copy.REDUCE_SCATTER_MIN_BYTES // 4,
                  single_copy.MIN_BYTES // 4 - 1, single_copy.MIN_BYTES // 4 + 3):
            for dtype in DTYPES:
                base = np.arange(n) % 11
                x = (base + r).astype(dtype)
                rows = np.stack([(base + q).astype(dtype) for q in range(p)])
                np.testing.assert_array_equal(np.asarray(comm.allgather(x, group=g)), rows,
                                              err_msg=f"{name} allgather n={n} {dtype}")
                got = comm.gather(x, root=p - 1, group=g)
                if r == p - 1:
                    np.testing.assert_array_equal(np.asarray(got), rows, err_msg=f"{name} gather n={n}")
                for op in ("sum", "avg", "min"):
                    want = np.array_split(_want(op, n, 11, p, dtype), p)[r]
                    np.testing.assert_array_equal(np.asarray(comm.reduce_scatter(x, op, group=g)), want,
                                                  err_msg=f"{name} reduce_scatter n={n} {dtype} {op}")
                # on one node (NOTE [single-copy allreduce] 6): allgather and gather from
                # MIN_BYTES of input, reduce-scatter from 1 MiB; across nodes only allreduces
                one_node = g.nnodes == 1
                expected["allgather"] += 2 * (one_node and x.nbytes >= single_copy.MIN_BYTES)
                least = single_copy.REDUCE_SCATTER_MIN_BYTES
                expected["reduce_scatter"] += 3 * (one_node and x.nbytes >= least)
        taken = {coll: len(c) for coll, c in calls.items()}
        if available:
            assert taken == expected, (name, taken)
            assert g.nnodes > 1 or 0 < expected["allgather"] < expected["reduce_scatter"], expected
        else:
            assert taken == dict.fromkeys(taken, 0)


def _huge_bytes_at(addr: int) -> int:
    """AnonHugePages (bytes) of the mapping holding ``addr`` in this process."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def _fresh_tensor(nbytes: int) -> torch.Tensor:
    """float32 of its own anonymous mapping, faulted in with 4 KiB pages: not memory an earlier
    test advised and the allocator handed out again."""
    import mmap

    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.float32)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    return t


def test_a_buffer_reduced_again_gets_huge_pages(monkeypatch):
    """NOTE [huge pages for reused buffers]: the second sighting of a buffer advises it, the
    first does not, the bytes stay, and TERRAPIPE_HUGEPAGES=0 leaves it alone."""
    from terrapipe.comm.transports import hugepages

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        mode = "[never]"
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    t = _fresh_tensor(24 << 20)
    addr, nbytes = t.data_ptr(), t.numel() * 4
    inner = -(-addr // hugepages.HUGE) * hugepages.HUGE + hugepages.HUGE  # a 2 MiB page inside it
    advisor = hugepages.Advisor()
    assert advisor.enabled
    advisor.saw(addr, nbytes)
    if "[madvise]" in mode:  # under "always" the kernel may have used huge pages by itself
        assert _huge_bytes_at(inner) == 0, "a buffer seen once is left alone"
    advisor.saw(addr, nbytes)
    got = _huge_bytes_at(inner)
    if got == 0:
        probe = _fresh_tensor(24 << 20)
        if not hugepages.advise(probe.data_ptr(), probe.numel() * 4):
            pytest.skip("this kernel does not collapse pages on request (MADV_COLLAPSE, Linux 6.1+)")
    assert got > 0, "the second sighting advises the buffer"
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))
    if "[madvise]" in mode:
        monkeypatch.setenv("TERRAPIPE_HUGEPAGES", "0")
        off = hugepages.Advisor()
        u = _fresh_tensor(24 << 20)
        for _ in range(3):
            off.saw(u.data_ptr(), u.numel() * 4)
        assert _huge_bytes_at(-(-u.data_ptr() // hugepages.HUGE) * hugepages.HUGE + hugepages.HUGE) == 0
