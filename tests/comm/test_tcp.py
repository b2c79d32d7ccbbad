"""The TCP transport (NOTE [a ring over TCP] in comm/transports/tcp.py) between real processes,
one body over the world, a split in reverse order and a duplicate (each its own ring): allreduces
on both sides of its ring threshold and the ring's chunks, every dtype and op the exchange
between machines carries, against NumPy, bit-identical on every rank; hundreds of calls in a
loop; a peer that closes named at once, one that never comes named after the timeout."""

import hashlib
import time

import numpy as np
import pytest

from terrapipe.comm import CollectiveTimeoutError, CommError
from terrapipe.comm.transports import mpi_native, tcp_native
from terrapipe.comm.transports.board import TABLE_COLS
from terrapipe.comm.transports.tcp import TcpTransport
from terrapipe.kernels import reduce as kreduce

RING_BYTES = 64 << 10  # set low, so both paths and the ring's 1 MiB chunks are crossed cheaply


def _rings(mpi_comm):
    r = mpi_comm.Get_rank()
    comms = {"world": mpi_comm, "reversed split": mpi_comm.Split(0, -r), "duplicate": mpi_comm.Dup()}
    rings = {}
    for name, c in comms.items():
        t = TcpTransport(c, timeout=30, members=list(range(c.Get_size())))
        t.ring_bytes = RING_BYTES
        rings[name] = (c, t)
    return rings


def _data(seed: int, rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, n).astype(dtype)
    if dtype == "exact32":  # integers in float32: every order of addition gives the same sum
        return rng.integers(-1000, 1000, n).astype(np.float32)
    return rng.standard_normal(n).astype(dtype)


def _expected(rows: list[np.ndarray], op: int) -> np.ndarray:
    """op over the rows in rank order, as the small path adds them."""
    out = rows[0].copy()
    for row in rows[1:]:
        if op in (kreduce.SUM, kreduce.AVG):
            out += row
        elif op == kreduce.MAX:
            np.maximum(out, row, out=out)
        else:
            np.minimum(out, row, out=out)
    return out


def _same_everywhere(comm, arr: np.ndarray) -> bool:
    """Whether ``arr`` holds the same bytes on every rank (compared by digest: the payloads run
    to megabytes, pickled through MPI otherwise)."""
    every = comm.allgather(hashlib.blake2b(np.ascontiguousarray(arr), digest_size=16).digest())
    return all(b == every[0] for b in every)


