"""The hierarchical allreduce with each chunk's part crossing the nodes in the background (NOTE
[overlap across nodes] in comm/algorithms/segment.py), at 2 nodes x 2 ranks: emulated on one host
(TERRAPIPE_NODE_SIZE), across real emulated nodes under ``--mpi-cluster 2x2``. Sizes on both
sides of one chunk and across every wrap of the thirds, each dtype and op, in place, out of
place and async (each rank its own way into the same call), fused; calls of the other layouts
(halves, the one-shots) in between; many outstanding; exact and bit-identical on every rank.
Then the same with the parts over MPI (``TERRAPIPE_BULK_TRANSPORT=mpi``), and a failure on the
node while parts are crossing."""

import hashlib
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from terrapipe import comm
from terrapipe.comm.algorithms import oneshot_nodes, segment, single_copy
from tests.comm.calls import allreduce_by_way


def _two_nodes_of_two(mpi_comm, timeout=60.0, **env):
    """comm.init at 2 nodes x 2: the real nodes where the job spans two machines, else two
    emulated on this one."""
    os.environ.update(env)
    hosts = mpi_comm.allgather(socket.gethostname())
    if len(set(hosts)) == 1:
        os.environ["TERRAPIPE_NODE_SIZE"] = "2"
    elif len(set(hosts)) != 2:  # --mpi-cluster 4x1: no node has two ranks to overlap with
        pytest.skip(f"needs nodes of two ranks; this job runs on {len(set(hosts))} nodes of one")
    g = comm.init(timeout=timeout)
    assert (g.nnodes, g.local_size, g.uniform) == (2, 2, True)
    return g


def _threads() -> int:
    """The TCP transports' threads running in this process (groups another test left open in
    a shared job included: callers compare counts)."""
    return sum(t.name == "terrapipe-tcp" for t in threading.enumerate())


def _operand(n: int, dtype, r: int, i: int) -> np.ndarray:
    # integers below 8: every sum, average, max and min below is exact in every dtype here,
    # whatever order the ranks' values are added in
    return _repeated(_operand_period(dtype, r, i), n)


def _operand_period(dtype, r: int, i: int) -> np.ndarray:
    """One period of :func:`_operand`: element k is (k (i + 3) + 5 r) mod 8, so it repeats every 8."""
    return ((np.arange(8) * (i + 3) + 5 * r) % 8).astype(dtype)


