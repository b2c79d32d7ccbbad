"""Collectives through the node's shared segment (comm/transports/shm.py), in chunks of a row
half (NOTE [row halves] there); across nodes an allreduce is hierarchical: each part is reduced
on the node, allreduced between nodes over the cross-node MPI transport, and gathered back.

An allreduce: per chunk, every rank copies its piece into its row, a barrier, each rank reduces
its part of the chunk over every row (``segments``), allreduces that part across nodes, a
barrier, and every rank copies every part out. About 5.5 n bytes of memory traffic per rank;
the single-copy (comm/algorithms/single_copy.py) and in-place shared (shared.py) algorithms move
less where they apply, but only this one runs across nodes, where it overlaps a device-staged
message's copies with the reduction (NOTE [staging gate] in comm/message.py; on one node
staged_rows.py does without the host copies).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import NO_GATE, Fused, divide, segments

__all__ = ["Crossing", "Inline", "crossing", "allreduce", "allreduce_overlapped", "overlaps", "broadcast",
           "allgather", "scatter", "reduce_scatter", "reduce_rows", "reduce_part", "chunks"]


def reduce_rows(shm, rows: np.ndarray, op: int, offset: int, length: int, kind: int) -> None:
    """My row's ``[offset:offset+length]`` = op over all of the node's rows of those columns (only
    columns no other rank reads at this point). ``rows``: (local_size, m) of the rows' dtype."""
    mine = rows[shm.local_rank]
    if kind:
        kreduce.reduce_many_16(mine, rows, op, offset, length, kind, shm.acc)
    else:
        kreduce.reduce_many_native(mine, rows, op, offset, length)


def reduce_part(shm, rows: np.ndarray, op: int, start: int, length: int, kind: int,
                label: str, rec: bool, t: int, across=None) -> int:
    """This rank's part of a message, columns ``[start, start + length)``: reduced over the
    node's rows into its own row, allreduced across nodes (``across(buf, op, kind, what)``, in
    place, summing for ``avg``; None on one node), divided for ``avg``. ``rec``: record ``label``
    (and the cross-node phase) on the timeline from ``t``; returns the clock for the next
    phase."""
    if length <= 0:
        return t
    reduce_rows(shm, rows, op, start, length, kind)
    mine = rows[shm.local_rank, start:start + length]
    if rec:
        t = timeline.phase("comm", label, t, {"bytes": length * rows.itemsize})
    if across is not None:
        across(mine, op, kind, "allreduce across nodes")
        if rec:
            t = timeline.phase("comm", "allreduce across nodes", t)
    if op == kreduce.AVG:
        divide(mine, shm.size, kind)
    return t