SIZES = [1, 7, (RING_BYTES >> 2) - 1, RING_BYTES >> 2, (RING_BYTES >> 2) + 1, 262_143, 262_144 * 2 + 5,
         (3 << 20) // 4 + 3]


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_allreduce_on_both_sides_of_the_ring_threshold_matches_numpy(mpi_comm):
    p = mpi_comm.Get_size()
    for name, (c, t) in _rings(mpi_comm).items():
        rank = c.Get_rank()
        for n in SIZES:
            for dtype, op in (("exact32", kreduce.SUM), ("float64", kreduce.SUM), ("int32", kreduce.MAX),
                              ("int64", kreduce.MIN), ("float32", kreduce.AVG)):
                rows = [_data(n, q, n, dtype) for q in range(p)]
                buf = rows[rank].copy()
                with t.afar():
                    t.allreduce_array(buf, op, 0, "test")
                want = _expected(rows, op)
                small = buf.nbytes < RING_BYTES
                if small or dtype in ("exact32", "int32", "int64"):
                    assert np.array_equal(buf, want), (name, n, dtype)
                else:  # the ring adds each segment starting at another rank: rounding apart
                    tol = 1e-5 if buf.dtype == np.float32 else 1e-12
                    np.testing.assert_allclose(buf, want, rtol=tol, atol=tol, err_msg=f"{name} {n} {dtype}")
                assert _same_everywhere(c, buf), (name, n, dtype)
        t.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_16_bit_floats_are_summed_in_float32(mpi_comm):
    import torch

    p = mpi_comm.Get_size()
    for name, (c, t) in _rings(mpi_comm).items():
        rank = c.Get_rank()
        for n in (5, 40_000, 300_001):
            for kind, tdtype in ((kreduce.F16, torch.float16), (kreduce.BF16, torch.bfloat16)):
                values = [torch.from_numpy(_data(7, q, n, "float32")).to(tdtype) for q in range(p)]
                buf = values[rank].view(torch.int16).numpy().view(np.uint16).copy()
                t.allreduce_array(buf, kreduce.SUM, kind, "test")
                got = torch.from_numpy(buf.view(np.int16)).view(tdtype).float()
                exact = torch.stack([v.float() for v in values]).double().sum(0)
                scale = torch.stack([v.float() for v in values]).double().abs().sum(0)  # any partial's bound
                # Below the ring: one rounding of the float32 sum; the ring rounds once per step.
                steps = 1 if buf.nbytes < RING_BYTES else p - 1
                ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[tdtype]
                assert torch.all((got.double() - exact).abs() <= steps * ulp * scale), (name, n)
                assert _same_everywhere(c, buf), (name, n, kind)
        t.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_hundreds_of_calls_of_every_size_in_a_loop(mpi_comm):
    p = mpi_comm.Get_size()
    c, t = _rings(mpi_comm)["world"]
    rank = c.Get_rank()
    rng = np.random.default_rng(11)  # the same sizes on every rank
    for i in range(300):
        n = int(rng.choice([1, 100, 5000, (RING_BYTES >> 2) + int(rng.integers(-2, 3)), 300_000]))
        if i % 3 == 0:
            out = np.empty((p, n), np.int64)
            t.allgather(np.full(n, rank * 1000 + i, np.int64), out)
            assert np.array_equal(out[:, -1], np.arange(p) * 1000 + i), i
        else:
            buf = np.full(n, rank + i, np.float32)
            t.allreduce_array(buf, kreduce.SUM, 0, "test")
            assert buf[0] == buf[-1] == p * i + p * (p - 1) / 2, (i, n)
    for _, (_, other) in _rings(mpi_comm).items():
        other.close()
    t.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_peer_that_closes_is_named_at_once_and_the_ring_is_then_unusable(mpi_comm):
    t = TcpTransport(mpi_comm, timeout=60, members=[5, 9], hosts=["node0", "node1"])
    lost = []
    t.on_lost = lost.append
    if mpi_comm.Get_rank() == 1:
        t.close()  # what the kernel does to a process that dies
        mpi_comm.Barrier()
        return
    mpi_comm.Barrier()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="rank 9 on node1") as e:
        t.allreduce_array(np.ones(1 << 20, np.float32), kreduce.SUM, 0, "allreduce")
    assert time.monotonic() - start < 10, "a closed stream is not waited out"
    assert "connection" in str(e.value) and e.value.ranks == [9] and lost == [9]
    with pytest.raises(CommError, match="unusable"):
        t.allreduce_array(np.ones(4, np.float32), kreduce.SUM, 0, "allreduce")
    t.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_peer_that_never_comes_is_named_after_the_timeout(mpi_comm):
    t = TcpTransport(mpi_comm, timeout=2, members=[3, 4])
    if mpi_comm.Get_rank() == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="Timed out after 2s waiting for rank 4"):
            t.allreduce_array(np.ones(100, np.float32), kreduce.SUM, 0, "allreduce")
        assert 2 <= time.monotonic() - start < 10
    mpi_comm.Barrier()
    t.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_allreduces_started_in_the_background_complete_in_order(mpi_comm):
    """start_allreduce (NOTE [overlap across nodes] in comm/algorithms/segment.py): many queued
    at once, of sizes on both sides of the ring threshold, while this thread copies memory;
    each future done with its exact result; closing ends the transport's thread."""
    import threading

    p, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    threads = lambda: [x.name for x in threading.enumerate()].count("terrapipe-tcp")  # noqa: E731
    before = threads()  # another test's groups, left open in a shared job
    rings = _rings(mpi_comm)
    t = rings["world"][1]
    sizes = [1, 1000, RING_BYTES >> 2, 300_001, 1 << 20]
    for round_ in range(10):
        bufs = [np.full(n, float(r + k + round_), np.float32) for k, n in enumerate(sizes * 3)]
        futures = [t.start_allreduce(b, kreduce.SUM, 0, "test") for b in bufs]
        scratch = np.ones(4 << 20, np.uint8)
        np.copyto(np.empty_like(scratch), scratch)  # the caller's own work meanwhile
        for k, (b, f) in enumerate(zip(bufs, futures, strict=True)):
            assert f.result(timeout=60) is None
            want = p * (k + round_) + p * (p - 1) / 2
            assert b[0] == b[-1] == want and np.all(b == want), (round_, k)
    assert threads() == before + 1
    for _, ring in rings.values():
        ring.close()
    assert threads() == before


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_an_abort_ends_the_transfers_under_way_blaming_no_peer(mpi_comm):
    t = TcpTransport(mpi_comm, timeout=60, members=[5, 9])
    lost = []
    t.on_lost = lost.append
    if mpi_comm.Get_rank() == 0:
        # rank 1 takes no part: the first waits on it, the second is queued behind
        futures = [t.start_allreduce(np.ones(n, np.float32), kreduce.SUM, 0, "allreduce")
                   for n in (1 << 20, 10)]
        time.sleep(0.3)
        assert not futures[0].done()
        start = time.monotonic()
        t.abort("the node's part failed")
        for f in futures:
            with pytest.raises(CommError, match="the node's part failed"):
                f.result(timeout=10)
        assert time.monotonic() - start < 2, "an abort is not waited out"
        assert lost == [], "an abort blames no peer"
        with pytest.raises(CommError, match="unusable"):
            t.allreduce_array(np.ones(4, np.float32), kreduce.SUM, 0, "allreduce")
    mpi_comm.Barrier()
    t.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_forked_child_closing_its_copy_leaves_the_parents_streams(mpi_comm):
    """A process that forks (a data loader's workers, a user's os.fork) hands the child copies
    of the ring's sockets; the child closing its transport (its exit hooks) must not end the
    parent's streams, as shutting them down would."""
    import os

    t = TcpTransport(mpi_comm, timeout=30, members=[0, 1])
    p = mpi_comm.Get_size()
    buf = np.ones(300_000, np.float32)
    t.start_allreduce(buf, kreduce.SUM, 0, "test").result(timeout=30)  # its thread runs
    assert np.all(buf == p)
    if mpi_comm.Get_rank() == 0:
        pid = os.fork()
        if pid == 0:
            try:
                t.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    mpi_comm.Barrier()
    for k in range(5):
        buf = np.full(300_000 + k, float(k), np.float32)
        t.start_allreduce(buf, kreduce.SUM, 0, "test").result(timeout=30)
        assert np.all(buf == p * k), k
    t.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_wait_on_the_far_peer_marks_this_rank_waiting_while_it_lasts(mpi_comm):
    # Regression (NOTE [a peer lost across nodes] in transports/board.py): a rank waiting on its
    # ring must say so while it waits, as MpiTransport's waits do, or its node's peers waiting
    # for it on the board name it, not the far rank, when the link is cut. The hierarchical
    # allreduce's part crossed without it under torchrun, and the link-cut test named a rank's
    # node peer.
    t = TcpTransport(mpi_comm, timeout=30, members=[0, 1])
    marks = []
    t.on_waiting = marks.append
    x = np.ones(1000, np.float32)
    if mpi_comm.Get_rank() == 1:
        time.sleep(0.5)  # rank 0 waits on the ring meanwhile
    t.allreduce_array(x, kreduce.SUM, 0, "test")
    assert np.all(x == 2)
    if mpi_comm.Get_rank() == 0:
        assert marks[:1] == [True] and marks[-1] is False, marks
    t.close()