def _repeated(period: np.ndarray, n: int) -> np.ndarray:
    """``period`` repeated to ``n`` elements (a new array). The operands run to millions of
    elements on every rank; built from their period they cost a copy, not a modulo each."""
    return np.tile(period, -(-n // period.size))[:n]


def _expected(n: int, dtype, p: int, i: int, op: str) -> np.ndarray:
    rows = np.stack([_operand_period(np.float64, q, i) for q in range(p)])
    want = {"sum": rows.sum(0), "avg": rows.sum(0) / p, "max": rows.max(0), "min": rows.min(0)}[op]
    return _repeated(want.astype(dtype), n)


def _digest(x: np.ndarray) -> bytes:
    """The array's bytes, hashed: every rank compares these (bit-identical results) without
    sending megabytes around."""
    return hashlib.blake2b(x.tobytes(), digest_size=16).digest()


def _sizes(g, dtype, algorithm: str) -> list[int]:
    """Element counts around one chunk and past several: for the segment a chunk is a third of
    a row, and the sizes pass each wrap of the thirds; for the single copy it is
    ``NODES_CHUNK_BYTES``, and the smallest sizes leave a rank's part empty."""
    item = np.dtype(dtype).itemsize
    if algorithm == "segment":
        third = segment._third(g.shm, item)
        return [third - 1, third, third + 1, 2 * third + 5, 3 * third, 3 * third + 1, 5 * third + 11]
    step = single_copy.NODES_CHUNK_BYTES // item
    return [1, 3, step - 1, step, step + 1, 2 * step + 5, 3 * step + 3]


def _allreduces_are_exact_on_every_size_and_layout(g, mpi_comm, algorithm: str) -> None:
    """Pinned to ``algorithm`` ("segment" or "single_copy"), the small call in between as
    selected."""
    r, p = g.rank, g.size
    cases = (("float32", "sum"), ("float64", "avg"), ("int32", "max"), ("int64", "min"),
             ("float32", "avg"))
    calls = 0
    for dtype, op in cases:
        for n in _sizes(g, dtype, algorithm):
            calls += 1
            x = _operand(n, dtype, r, calls)
            want = _expected(n, dtype, p, calls, op)
            g.use_algorithm("allreduce", algorithm)
            # every way on every size over the cases; each rank its own way into the same call
            got = allreduce_by_way(x, op, calls + r)
            g.use_algorithm("allreduce", None)
            if got is not x:
                assert np.array_equal(x, _operand(n, dtype, r, calls)), "the input was written"
            assert np.array_equal(got, want), (n, dtype, op, calls)
            every = mpi_comm.allgather(_digest(got))
            assert all(b == every[0] for b in every), (n, dtype, op, calls)
            # a small call in between: the one-shot writes its half before agreeing
            # (NOTE [row halves] 3), right after a call that used thirds
            y = np.full(3, float(r))
            comm.allreduce(y)
            assert np.all(y == p * (p - 1) / 2)


def _sixteen_bit_fused_and_reduce(g) -> None:
    r, p = g.rank, g.size
    third = segment._third(g.shm, 2)
    for tdtype in (torch.float16, torch.bfloat16):
        ts = [torch.from_numpy(_operand(3 * third + 17, np.float32, r, 1)).to(tdtype),
              torch.full((third,), float(r), dtype=tdtype)]
        comm.jit_allreduce(ts, "sum")
        want0 = torch.from_numpy(_expected(3 * third + 17, np.float32, p, 1, "sum")).to(tdtype)
        assert torch.equal(ts[0], want0) and torch.all(ts[1] == p * (p - 1) / 2), tdtype
    # float32 tensors sent as bfloat16 (the wire compression), values exact in it
    ts = [torch.full((2 * third + 3,), float(r + 1)), torch.full((5 * third,), 2.0)]
    comm.jit_allreduce(ts, "avg", compression="bf16")
    assert torch.all(ts[0] == (p + 1) / 2) and torch.all(ts[1] == 2.0)
    for root in range(p):
        x = _operand(4 * third + 9, np.float32, r, root)
        before = x.copy()
        comm.reduce(x, "sum", root=root)
        if r == root:
            assert np.array_equal(x, _expected(4 * third + 9, np.float32, p, root, "sum")), root
        else:
            assert np.array_equal(x, before), root


def _in_place_on_a_shared_array(g) -> None:
    """NOTE [overlap across nodes] 5: in place on a shared array (gradient buckets), chunks of
    4 MiB, each part crossing while the next is reduced."""
    r, p = g.rank, g.size
    region = g.shared_array(8 * 1_100_001)
    assert region is not None
    handed = []  # the parts handed to the transport between nodes, if there is one
    if g.bulk is not None:
        start = g.bulk.start_allreduce
        g.bulk.start_allreduce = lambda buf, *rest: (handed.append(buf.nbytes), start(buf, *rest))[1]
    for i, (n, dtype, op) in enumerate(((2_100_011, np.float32, "avg"), (1_048_577, np.float32, "sum"),
                                        (1_100_001, np.float64, "max"), (2_500_003, np.float16, "sum"),
                                        (300_001, np.float32, "sum"))):
        x = region[:n * np.dtype(dtype).itemsize].view(dtype)
        x[:] = _operand(n, dtype, r, i)
        del handed[:]
        comm.allreduce(x, op)
        chunks = -(-x.nbytes // (4 << 20))
        assert len(handed) == (chunks if g.bulk is not None and chunks > 1 else 0), (n, handed)
        assert np.array_equal(x, _expected(n, dtype, p, i, op)), (n, np.dtype(dtype), op)
        every = g.comm.allgather(_digest(x))
        assert all(b == every[0] for b in every), (n, np.dtype(dtype), op)
    if g.bulk is not None:
        del g.bulk.start_allreduce
    g.release_shared(region)


def _many_outstanding_in_a_loop(g) -> None:
    r, p = g.rank, g.size
    third = segment._third(g.shm, 4)
    sizes = [5, 4000, third // 2, third + 1, 3 * third + 2, 8 * third]
    for round_ in range(8):
        xs = [np.full(n, float(r + k + round_), np.float32) for k, n in enumerate(sizes * 2)]
        handles = [comm.allreduce(x, "sum", async_op=True) for x in xs]
        for k, (x, h) in enumerate(zip(xs, handles, strict=True)):
            h.wait()
            want = p * (k + round_) + p * (p - 1) / 2
            assert x[0] == x[-1] == want and np.all(x == want), (round_, k, x.shape)


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_parts_cross_the_nodes_while_the_node_works_on_the_next_chunk(mpi_comm):
    before = _threads()
    g = _two_nodes_of_two(mpi_comm)
    assert g.bulk is not None and g.bulk.name == "tcp"
    log = g.record_algorithms()
    third = segment._third(g.shm, 4)
    x = np.ones(6 * third, np.float16)  # 16-bit floats past the one-shot: the segment's
    comm.allreduce(x)
    assert [a for _, a, _ in log] == ["segment"] and np.all(x == g.size)
    assert _threads() == before + 1, "the parts did not cross in the background"
    _allreduces_are_exact_on_every_size_and_layout(g, mpi_comm, "segment")
    _sixteen_bit_fused_and_reduce(g)
    _in_place_on_a_shared_array(g)
    _many_outstanding_in_a_loop(g)
    comm.finalize()
    assert _threads() == before, "the transport's thread outlived the group"


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_private_arrays_are_read_from_the_node_peers_and_cross_in_chunks(mpi_comm):
    """NOTE [single-copy allreduce] 7: a large allreduce of private memory reads the node
    peers' sources, hands this rank's part of each chunk to the TCP rings, and reads the
    peers' results; exact on every size and layout, fused messages through one private copy,
    many outstanding."""
    from terrapipe.comm.message import segments

    before = _threads()
    g = _two_nodes_of_two(mpi_comm)
    assert g.shm.peers is not None, "the node's ranks cannot read each other's memory"
    r, p = g.rank, g.size
    log = g.record_algorithms()
    handed = []
    start = g.bulk.start_allreduce
    g.bulk.start_allreduce = lambda buf, *rest: (handed.append(buf.nbytes), start(buf, *rest))[1]
    step = single_copy.NODES_CHUNK_BYTES // 4
    n = 3 * step + 5
    x = _operand(n, np.float32, r, 0)
    comm.allreduce(x, "avg")
    assert [a for _, a, _ in log] == ["single_copy"]
    assert np.array_equal(x, _expected(n, np.float32, p, 0, "avg"))
    lengths = [step, step, step, 5]
    assert handed == [4 * (b - a) for m in lengths for a, b in [segments(m, 2)[g.local_rank]]], handed
    del g.bulk.start_allreduce
    # up to a row half the one-shot across nodes (NOTE [one-shot across nodes] 10), 16-bit
    # floats past it the segment's way
    del log[:]
    for y in (np.ones(oneshot_nodes.limit(g.shm) // 4, np.float32), np.ones(2 * step, np.float16)):
        comm.allreduce(y)
        assert np.all(y == p)
    assert [a for _, a, _ in log] == ["oneshot_nodes", "segment"], log
    _allreduces_are_exact_on_every_size_and_layout(g, mpi_comm, "single_copy")
    # several tensors: one fused message, through one contiguous private copy
    ts = [torch.from_numpy(_operand(m, np.float32, r, 7 + m)) for m in (step + 3, 17, 2 * step)]
    del log[:]
    comm.jit_allreduce(ts, "sum")
    assert [a for _, a, _ in log] == ["single_copy"], log
    for t in ts:
        m = t.shape[0]
        assert np.array_equal(t.numpy(), _expected(m, np.float32, p, 7 + m, "sum")), m
    _many_outstanding_in_a_loop(g)
    comm.finalize()
    assert _threads() == before, "the transport's thread outlived the group"


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=())  # make test-full (CI time)
def test_the_same_with_the_parts_over_mpi_the_node_waiting(mpi_comm):
    before = _threads()
    g = _two_nodes_of_two(mpi_comm, TERRAPIPE_BULK_TRANSPORT="mpi")
    assert g.bulk is None
    for algorithm in ("segment", "single_copy"):
        _allreduces_are_exact_on_every_size_and_layout(g, mpi_comm, algorithm)
    _in_place_on_a_shared_array(g)
    _many_outstanding_in_a_loop(g)
    assert _threads() == before


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_a_small_call_right_after_waits_until_every_rank_has_read(mpi_comm):
    """The closing barrier (NOTE [overlap across nodes] 3): a one-shot writes its row before it
    agrees, so right after a call whose last chunk sits in the middle third, rank 1's next
    one-shot would write over its own part of that chunk while rank 0, slowed in its copy-out,
    still reads it. Two rounds: the one-shot's half alternates."""
    from terrapipe.comm import message

    g = _two_nodes_of_two(mpi_comm)
    r, p = g.rank, g.size
    third = segment._third(g.shm, 4)
    real = message.Fused.write

    def slow(self, c0, src, ckind=0):
        if c0 >= third:  # the second chunk: the middle third
            time.sleep(0.3)
        real(self, c0, src, ckind)

    for round_ in range(2):
        x = _operand(2 * third, np.float32, r, round_)
        g.use_algorithm("allreduce", "segment")
        if r == 0:
            message.Fused.write = slow
        try:
            comm.allreduce(x)
        finally:
            message.Fused.write = real
        g.use_algorithm("allreduce", None)
        y = np.full(1000, 777.0 + r, np.float32)
        comm.allreduce(y)
        assert np.array_equal(x, _expected(2 * third, np.float32, p, round_, "sum")), round_
        assert np.all(y == 777.0 * p + p * (p - 1) / 2)


TIMEOUT = 3.0


@pytest.mark.mpi(ranks=(4,), timeout=120, ci_ranks=())  # make test-full (CI time)
@pytest.mark.parametrize("algorithm", ["segment", "single_copy"])
def test_a_rank_stuck_while_parts_cross_is_named_and_the_parts_end(mpi_comm, algorithm):
    """Rank 1 stops in the middle of a large allreduce (before reducing its third chunk) for
    longer than the timeout. Every other rank raises within the timeout naming it: its node
    peer from the board, which ends the parts it has crossing; the other node's ranks from
    the part that never came. Rank 1 raises too once it goes on; none is left waiting on a
    part, and closing the group leaves no thread."""
    before = _threads()
    g = _two_nodes_of_two(mpi_comm, timeout=TIMEOUT)
    r = g.rank
    g.use_algorithm("allreduce", algorithm)
    chunk = segment._third(g.shm, 4) if algorithm == "segment" else single_copy.NODES_CHUNK_BYTES // 4
    x = np.ones(5 * chunk, np.float32)
    comm.allreduce(x)
    assert np.all(x == g.size)
    module, name = (segment, "reduce_rows") if algorithm == "segment" else (single_copy, "_reduce_from_peers")
    real, calls = getattr(module, name), [0]

    def stuck(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(TIMEOUT + 3)
        real(*args, **kwargs)

    if r == 1:
        setattr(module, name, stuck)
    mpi_comm.Barrier()
    start = time.monotonic()
    try:
        with pytest.raises(comm.CommError) as e:
            comm.allreduce(x)
    finally:
        setattr(module, name, real)
    took = time.monotonic() - start
    if r != 1:  # rank 0 by its board; rank 3 by its part's ring; rank 2 from rank 3's mark
        assert isinstance(e.value, comm.CollectiveTimeoutError) and e.value.ranks == [1], str(e.value)
        assert took < TIMEOUT + 2, (took, str(e.value))
    assert took < 3 * TIMEOUT + 5, (took, str(e.value))
    g.close()
    assert _threads() == before
    mpi_comm.Barrier()
