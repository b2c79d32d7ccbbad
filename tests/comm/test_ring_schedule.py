"""The ring's schedule (NOTE [ring schedule] in comm/algorithms/ring.py), run by p threads of one
process over an in-memory communicator that plays MPI's matching: sends and receives between two
ranks matched in the order they were posted, a message's size checked at the match.

Two ways a send may read its buffer, as MPI allows both: ``eager`` copies it when the send is
posted (what the ring sends must be final then), ``rendezvous`` reads it only when the receiver
matches it and only then completes (what the ring sends must stay unchanged until its request
is done). Each property runs under both, at 2, 3 and 4 ranks, with segments of several chunks.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from terrapipe.comm.algorithms.ring import ring_allreduce
from terrapipe.kernels import reduce as kreduce


class _Wire:
    """Every pair's posted sends and receives, matched in order under one lock."""

    def __init__(self, p: int, mode: str) -> None:
        self.p, self.mode = p, mode
        self.lock = threading.Lock()
        self.sends: dict[tuple[int, int, int], list] = {}
        self.recvs: dict[tuple[int, int, int], list] = {}
        self.log: list[list[tuple]] = [[] for _ in range(p)]  # per rank: ("send"|"got", offset)

    def match(self, key) -> None:
        sends, recvs = self.sends.setdefault(key, []), self.recvs.setdefault(key, [])
        while sends and recvs:
            s, r = sends.pop(0), recvs.pop(0)
            if s.data.nbytes != r.arr.nbytes:
                raise AssertionError(f"{key}: a send of {s.data.nbytes} bytes met a receive of "
                                     f"{r.arr.nbytes}")
            r.arr.view(np.uint8)[:] = s.data.view(np.uint8)  # rendezvous: read at the match
            s.done = r.done = True


class _Req:
    def __init__(self, wire: _Wire, **kw) -> None:
        self.wire, self.done = wire, False
        self.__dict__.update(kw)

    def Test(self) -> bool:  # noqa: N802
        with self.wire.lock:
            return self.done


class _Comm:
    def __init__(self, wire: _Wire, rank: int, base: np.ndarray) -> None:
        self.wire, self.rank, self.base = wire, rank, base

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.wire.p

    def _offset(self, arr: np.ndarray) -> int | None:
        if arr.size == 0:
            return None
        at = arr.__array_interface__["data"][0] - self.base.__array_interface__["data"][0]
        return at // arr.itemsize if 0 <= at < self.base.nbytes else -1  # -1: a spare buffer

    def Isend(self, arr: np.ndarray, dest: int, tag: int) -> _Req:  # noqa: N802
        w = self.wire
        data = arr.copy() if w.mode == "eager" else arr
        req = _Req(w, data=data, done=w.mode == "eager")
        with w.lock:
            w.log[self.rank].append(("send", self._offset(arr)))
            w.sends.setdefault((self.rank, dest, tag), []).append(req)
            w.match((self.rank, dest, tag))
        return req

    def Irecv(self, arr: np.ndarray, source: int, tag: int) -> _Req:  # noqa: N802
        w = self.wire
        req = _Req(w, arr=arr)
        with w.lock:
            w.recvs.setdefault((source, self.rank, tag), []).append(req)
            w.match((source, self.rank, tag))
        return req


def _run(p: int, n: int, dtype, chunk_bytes: int, mode: str, kind: int = 0, op: int = kreduce.SUM):
    """Every rank's buffer after ring_allreduce, their inputs, and the wire's log."""
    wire = _Wire(p, mode)
    rng = np.random.default_rng(p * 1000 + n)
    if kind:
        values = [rng.integers(-8, 8, n).astype(np.float32) for _ in range(p)]
        inputs = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in values]  # exact in bfloat16
    else:
        inputs = [rng.integers(-1000, 1000, n).astype(dtype) for _ in range(p)]
    bufs = [x.copy() for x in inputs]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        c = _Comm(wire, r, bufs[r])

        def wait(req, what, peer):
            deadline = time.monotonic() + 20
            while not req.Test():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: waiting for rank {peer}")
                time.sleep(0)
            if hasattr(req, "arr"):  # a receive this rank now holds
                with wire.lock:
                    wire.log[r].append(("got", c._offset(req.arr)))

        try:
            ring_allreduce(c, bufs[r], op, kind, wait, [], None, chunk_bytes)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return bufs, inputs, wire


@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 1000, 4099])
def test_every_rank_holds_the_sum_whatever_the_segments_and_chunks(mode, p, n):
    bufs, inputs, _ = _run(p, n, np.int64, 64, mode)
    want = np.sum(inputs, axis=0)
    for r, b in enumerate(bufs):
        np.testing.assert_array_equal(b, want, err_msg=f"rank {r}")


@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
@pytest.mark.parametrize("op", [kreduce.MAX, kreduce.MIN])
def test_other_ops_and_float32(mode, op):
    bufs, inputs, _ = _run(3, 777, np.float32, 128, mode, op=op)
    want = (np.max if op == kreduce.MAX else np.min)(inputs, axis=0)
    for b in bufs:
        np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
def test_bfloat16_sums_exact_values(mode):
    bufs, inputs, _ = _run(4, 1001, np.uint16, 64, mode, kind=kreduce.BF16)
    as_f32 = [(x.astype(np.uint32) << 16).view(np.float32) for x in inputs]
    want = np.sum(as_f32, axis=0)
    for b in bufs:
        np.testing.assert_array_equal((b.astype(np.uint32) << 16).view(np.float32), want)


@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
@pytest.mark.parametrize("p", [2, 4])
def test_a_chunk_goes_on_to_the_next_step_before_its_step_has_all_arrived(mode, p):
    # NOTE [ring schedule] 2: with segments of 4 chunks, a rank sends chunk 0 of step 1 (segment
    # r - 1, from its start) right after chunk 0 of step 0 arrived, before the rest of step 0
    # has; waiting for whole steps sent it only after the fourth.
    chunks, elems = 4, 16
    n = p * chunks * elems
    seg = n // p
    _, _, wire = _run(p, n, np.int64, elems * 8, mode)
    for r, log in enumerate(wire.log):
        sends = [i for i, (kind, at) in enumerate(log) if kind == "send" and at is not None]
        got = [i for i, (kind, at) in enumerate(log) if kind == "got" and at is not None]
        assert len(sends) == 2 * (p - 1) * chunks and len(got) == 2 * (p - 1) * chunks, (r, log)
        step1 = sends[chunks]
        assert log[step1] == ("send", ((r - 1) % p) * seg), (r, log[:2 * chunks + 2])
        assert got[0] < step1 < got[1], (r, log[:2 * chunks + 2])