def chunks(shm, n: int, itemsize: int):
    """(first element, length, first column of the row half) of each chunk of ``n`` elements."""
    half = (shm.row_bytes // itemsize) // 2
    for c0 in range(0, n, half):
        yield c0, min(half, n - c0), shm.next_half() * half


def allreduce(shm, srcs: Fused, dsts: Fused, op: int, dtype, kind: int, ckind: int = 0, root: int = -1,
              gate=NO_GATE, across=None) -> None:
    """``dsts`` = op over every rank's ``srcs``, a row half at a time; the agreement has run.
    ``kind``: 16-bit format of the rows; ``ckind``: the rows hold compressed copies of float32
    inputs; ``root`` >= 0: only that rank copies the result out (a reduce); ``across``: the
    cross-node allreduce of each part (:func:`reduce_part`), None on one node."""
    p, me = shm.local_size, shm.local_rank
    rows = shm.rows(dtype)
    item = np.dtype(dtype).itemsize
    rec = timeline.enabled()  # the phases of each chunk, at one clock read each
    for c0, length, h in chunks(shm, srcs.n, item):
        t = timeline.now() if rec else 0
        gate.ready(c0 + length)
        if rec and gate is not NO_GATE:
            t = timeline.phase("comm", "wait for device", t)
        srcs.read(c0, length, rows[me, h:h + length], ckind)
        if rec:
            t = timeline.phase("comm", "copy in", t, {"bytes": length * item})
        shm.board.barrier(shm.timeout, "allreduce")
        if rec:
            t = timeline.phase("comm", "wait for peers", t)
        parts = segments(length, p)
        lo, hi = parts[me]
        t = reduce_part(shm, rows, op, h + lo, hi - lo, kind, "reduce", rec, t, across)
        shm.board.barrier(shm.timeout, "allreduce")
        if rec:
            t = timeline.phase("comm", "wait for peers", t)
        if root < 0 or root == shm.rank:
            for q, (a, b) in enumerate(parts):
                if b > a:
                    dsts.write(c0 + a, rows[q, h + a:h + b], ckind)
        gate.wrote(c0 + length)
        if rec:
            timeline.phase("comm", "copy out", t)


def _third(shm, itemsize: int) -> int:
    """Elements of a third of a row (whole 64-byte lines for 4-byte items)."""
    return (shm.row_bytes // itemsize) // 3 // 16 * 16


def overlaps(shm, n: int, itemsize: int) -> bool:
    """Whether an allreduce of ``n`` elements spans several chunks of
    :func:`allreduce_overlapped` (on one chunk there is nothing to overlap)."""
    return n > _third(shm, itemsize)


def _thirds(shm, n: int, itemsize: int):
    """(first element, length, first column of its third of the row) of each chunk of ``n``
    elements: chunk k in third k mod 3 (NOTE [overlap across nodes] 2)."""
    third = _third(shm, itemsize)
    for k, c0 in enumerate(range(0, n, third)):
        yield c0, min(third, n - c0), (k % 3) * third


class Crossing:
    """The parts of one allreduce crossing the nodes in the background over ``bulk`` (NOTE
    [overlap across nodes]): each handed over as soon as it is reduced on the node, the one
    before it then finished (waited for, divided for avg, its ``then`` run). As a context
    manager, a failure while a part is still crossing ends it (clause 4).

    ``bulk``: a transport whose ``start_allreduce(buf, op, kind, what)`` returns a future of
    the in-place allreduce of ``buf`` (summing for avg), run in order on its own thread, and
    whose ``abort(why)`` ends the ones under way; ``size``: the group's, for avg."""

    def __init__(self, bulk, op: int, kind: int, size: int) -> None:
        self.bulk, self.op, self.kind, self.size = bulk, op, kind, size
        self._last = None  # (future, part, then) of the part handed over last, not yet finished

    def hand_over(self, part: np.ndarray, then: Callable[[], None]) -> None:
        """Start ``part``'s allreduce across nodes (the caller leaves it alone until its
        ``then`` runs), then finish the part handed over before it."""
        future = self.bulk.start_allreduce(part, self.op, self.kind, "allreduce across nodes")
        last, self._last = self._last, (future, part, then)
        if last is not None:
            self._finish(*last)

    def drain(self) -> None:
        """Finish the part handed over last."""
        last, self._last = self._last, None
        if last is not None:
            self._finish(*last)

    def _finish(self, future, part: np.ndarray, then: Callable[[], None]) -> None:
        with self.bulk.afar(), timeline.span("comm", "wait for the part across nodes"):
            future.result()
        if self.op == kreduce.AVG:
            divide(part, self.size, self.kind)
        then()

    def __enter__(self) -> Crossing:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None and self._last is not None:
            self.bulk.abort(f"the node's part of the allreduce failed: {error}")


class Inline:
    """:class:`Crossing`'s interface for parts that cross the nodes inline, the rank waiting:
    each handed over is allreduced at once by ``across(buf, op, kind, what)`` (in place,
    summing for avg; None on one node), divided for avg, and its ``then`` run. For chunk loops
    written once for both ways (comm/algorithms/shared.py, single_copy.py)."""

    def __init__(self, across, op: int, kind: int, size: int) -> None:
        self.across, self.op, self.kind, self.size = across, op, kind, size

    def hand_over(self, part: np.ndarray, then: Callable[[], None]) -> None:
        if self.across is not None and part.size:
            with timeline.span("comm", "allreduce across nodes"):
                self.across(part, self.op, self.kind, "allreduce across nodes")
        if self.op == kreduce.AVG:
            divide(part, self.size, self.kind)
        then()

    def drain(self) -> None:
        pass  # every part finished as it was handed over

    def __enter__(self) -> Inline:
        return self

    def __exit__(self, kind, error, tb) -> None:
        pass  # nothing crosses after hand_over returns


def crossing(bulk, across, op: int, kind: int, size: int) -> Crossing | Inline:
    """A :class:`Crossing` over ``bulk``, or where it is None an :class:`Inline` over
    ``across``."""
    return Crossing(bulk, op, kind, size) if bulk is not None else Inline(across, op, kind, size)


def allreduce_overlapped(shm, srcs: Fused, dsts: Fused, op: int, dtype, kind: int, ckind: int = 0,
                         root: int = -1, gate=NO_GATE, bulk=None) -> None:
    """:func:`allreduce` across nodes with each chunk's part crossing the nodes over ``bulk``
    while the node works on the next chunk (NOTE [overlap across nodes]; ``bulk`` as
    :class:`Crossing` takes it).

    NOTE [overlap across nodes]
        1. In :func:`allreduce` a chunk's part crosses the nodes while the rank waits, so the link
           idles while the node copies and reduces, and the node idles while the link carries.
           Here the part of chunk k is handed to ``bulk`` (its own thread, waits asleep in the
           kernel: transports/tcp.py) as soon as it is reduced on the node; the rank goes on
           with chunk k + 1, then waits for part k, publishes it and copies chunk k out. The
           link carries part k + 1 right after part k, while the node copies.
        2. So three chunks are in use at once (k - 1 copied out, k crossing, k + 1 copied in):
           each row is cut in thirds, chunk k in third k mod 3. A rank copies chunk k + 1 into the
           third of chunk k - 2 only after the barrier that every rank publishes after copying
           chunk k - 2 out (the one after chunk k's copy-in), as NOTE [row halves] 1 in
           comm/transports/shm.py does with two.
        3. The barriers, on every rank in the same order: A_k after chunk k's copy-in, B_k before
           chunk k's copy-out, which comes after A_(k+1); one more at the end, after which no
           rank reads any row, so the next call may use any third or half (the row-half counter
           is not touched): a one-shot writes its half before it agrees, and without that
           barrier it overwrote a part a slower peer was still copying out (a regression test).
           The agreement before the call was the barrier at its start: no rank agrees before it
           finished reading the rows of its last call.
        4. A failure on the node (a barrier timing out, a peer lost) while a part is crossing
           ends it (``bulk.abort``): the thread is not left waiting on other machines, and the
           transport is unusable after, as the group is.
        5. An allreduce in place on a shared array (comm/algorithms/shared.py, NOTE [shared
           arrays] 3) hands its parts over the same way; it copies nothing in, so its chunks
           need no thirds.
    """
    p, me = shm.local_size, shm.local_rank
    rows = shm.rows(dtype)
    item = np.dtype(dtype).itemsize
    rec = timeline.enabled()

    def copy_out(c0: int, length: int, h: int, parts: list[tuple[int, int]]) -> Callable[[], None]:
        def then() -> None:
            shm.board.barrier(shm.timeout, "allreduce")
            if root < 0 or root == shm.rank:
                for q, (a, b) in enumerate(parts):
                    if b > a:
                        dsts.write(c0 + a, rows[q, h + a:h + b], ckind)
            gate.wrote(c0 + length)
        return then

    with Crossing(bulk, op, kind, shm.size) as crossing:
        for c0, length, h in _thirds(shm, srcs.n, item):
            t = timeline.now() if rec else 0
            gate.ready(c0 + length)
            srcs.read(c0, length, rows[me, h:h + length], ckind)
            if rec:
                t = timeline.phase("comm", "copy in", t, {"bytes": length * item})
            shm.board.barrier(shm.timeout, "allreduce")
            parts = segments(length, p)
            lo, hi = parts[me]
            if hi > lo:
                reduce_rows(shm, rows, op, h + lo, hi - lo, kind)
            if rec:
                timeline.phase("comm", "reduce", t, {"bytes": (hi - lo) * item})
            crossing.hand_over(rows[me, h + lo:h + hi], copy_out(c0, length, h, parts))
        crossing.drain()
    shm.board.barrier(shm.timeout, "allreduce")


# -- one node only (comm/select.py sends these over MPI across nodes) ---------------------------
def broadcast(shm, flat: np.ndarray, root: int) -> None:
    rows = shm.rows(flat.dtype)
    lroot = shm.board.ranks.index(root)
    for c0, length, h in chunks(shm, flat.shape[0], flat.itemsize):
        if shm.rank == root:
            rows[lroot, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, "broadcast")
        if shm.rank != root:
            flat[c0:c0 + length] = rows[lroot, h:h + length]


def allgather(shm, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
    rows = shm.rows(flat.dtype)
    me = shm.local_rank
    coll = "gather" if root >= 0 else "allgather"
    for c0, length, h in chunks(shm, flat.shape[0], flat.itemsize):
        rows[me, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, coll)
        if root < 0 or root == shm.rank:
            for q in range(shm.local_size):
                out[shm.board.ranks[q], c0:c0 + length] = rows[q, h:h + length]


def scatter(shm, full: np.ndarray, out: np.ndarray, root: int) -> None:
    n = out.shape[0]
    rows = shm.rows(out.dtype)
    me = shm.local_rank
    for c0, length, h in chunks(shm, n, out.itemsize):
        if shm.rank == root:
            for q in range(shm.local_size):
                r = shm.board.ranks[q]
                rows[q, h:h + length] = full[r * n + c0:r * n + c0 + length]
        shm.board.barrier(shm.timeout, "scatter")
        out[c0:c0 + length] = rows[me, h:h + length]


def reduce_scatter(shm, flat: np.ndarray, out: np.ndarray, op: int, kind: int) -> None:
    if kind:  # 16-bit rows: through a full allreduce, whose kernels accumulate in float32
        tmp = flat.copy()
        fused = Fused([tmp])
        allreduce(shm, fused, fused, op, tmp.dtype, kind)  # one node: no cross-node part
        lo, hi = segments(flat.shape[0], shm.size)[shm.rank]
        out[...] = tmp[lo:hi]
        return
    n = flat.shape[0]
    rows = shm.rows(flat.dtype)
    me = shm.local_rank
    lo_me, hi_me = segments(n, shm.size)[shm.rank]
    for c0, length, h in chunks(shm, n, flat.itemsize):
        rows[me, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, "reduce_scatter")
        a, b = max(lo_me, c0), min(hi_me, c0 + length)
        if b > a:
            reduce_rows(shm, rows, op, h + a - c0, b - a, 0)
            dst = out[a - lo_me:b - lo_me]
            dst[...] = rows[me, h + a - c0:h + b - c0]
            if op == kreduce.AVG:
                divide(dst, shm.size, 0)
