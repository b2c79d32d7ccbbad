"""Every collective over every algorithm that can run it (comm/select.py), pinned with
``Group.use_algorithm``, over the world, a split and a duplicate (one body over several
communicators, as mpi4py's tests run), at message sizes on both sides of each selection
threshold, against NumPy; then as selected. At 2 ranks in ``make test``, 2 and 4 in
``make test-full``."""

import numpy as np
import pytest

import terrapipe.comm as comm
from terrapipe.comm import CollectiveMismatchError, CommError, select
from terrapipe.comm.algorithms import oneshot, oneshot_nodes, shared, single_copy
from terrapipe.comm.select import Request

from . import stress

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reduce_scatter")
DTYPES = ("float32", "int64")


def _thresholds(g) -> list[int]:
    """Byte sizes where selection changes on ``g``: each threshold and one element around it."""
    edges = [single_copy.MIN_BYTES, single_copy.REDUCE_SCATTER_MIN_BYTES, shared.SHARED_MIN_BYTES]
    if g.shm is not None:
        edges += [oneshot.limit(g.shm), g.shm.row_bytes // 2]  # the one-shot's limit, a segment chunk
        edges.append(oneshot_nodes.limit(g.shm))  # the one-shot across nodes' (where nodes are)
    if g.mpi is not None:
        edges.append(g.mpi.ring_bytes)
    return sorted({8, 4096, *edges})


def _sizes(g, itemsize: int) -> list[int]:
    """Element counts just below, at and just above each threshold (and a few tiny ones)."""
    counts = {1, 3}
    for b in _thresholds(g):
        n = b // itemsize
        counts |= {n - 1, n, n + 1}
    return sorted(c for c in counts if c > 0)


def _x(rank: int, n: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s operand: small integers, so every order of summation is exact. Built
    from its period of 17 (a copy, not a modulo per element: sizes run to megabytes)."""
    period = (np.arange(17) + 3 * rank).astype(dtype)
    return np.tile(period, -(-n // 17))[:n]


def _check(coll: str, g, n: int, dtype: str, label: str) -> None:
    """Run ``coll`` on ``g`` with this rank's operand of ``n`` elements and compare with NumPy."""
    r, p = g.rank, g.size
    root = p - 1  # not 0: a root other than the default
    xs = [_x(q, n, dtype) for q in range(p)]
    total = np.sum(xs, axis=0, dtype=dtype)
    x = xs[r].copy()
    what = f"{label}: {coll} of {n} {dtype}"
    if coll == "allreduce":
        np.testing.assert_array_equal(comm.allreduce(x, "sum", group=g), total, err_msg=what)
    elif coll == "reduce":
        comm.reduce(x, "sum", root=root, group=g)
        np.testing.assert_array_equal(x, total if r == root else xs[r], err_msg=what)
    elif coll == "broadcast":
        np.testing.assert_array_equal(comm.broadcast(x, root=root, group=g), xs[root], err_msg=what)
    elif coll == "allgather":
        np.testing.assert_array_equal(comm.allgather(x, group=g), np.stack(xs), err_msg=what)
    elif coll == "gather":
        got = comm.gather(x, root=root, group=g)
        if r == root:
            np.testing.assert_array_equal(got, np.stack(xs), err_msg=what)
        else:
            assert got is None, what
    elif coll == "scatter":
        full = np.stack([_x(q + 7, n, dtype) for q in range(p)]) if r == root else np.zeros((p, n), dtype)
        got = comm.scatter(full, root=root, group=g)
        np.testing.assert_array_equal(got, _x(r + 7, n, dtype), err_msg=what)
    elif coll == "reduce_scatter":
        np.testing.assert_array_equal(comm.reduce_scatter(x, "sum", group=g), np.array_split(total, p)[r],
                                      err_msg=what)


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=600, ci_ranks=(2,))  # 3 and 4: make test-full
def test_every_collective_over_every_algorithm_that_can_run_it(mpi_comm):
    world = comm.init(timeout=120)
    for label, g in stress.groups_under_test(world).items():
        log = g.record_algorithms()
        ran: set[tuple[str, str]] = set()
        for dtype in DTYPES:
            for n in _sizes(g, np.dtype(dtype).itemsize):
                nbytes = n * np.dtype(dtype).itemsize
                for coll in COLLECTIVES:
                    algorithms = select.able(g, Request(coll, nbytes)) if g.size > 1 else []
                    for algorithm in [*algorithms, None]:
                        g.use_algorithm(coll, algorithm)
                        del log[:]
                        _check(coll, g, n, dtype, f"{label} by {algorithm or 'selection'}")
                        if algorithm is not None:
                            assert [a for _, a, _ in log] == [algorithm], (label, coll, n, log)
                            ran.add((coll, algorithm))
                        elif g.size > 1:  # as selected: the first row of CANDIDATES that applies
                            assert [a for _, a, _ in log] == [select.select(g, Request(coll, nbytes))], log
        if g.size > 1:
            must = {("allreduce", "segment"), ("allreduce", "mpi"), ("allreduce", "ring"), ("reduce", "ring"),
                    ("scatter", "mpi")}
            if g.nnodes == 1:  # across nodes the segment runs hierarchically, for allreduce only
                must |= {("allreduce", "oneshot"), ("broadcast", "segment"), ("reduce_scatter", "segment"),
                         ("allgather", "oneshot"), ("gather", "oneshot"), ("broadcast", "oneshot"),
                         ("reduce_scatter", "oneshot"), ("allgather", "segment")}
            elif g.uniform:
                must.add(("allreduce", "oneshot_nodes"))
            if g.shm is not None and g.shm.peers is not None and (g.nnodes == 1 or g.uniform):
                must.add(("allreduce", "single_copy"))  # across nodes: allreduce only
                if g.nnodes == 1:
                    must |= {("allgather", "single_copy"), ("reduce_scatter", "single_copy")}
            assert must <= ran, (label, sorted(must - ran))
        comm.barrier(group=g)


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_an_output_overlapping_its_input_is_exact_by_every_algorithm(mpi_comm):
    # Regression: the chunked algorithms wrote a chunk's results over input not yet read (an
    # output one element past its input), where only the single copy took a private copy.
    world = comm.init(timeout=120)
    r, p = world.rank, world.size
    n = 600_001  # several chunks of the segment and of the ring
    for algorithm in [*select.able(world, Request("allreduce", 4 * n)), None]:
        world.use_algorithm("allreduce", algorithm)
        for shift in (1, -1):
            z = np.zeros(n + 1, np.float32)
            src, dst = (z[:n], z[1:]) if shift == 1 else (z[1:], z[:n])
            src[:] = np.arange(n) % 5 + r
            comm.allreduce(src, "sum", out=dst)
            np.testing.assert_array_equal(dst, (np.arange(n) % 5) * p + p * (p - 1) / 2,
                                          err_msg=f"{algorithm}, output shifted by {shift}")
    world.use_algorithm("allreduce", None)


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_shared_arrays_over_every_algorithm_that_can_run_them(mpi_comm):
    """An allreduce in place on a piece of a shared array: the shared algorithm and every other
    one that can take the same memory, on both sides of its threshold."""
    world = comm.init(timeout=120)
    r, p = world.rank, world.size
    n_max = shared.SHARED_MIN_BYTES // 4 + 1
    region = world.shared_array(4 * n_max)
    assert region is not None, "a one-node MPI world has shared arrays"
    log = world.record_algorithms()
    for n in (1, shared.SHARED_MIN_BYTES // 4 - 1, shared.SHARED_MIN_BYTES // 4, n_max):
        piece = region[:4 * n].view(np.float32)
        where = world.shm.locate(piece)
        can = select.able(world, Request("allreduce", 4 * n, shared=where))
        assert "shared" in can
        for algorithm in [*can, None]:
            world.use_algorithm("allreduce", algorithm)
            piece[:] = _x(r, n, "float32")
            del log[:]
            comm.allreduce(piece, "sum")
            np.testing.assert_array_equal(piece, np.sum([_x(q, n, "float32") for q in range(p)], axis=0),
                                          err_msg=f"{n} by {algorithm}")
            if algorithm is not None:
                assert [a for _, a, _ in log] == [algorithm], log
    world.use_algorithm("allreduce", None)
    world.release_shared(region)


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_pin_that_cannot_run_a_call_says_so_and_ranks_that_pin_differently_mismatch(mpi_comm):
    world = comm.init(timeout=60)
    big = np.ones((oneshot.limit(world.shm) // 4) + 1, np.float32)
    world.use_algorithm("allreduce", "oneshot")
    with pytest.raises(CommError, match="'oneshot'.*cannot run"):
        comm.allreduce(big, "sum")  # raised on every rank before anything moved
    world.use_algorithm("allreduce", "ring" if world.rank == 0 else "segment")
    with pytest.raises(CollectiveMismatchError, match="by ring.*by segment"):
        comm.allreduce(np.ones(1000, np.float32), "sum")
    world.use_algorithm("allreduce", None)
    x = np.ones(1000, np.float32)
    np.testing.assert_array_equal(comm.allreduce(x, "sum"), np.full(1000, world.size, np.float32))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        world.use_algorithm("allreduce", "carrier pigeon")
    with pytest.raises(ValueError, match="coll must name a collective"):
        world.use_algorithm("alltoall", "ring")
