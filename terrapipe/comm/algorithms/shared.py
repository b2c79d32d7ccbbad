"""Allreduce in place over shared arrays: memory in the node's shared segments that each rank
owns a row of (``Group.shared_array``), reduced with nothing copied in or out.

NOTE [shared arrays]
    1. ``ShmTransport.alloc_shared`` (comm/transports/shm.py; ``Group.shared_array``,
       collective) maps one segment per node with a row of the requested size per local rank
       and gives each rank its own row.
       Memory allocated there (DistributedGradients' bucket buffers) is reduced in place with
       nothing copied in or out: every rank takes one part of the message, reduces it over all
       rows and stores the result into every row, its peers' included. Per rank that moves
       about 2 n bytes (reads n, writes n); the chunked segment path moves about 5.5 n (copy in,
       reduce, copy out) and the MPI ring about as much.
    2. An allreduce takes this path when its one source is its destination, lies within this
       rank's row of such a segment, and is not compressed on the wire (from
       ``SHARED_MIN_BYTES``: NOTE [algorithm selection] 6 in comm/select.py). Its signature carries
       (segment, byte offset), so every rank must pass the same piece of its own row; a rank
       passing private memory where another passes shared memory gets CollectiveMismatchError
       rather than a hang.
    3. On one node, for native dtypes, a rank's part goes in one pass
       (``kernels.reduce.allreduce_rows``): tile by tile, reduced into its own row while the
       tile sits in L1, divided there for avg, stored from there into the other rows. Two
       barriers only: the agreement's first (every rank's data is final) and a last one (every
       row is final, so the caller may read and write its row once the call returns). Nothing
       in between: the parts' columns are disjoint, and during the call a rank reads and
       writes only its own part's columns, in every row. Against the three passes this path
       took before (reduce into its own row, divide, then per 4 MiB chunk a barrier and a copy
       of the others' parts from their rows: about 2.5-3.5 n bytes), interleaved at 2 ranks:
       16 MiB 2.2 vs 6.0 ms, 34 MiB 4.6 vs 12.4, 64 MiB 9.1 vs 22.3; in a training step
       (benchmarks.train's model, 21 interleaved rounds) the communication overhead fell from
       18.6 to 10.3 ms. ``benchmarks.allreduce -n 2``: 7.9-8.7 GB/s from 4 MiB, 1.7-2x the
       ring over MPI, 4.7-5x MPICH's Allreduce from 64 MiB. Across nodes a part must be allreduced
       between the nodes before it is stored into the other rows, and 16-bit floats are summed
       in float32 scratch (``reduce_many_16``), so those take the three passes, in chunks
       (``_SHARED_CHUNK_BYTES``): reduce my part of chunk k (and allreduce it across nodes),
       barrier, copy the others' parts of chunk k while their writes are still in the shared
       cache. One barrier per chunk suffices: after barrier k nobody writes chunk k's columns
       of any row again, and the next chunk's columns are disjoint.
    4. The segment's memory is reserved when it is made (``posix_fallocate``), so a full
       ``/dev/shm`` refuses at once, with OSError on every rank of the node, instead of killing
       a process with SIGBUS at its first touch of a missing page.
"""

from __future__ import annotations

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import segments
from .segment import crossing, reduce_rows

__all__ = ["allreduce", "overlaps", "SHARED_MIN_BYTES"]

# NOTE [shared arrays] 3: across nodes a message goes in chunks of this size (each rank reduces
# its part of a chunk, then copies the others' parts of it, still in the shared cache). 1 and 4
# MiB ran alike here, 16 MiB and whole messages slower at 2 ranks.
_SHARED_CHUNK_BYTES = 4 << 20
# An allreduce over a shared array pays two barriers (the agreement's and the last) where the
# one-shot pays one, but reads n bytes instead of p x n and copies nothing in or out. Measured
# (interleaved, float32 avg, each operand written right before its call, as gradients are): at
# 2 ranks the one-shot wins up to 448 KiB (256 KiB: 76 vs 96 us), ties at 512, loses beyond
# (1 MiB 384 vs 180 us, 2 MiB 825 vs 289); at 4 ranks on 2 cores it wins at 256 KiB (305 vs
# 341), loses from 512 (399 vs 359). On operands reduced again without a write between, the
# shared path already wins from 128 KiB. NOTE [algorithm selection] 6 in comm/select.py.
SHARED_MIN_BYTES = 512 << 10