def _receive_only(nbytes: int):
    """A schedule of one receive of ``nbytes`` into the message, nothing sent (NOTE [a ring's
    schedule in compiled code] 2 in comm/transports/tcp_native.py)."""
    recvs = np.zeros((1, tcp_native.N_R), np.int64)
    recvs[0, tcp_native.R_BYTES] = nbytes
    recvs[0, tcp_native.R_AFTER_SEND] = recvs[0, tcp_native.R_LEN_AT] = -1
    return np.zeros((0, tcp_native.N_W), np.int64), recvs, 0


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_receive_wakes_once_its_bytes_are_there_not_at_every_piece(mpi_comm):
    # NOTE [a ring over TCP] 7: rank 1 sends a 1 MiB transfer in 16 pieces 5 ms apart; rank 0,
    # waiting for all of it, sleeps in poll until 256 KiB more have arrived (waking at every
    # piece it took 16 polls), then gets the bytes whole; a peer closing mid-transfer still
    # wakes it at once.
    t = TcpTransport(mpi_comm, timeout=60, members=[0, 1], hosts=["node0", "node1"])
    ring = t.ring_comm
    piece = 64 << 10
    data = np.arange(16 * piece, dtype=np.uint8)
    if mpi_comm.Get_rank() == 1:
        ring.right.setblocking(True)
        mpi_comm.Barrier()
        for k in range(16):
            ring.right.sendall(data[k * piece:(k + 1) * piece])
            time.sleep(0.005)
        ring.right.sendall(data[:piece])  # a quarter of the next transfer,
        time.sleep(0.3)
        t.close()  # then it dies
        mpi_comm.Barrier()
        return
    got = np.zeros_like(data)
    mpi_comm.Barrier()
    t._run(_receive_only(got.nbytes), got, "receiving")
    np.testing.assert_array_equal(got, data)
    polls = int(ring.st[tcp_native.S_POLLS])
    assert polls <= 6, f"{polls} wakes for one transfer"
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="rank 1 on node1"):
        t._run(_receive_only(4 * piece), np.zeros(4 * piece, np.uint8), "receiving")
    assert time.monotonic() - start < 5, "a stream closed mid-transfer is waited out"
    mpi_comm.Barrier()
    t.close()


