"""Collectives through the node's shared segment (comm/transports/shm.py), in chunks of a row
half (NOTE [row halves] there); across nodes an allreduce is hierarchical: each part is reduced
on the node, allreduced between nodes over the cross-node MPI transport, and gathered back.

An allreduce: per chunk, every rank copies its piece into its row, a barrier, each rank reduces
its part of the chunk over every row (``segments``), allreduces that part across nodes, a
barrier, and every rank copies every part out. About 5.5 n bytes of memory traffic per rank;
the single-copy (comm/algorithms/single_copy.py) and in-place shared (shared.py) algorithms move
less where they apply, but only this one overlaps a device-staged message's copies with the
reduction (NOTE [staging gate] in comm/message.py) and runs across nodes.
"""

from __future__ import annotations

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import NO_GATE, Fused, divide, segments

__all__ = ["allreduce", "broadcast", "allgather", "scatter", "reduce_scatter", "reduce_rows", "reduce_part"]


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


def _chunks(shm, n: int, itemsize: int):
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
    for c0, length, h in _chunks(shm, srcs.n, item):
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


# -- one node only (comm/select.py sends these over MPI across nodes) ---------------------------
def broadcast(shm, flat: np.ndarray, root: int) -> None:
    rows = shm.rows(flat.dtype)
    lroot = shm.board.ranks.index(root)
    for c0, length, h in _chunks(shm, flat.shape[0], flat.itemsize):
        if shm.rank == root:
            rows[lroot, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, "broadcast")
        if shm.rank != root:
            flat[c0:c0 + length] = rows[lroot, h:h + length]


def allgather(shm, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
    rows = shm.rows(flat.dtype)
    me = shm.local_rank
    coll = "gather" if root >= 0 else "allgather"
    for c0, length, h in _chunks(shm, flat.shape[0], flat.itemsize):
        rows[me, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, coll)
        if root < 0 or root == shm.rank:
            for q in range(shm.local_size):
                out[shm.board.ranks[q], c0:c0 + length] = rows[q, h:h + length]


def scatter(shm, full: np.ndarray, out: np.ndarray, root: int) -> None:
    n = out.shape[0]
    rows = shm.rows(out.dtype)
    me = shm.local_rank
    for c0, length, h in _chunks(shm, n, out.itemsize):
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
    for c0, length, h in _chunks(shm, n, flat.itemsize):
        rows[me, h:h + length] = flat[c0:c0 + length]
        shm.board.barrier(shm.timeout, "reduce_scatter")
        a, b = max(lo_me, c0), min(hi_me, c0 + length)
        if b > a:
            reduce_rows(shm, rows, op, h + a - c0, b - a, 0)
            dst = out[a - lo_me:b - lo_me]
            dst[...] = rows[me, h + a - c0:h + b - c0]
            if op == kreduce.AVG:
                divide(dst, shm.size, 0)