def allreduce(shm, ident: int, offset: int, n: int, op: int, dtype, kind: int, across=None,
              bulk=None) -> None:
    """Allreduce, in place, the ``n`` elements of ``dtype`` at byte ``offset`` of every local
    rank's row of shared segment ``ident`` (NOTE [shared arrays]); the agreement's barrier
    has run. Across nodes each part is allreduced by ``across`` (segment.Inline), or, with
    ``bulk``, handed over to it while the node goes on (NOTE [overlap across nodes] 5 in
    comm/algorithms/segment.py)."""
    rows = shm.shared_rows(ident).view(dtype)
    p, me = shm.local_size, shm.local_rank
    item = np.dtype(dtype).itemsize
    base = offset // item
    rec = timeline.enabled()
    t = timeline.now() if rec else 0
    if across is None and not kind:  # NOTE [shared arrays] 3: one pass
        lo, hi = segments(n, p)[me]
        divisor = shm.size if op == kreduce.AVG else 1
        kreduce.allreduce_rows(rows, me, op, base + lo, hi - lo, divisor)
        if rec:
            t = timeline.phase("comm", "reduce (shared)", t, {"bytes": (hi - lo) * item})
    else:  # across nodes, or 16-bit floats: three passes per chunk
        _chunked(shm, rows, base, n, op, kind, crossing(bulk, across, op, kind, shm.size))
        t = timeline.now() if rec else 0
    shm.board.barrier(shm.timeout, "allreduce")  # NOTE [shared arrays] 3
    if rec:
        timeline.phase("comm", "wait for peers", t)


def overlaps(n: int, itemsize: int) -> bool:
    """Whether an allreduce of ``n`` elements over a shared array spans several chunks (on one
    there is nothing to overlap)."""
    return n * itemsize > _SHARED_CHUNK_BYTES


def _chunked(shm, rows: np.ndarray, base: int, n: int, op: int, kind: int, parts_across) -> None:
    """NOTE [shared arrays] 3's chunks: this rank reduces its part of chunk k and hands it to
    ``parts_across`` (segment.Crossing: it crosses the nodes while this rank reduces the next,
    NOTE [overlap across nodes] 5 in comm/algorithms/segment.py; segment.Inline: at once); once
    the part is back, a barrier, and the copy of the peers' parts of that chunk."""
    p, me = shm.local_size, shm.local_rank
    step = max(_SHARED_CHUNK_BYTES // rows.itemsize, p)
    rec = timeline.enabled()

    def copy_parts(at: int, parts: list[tuple[int, int]]):
        def then() -> None:
            t = timeline.now() if rec else 0
            shm.board.barrier(shm.timeout, "allreduce")
            if rec:
                t = timeline.phase("comm", "wait for peers", t)
            # The peers' parts of this chunk, while their writes are still in the shared cache.
            # Nobody writes these columns of this row again in this call: a peer's next chunk
            # is beyond them (NOTE [shared arrays] 3).
            for q, (a, b) in enumerate(parts):
                if q != me and b > a:
                    rows[me, at + a:at + b] = rows[q, at + a:at + b]
            if rec:
                others = parts[-1][1] - (parts[me][1] - parts[me][0])
                timeline.phase("comm", "copy parts (shared)", t, {"bytes": others * rows.itemsize})
        return then

    with parts_across:
        for c0 in range(0, n, step):
            parts = segments(min(step, n - c0), p)
            lo, hi = parts[me]
            at = base + c0
            t = timeline.now() if rec else 0
            if hi > lo:
                reduce_rows(shm, rows, op, at + lo, hi - lo, kind)
            if rec:
                timeline.phase("comm", "reduce (shared)", t, {"bytes": (hi - lo) * rows.itemsize})
            parts_across.hand_over(rows[me, at + lo:at + hi], copy_parts(at, parts))
        parts_across.drain()