def _inbox(t: TcpTransport, rows: int, payload: int) -> tuple[np.ndarray, int]:
    """An exchange's inbox as the segment makes one (NOTE [agreement across nodes] in
    comm/transports/shm.py): (size, width) uint8, ``rows`` table rows and the frame row."""
    head = (rows + t.frame_rows) * TABLE_COLS * 8
    width = -(-(head + payload) // 64) * 64
    inbox = np.zeros((t.size, width), np.uint8)
    table = inbox[t.rank, :head].view(np.int64).reshape(-1, TABLE_COLS)
    table[:] = -1
    table[:rows, -1] = [t.rank * rows + j for j in range(rows)]  # the "group ranks" of its rows
    return inbox, head


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_messages_of_lengths_only_their_senders_know_cross_whole_and_in_step(mpi_comm):
    # NOTE [a ring over TCP] 8: every rank's message, of a length only it knows (a table, then
    # 0 to 64 KiB, rank by rank and call by call, edges of the head included), reaches every
    # rank whole, forwarded around the ring at 4; the streams stay in step across hundreds of
    # such exchanges, an allreduce between them sees its own bytes.
    p = mpi_comm.Get_size()
    for name, (c, t) in _rings(mpi_comm).items():
        rank = c.Get_rank()
        inbox, head = _inbox(t, 2, 64 << 10)
        room = inbox.shape[1] - head
        words = inbox.view(np.int64)
        rng = np.random.default_rng(5)  # the same draws on every rank: each knows every length
        for i in range(200 if name == "world" else 40):
            payloads = [int(x) for x in rng.choice([0, 1, 7, 8, 4096, room - 1, room], p)]
            mine = payloads[rank]
            words[rank, 0] = 1000 + i  # the table: this call's "digest"
            inbox[rank, head:head + mine] = np.arange(mine, dtype=np.uint64) * (rank + 3) + i
            counts = t._tables_only("test", inbox, head, head + mine, None, None)
            assert counts == [head + n for n in payloads], (name, i, counts)
            for q in range(p):
                assert words[q, 0] == 1000 + i, (name, i, q)
                got = inbox[q, head:head + payloads[q]]
                want = (np.arange(payloads[q], dtype=np.uint64) * (q + 3) + i).astype(np.uint8)
                assert np.array_equal(got, want), (name, i, q)
            if i % 25 == 0:
                buf = np.full(1000, rank + i, np.float32)
                t.allreduce_array(buf, kreduce.SUM, 0, "test")
                assert buf[0] == buf[-1] == p * i + p * (p - 1) / 2, (name, i)
        t.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_tables_that_differ_raise_on_every_rank_naming_the_odd_one_and_the_ring_goes_on(mpi_comm):
    # NOTE [a ring over TCP] 8 with NOTE [agreement across nodes] 4: one rank sends another
    # digest and a payload where the others send none (another collective's agreement): every
    # rank holds every table, every rank names it through the whole signatures, and the next
    # exchange agrees.
    from terrapipe.comm.transports.board import SIG_WORDS

    c, t = _rings(mpi_comm)["world"]
    rank, p = c.Get_rank(), c.Get_size()
    inbox, head = _inbox(t, 1, 4096)
    words = inbox.view(np.int64)
    odd = p - 1
    for _ in range(20):
        sigs = np.full((1, SIG_WORDS), 3, np.int64)
        sigs[0, 4] = 10 + (rank == odd)
        words[rank, 0] = int(sigs[0, 4])  # the digest, as the segment writes it
        payload = 4096 if rank == odd else 0

        def check(every, ranks):
            bad = [r for r, s in zip(ranks, every, strict=True) if s[4] != every[0][4]]
            raise ValueError(f"mismatch at ranks {bad}")

        with pytest.raises(ValueError, match=rf"mismatch at ranks \[{odd}\]"):
            t.agree_tables("test", inbox, head, head + payload, check, sigs)
        words[rank, 0] = 7
        t.agree_tables("test", inbox, head, head, check, sigs)  # agrees: returns
    t.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_frame_no_row_holds_ends_the_ring_naming_its_sender(mpi_comm):
    # NOTE [a ring's schedule in compiled code] 7: a stream that lost its place (here a head
    # whose length is past the row) fails on the reader before a byte of it lands, naming the
    # sender; the ring is ended, so the sender's next wait fails at once too.
    t = TcpTransport(mpi_comm, timeout=30, members=[0, 1], hosts=["node0", "node1"])
    inbox, head = _inbox(t, 1, 4096)
    words = inbox.view(np.int64)
    if mpi_comm.Get_rank() == 1:
        bogus = inbox[1, :head].copy()
        bogus.view(np.int64)[head // 8 - TABLE_COLS] = inbox.shape[1] + 64  # a length past the row
        t.ring_comm.right.setblocking(True)
        t.ring_comm.right.sendall(bogus)
        mpi_comm.Barrier()
        with pytest.raises((CollectiveTimeoutError, CommError)):
            t.allreduce_array(np.ones(10, np.float32), kreduce.SUM, 0, "after")
        t.close()
        return
    before = inbox[1].copy()
    with pytest.raises(CommError, match="a message from rank 1 on node1 says a length no row holds"):
        t._tables_only("test", inbox, head, head, None, None)
    assert np.array_equal(inbox[1, head:], before[head:]), "a byte past the head landed"
    assert words[0, head // 8 - TABLE_COLS] == head
    mpi_comm.Barrier()
    with pytest.raises(CommError, match="unusable"):
        t.allreduce_array(np.ones(10, np.float32), kreduce.SUM, 0, "after")
    t.close()


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_recursive_doubling_reduces_every_payload_in_the_same_bits_and_meets_other_calls(mpi_comm):
    # NOTE [a ring over TCP] 9: among four, the exchange goes in two rounds over streams of
    # their own, each rank's payload reduced with every rank's on the way, lower half first:
    # every rank ends with every table and the same bits (against NumPy in that order), in a
    # loop; where one rank sends tables alone (another collective's agreement) every rank
    # sees its length and the rounds stay in step; a compiled caller's round left under way
    # is gone on with.
    from terrapipe.comm.transports.board import SIG_WORDS

    t = TcpTransport(mpi_comm, timeout=30, members=list(range(4)), exchange=True)
    assert t.doubling and len(t.ring_comm.partners) == 2
    rank, p = t.rank, t.size
    inbox, head = _inbox(t, 2, 4096)
    words = inbox.view(np.int64)
    pair = np.zeros((2, -(-(p // 2 * head + 4096) // 64) * 64), np.uint8)
    scratch, acc = np.zeros(1024, np.float32), np.zeros(kreduce.TILE, np.float32)
    sigs = np.full((2, SIG_WORDS), 5, np.int64)
    for i in range(150):
        n = [1, 7, 256, 1024][i % 4]
        words[rank, 0] = words[rank, TABLE_COLS] = 100 + i  # both rows' "digests"
        partial = inbox[rank, head:head + 4 * n].view(np.float32)
        rows = [_data(i, q, n, "float32") for q in range(p)]
        partial[:] = rows[rank]
        reduction = (partial, kreduce.SUM, 0, scratch, acc)
        t.agree_tables("test", inbox, head, head + 4 * n, None, sigs, pair, reduction)
        want = (rows[0] + rows[1]) + (rows[2] + rows[3])  # round 1 pairs, then the halves
        assert np.array_equal(partial, want), i
        assert [int(words[q, 0]) for q in range(p)] == [100 + i] * p, i
        assert [int(words[q, TABLE_COLS + 1]) for q in range(p)] == [2 * q + 1 for q in range(p)], i
        assert _same_everywhere(mpi_comm, partial), i
    # one rank in another collective (tables alone, another signature): every rank holds its
    # table and raises naming it, through the whole signatures; the next exchange agrees
    odd = 2
    mine = np.full((2, SIG_WORDS), 5, np.int64)
    mine[:, 4] = 10 + (rank == odd)
    words[rank, 0] = words[rank, TABLE_COLS] = int(mine[0, 4])
    payload = 0 if rank == odd else 4096
    reduction = None
    if payload:
        reduction = (inbox[rank, head:head + payload].view(np.float32), kreduce.SUM, 0, scratch, acc)

    def check(every, ranks):
        raise ValueError(f"mismatch at {[r for r, s in zip(ranks, every, strict=True) if s[4] == 11]}")

    with pytest.raises(ValueError, match=rf"mismatch at \[{2 * odd}, {2 * odd + 1}\]"):
        t.agree_tables("test", inbox, head, head + payload, check, mine, pair, reduction)
    words[rank, 0] = words[rank, TABLE_COLS] = 9
    assert t._tables_only("test", inbox, head, head, pair, None) == [head] * p
    # a compiled caller that started the rounds and gave up at once: the transport goes on
    st = t.ring_comm.st
    ring = t.ring_comm
    partial = inbox[rank, head:head + 64].view(np.float32)
    partial[:] = rank + 1
    words[rank, t.frame_word(head)] = head + 64
    code = tcp_native.doubling(st, ring.fds, ring.round_sends, ring.round_recvs, inbox, head,
                               t.frame_word(head), head + 64, pair, pair.view(np.float32), partial,
                               kreduce.SUM, 0, rank, 1 << 18, 0, ring.cells, ring.clock, False)
    assert code in (tcp_native.PENDING, tcp_native.DONE)
    if code == tcp_native.PENDING:
        assert st[tcp_native.S_ROUND] in (1, 2)
        t._tables_only("test", inbox, head, head + 64, pair, (partial, kreduce.SUM, 0, scratch, acc))
    assert np.all(partial == 10), partial
    t.close()


def _doubling_until_done(t: TcpTransport, inbox, head, nbytes, pair, partial, kind) -> int:
    """A compiled caller's exchange that gives up at every wait (until 0) and is gone on with
    from where it stood (NOTE [a ring's schedule in compiled code] 8): the calls it took."""
    ring, calls, resume = t.ring_comm, 0, False
    while True:
        code = tcp_native.doubling(ring.st, ring.fds, ring.round_sends, ring.round_recvs, inbox, head,
                                   t.frame_word(head), nbytes, pair, pair.view(partial.dtype), partial,
                                   kreduce.SUM, kind, t.rank, 1 << 18, 0, ring.cells, ring.clock, resume)
        calls += 1
        if code != tcp_native.PENDING:
            assert code == tcp_native.DONE, code
            return calls
        resume = True


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_recursive_doubling_by_halves_gives_doublings_bits_on_both_sides_of_its_threshold(mpi_comm):
    # NOTE [a ring's schedule in compiled code] 10: from S_HALVING bytes the payload goes by
    # reduce-scatter, then, every table agreeing, allgather; each block is reduced lower half
    # first, so every rank ends with the bits recursive doubling gives ((r0 + r1) + (r2 + r3)),
    # float32 and bfloat16 (reduced in float32, rounded each round) alike, for sizes on both
    # sides of the threshold and blocks down to empty ones (1 and 3 elements among 4), in a
    # loop; through agree_tables and through a compiled caller that gives up at every wait.
    import torch

    from terrapipe.comm.transports.board import SIG_WORDS

    t = TcpTransport(mpi_comm, timeout=30, members=list(range(4)), exchange=True)
    assert t.can_halve and t.halving_bytes == 0
    rank, p = t.rank, t.size
    inbox, head = _inbox(t, 2, 8192)
    words = inbox.view(np.int64)
    pair = np.zeros((2, -(-(p // 2 * head + 8192) // 64) * 64), np.uint8)
    scratch, acc = np.zeros(2048, np.float32), np.zeros(kreduce.TILE, np.float32)
    sigs = np.full((2, SIG_WORDS), 5, np.int64)
    threshold = 256
    sizes = [1, 3, 7, 63, 64, 65, 1000, 2048]  # float32: 4 to 8192 bytes, the threshold at 64
    for i in range(120):
        n = sizes[i % len(sizes)]
        bf16 = i % 3 == 2
        words[rank, 0] = words[rank, TABLE_COLS] = 100 + i
        values = [_data(i, q, n, "float32") for q in range(p)]
        if bf16:
            values = [torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                      for v in values]
        kind = kreduce.BF16 if bf16 else 0
        nbytes = head + values[0].nbytes
        partial = inbox[rank, head:nbytes].view(values[0].dtype)
        results = []
        for halving in (0, threshold):
            t.set_halving_bytes(halving)
            partial[:] = values[rank]
            if i % 2:
                words[rank, t.frame_word(head)] = nbytes
                _doubling_until_done(t, inbox, head, nbytes, pair, partial, kind)
            else:
                t.agree_tables("test", inbox, head, nbytes, None, sigs, pair,
                               (partial, kreduce.SUM, kind, scratch, acc))
            assert t.ring_comm.st[tcp_native.S_ROUND] == 0 and t.ring_comm.st[tcp_native.S_PHASE] == 0
            assert [int(words[q, 0]) for q in range(p)] == [100 + i] * p, i
            assert t.counts(inbox, head) == [nbytes] * p, i
            results.append(partial.copy())
        assert np.array_equal(results[0], results[1]), (i, n, bf16)
        if not bf16:
            assert np.array_equal(results[1], (values[0] + values[1]) + (values[2] + values[3])), i
        assert _same_everywhere(mpi_comm, results[1]), i
    t.close()


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_by_halves_a_rank_in_another_collective_is_named_and_nothing_is_allgathered(mpi_comm):
    # NOTE [a ring's schedule in compiled code] 10: the allgather runs only where every table
    # agrees, which every rank judges alike once the reduce-scatter's rounds brought every
    # table; a rank in another collective (another size, or tables alone) is named on every
    # rank, the payloads are not allgathered, and the streams stay in step: the next exchanges,
    # halving again, agree.
    from terrapipe.comm.transports.board import SIG_WORDS

    t = TcpTransport(mpi_comm, timeout=30, members=list(range(4)), exchange=True)
    t.set_halving_bytes(64)
    rank, p = t.rank, t.size
    inbox, head = _inbox(t, 2, 8192)
    words = inbox.view(np.int64)
    pair = np.zeros((2, -(-(p // 2 * head + 8192) // 64) * 64), np.uint8)
    scratch, acc = np.zeros(2048, np.float32), np.zeros(kreduce.TILE, np.float32)

    def check(every, ranks):
        raise ValueError(f"mismatch at {[r for r, s in zip(ranks, every, strict=True) if s[4] == 11]}")

    for i, (odd, odd_payload) in enumerate([(1, 0), (2, 1024), (3, 4096), (0, 0)] * 5):
        mine = np.full((2, SIG_WORDS), 5, np.int64)
        mine[:, 4] = 10 + (rank == odd)
        words[rank, 0] = words[rank, TABLE_COLS] = int(mine[0, 4])
        payload = odd_payload if rank == odd else 4096
        partial = inbox[rank, head:head + payload].view(np.float32)
        partial[:] = rank + 1
        reduction = (partial, kreduce.SUM, 0, scratch, acc) if payload else None
        with pytest.raises(ValueError, match=rf"mismatch at \[{2 * odd}, {2 * odd + 1}\]"):
            t.agree_tables("test", inbox, head, head + payload, check, mine, pair, reduction)
        # nothing allgathered: outside the half its first round kept, its payload is its own
        lo, hi = mpi_native.halving_block(rank, partial.size, 1)
        assert np.all(partial[:lo] == rank + 1) and np.all(partial[hi:] == rank + 1), i
        words[rank, 0] = words[rank, TABLE_COLS] = 9
        partial = inbox[rank, head:head + 4096].view(np.float32)
        partial[:] = rank + 1
        t.agree_tables("test", inbox, head, head + 4096, check, mine, pair,
                       (partial, kreduce.SUM, 0, scratch, acc))
        assert np.all(partial == 10), (i, partial)
    t.close()


def test_each_stream_gets_its_own_wake_threshold():
    # NOTE [a ring's schedule in compiled code] 5, regression: SO_RCVLOWAT was set only where
    # the value changed, not where the stream did, so a wait on another stream (recursive
    # doubling's, round by round) for the bytes last asked of the first kept that stream's
    # older, larger threshold and slept until its nap was over.
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(2):
        c = socket.create_connection(server.getsockname())
        s, _ = server.accept()
        s.setblocking(False)
        pairs.append((c, s))
    st, cells, clock = tcp_native.new_state()
    buf = np.zeros(1000, np.uint8)
    sends = np.zeros((0, tcp_native.N_W), np.int64)
    recvs = np.array([[0, 1000, 0, 0, -1, -1, 0]], np.int64)
    a, b = pairs[0][1], pairs[1][1]
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 5000)  # an earlier schedule's
    for fd in (a.fileno(), b.fileno()):
        tcp_native.start(st, 0)
        until = time.monotonic_ns() + 2_000_000
        code = tcp_native.advance(st, sends, recvs, fd, fd, buf.ctypes.data, 0, 1 << 18, 0, until, cells,
                                  clock)
        assert code == tcp_native.PENDING  # nothing sent: it waited in poll
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1000
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1000
    for c, s in pairs:
        c.close()
        s.close()
    server.close()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_an_exchanges_wait_polls_before_it_sleeps_and_the_rings_sleeps_at_once(mpi_comm, monkeypatch):
    # NOTE [a ring's schedule in compiled code] 11: rank 1 sends 4 KiB 20 ms after rank 0
    # starts waiting. A wait run as an exchange polls for st[S_SPIN_NS] (here longer than
    # the delay) and never sleeps in poll; the same wait run as a ring transfer sleeps at once;
    # TERRAPIPE_WAIT=spin makes an exchange poll until each nap.
    t = TcpTransport(mpi_comm, timeout=60, members=[0, 1], exchange=True)
    ring = t.ring_comm
    assert ring.st[tcp_native.S_SPIN_NS] == tcp_native.EXCHANGE_SPIN_NS
    data = np.arange(4096, dtype=np.uint8)
    ring.st[tcp_native.S_SPIN_NS] = 5_000_000_000
    for exchange in (True, False, True, False):
        mpi_comm.Barrier()
        if mpi_comm.Get_rank() == 1:
            time.sleep(0.02)
            ring.right.setblocking(True)
            ring.right.sendall(data)
            ring.right.setblocking(False)
            continue
        got = np.zeros_like(data)
        start = time.monotonic()
        t._run(_receive_only(got.nbytes), got, "receiving", exchange=exchange)
        np.testing.assert_array_equal(got, data)
        assert time.monotonic() - start >= 0.015  # it did wait for the late peer
        polls = int(ring.st[tcp_native.S_POLLS])
        assert (polls == 0) if exchange else (polls >= 1), (exchange, polls)
    mpi_comm.Barrier()
    t.close()
    monkeypatch.setenv("TERRAPIPE_WAIT", "spin")
    spinning = TcpTransport(mpi_comm, timeout=60, members=[0, 1])
    assert spinning.ring_comm.st[tcp_native.S_SPIN_NS] >= 10_000_000
    spinning.close()


@pytest.mark.mpi(ranks=(4,), timeout=300, ci_ranks=(4,))
def test_recursive_doublings_waits_poll_for_the_streams_spin_before_sleeping(mpi_comm):
    # NOTE [a ring's schedule in compiled code] 11 for the rounds of clause 9: rank 0 comes 20
    # ms late, so ranks 2 and 3 wait for it (or for rank 1, which waits for it) in the last
    # round. With the streams' spin longer than that they never sleep there; with none they
    # do. Either way the sum is every rank's.
    t = TcpTransport(mpi_comm, timeout=30, members=list(range(4)), exchange=True)
    rank, p = t.rank, t.size
    inbox, head = _inbox(t, 1, 256)
    pair = np.zeros((2, -(-(p // 2 * head + 256) // 64) * 64), np.uint8)
    st = t.ring_comm.st
    for spin in (5_000_000_000, 0, 5_000_000_000, 0):
        st[tcp_native.S_SPIN_NS] = spin
        partial = inbox[rank, head:head + 256].view(np.float32)
        partial[:] = rank + 1
        inbox.view(np.int64)[rank, t.frame_word(head)] = head + 256
        mpi_comm.Barrier()
        if rank == 0:
            time.sleep(0.02)
        t._doubling("test", inbox, head, head + 256, pair, (partial, kreduce.SUM, 0))
        assert np.all(partial == 10), partial
        if rank >= 2:
            polls = int(st[tcp_native.S_POLLS])
            assert (polls == 0) if spin else (polls >= 1), (spin, polls)
    t.close()
