"""A device-staged allreduce on one node with no host copy: each chunk goes from the device
straight into this rank's row of the node's segment, is reduced there in one pass, and goes
back to the device from the same row.

NOTE [staged rows]
    1. The segment path (comm/algorithms/segment.py) stages a CUDA message through a private
       pinned buffer: the device copies into it, the host copies it into its row, reduces, and
       copies every part back out (about 5.5 n bytes of host memory traffic per rank, as for a
       host message). Here the rows are registered with CUDA (``cudaHostRegister`` of the
       segment's mapping, once per group), the device copies each chunk into this rank's row
       and back out of it, and the host only reduces: its part of the chunk over every row,
       stored into every row in the same pass (``kernels.reduce.allreduce_rows``; 16-bit floats
       accumulate in float32, then the part is copied into the other rows). About 2 n bytes
       per rank; the copies are the DMA engine's.
    2. Chunks are a row half (NOTE [row halves] in comm/transports/shm.py). Per chunk k: wait
       for its download, barrier B1(k) (every row holds chunk k), queue chunk k + 1's download,
       reduce this rank's part, barrier B2(k) (every row holds chunk k's result), queue chunk
       k's upload. The side stream runs copies in queue order: D0, D1, U0, D2, U1, D3, ...
    3. Why chunk k + 1's download waits for B1(k): it writes the half that chunk k - 1 used,
       or, on the first chunk, the half a previous call's last chunk used, whose readers (a
       segment call's peers copying parts out of this row) are done only once they reach this
       call's first barrier. Chunk k + 1's download is queued after chunk k - 1's upload, so
       the device has read a half before it overwrites it, and a peer writes results into this
       rank's half only after B1 of that chunk, for which this rank waited for its download.
    4. The call waits for its last upload before it returns: the next collective may write the
       rows (a peer's reduced parts, this rank's own next chunk), and an upload still reading a
       row would send that instead. The caller's stream waits for the uploads as in NOTE
       [staging streams] (comm/staging.py); the host waits for one chunk's upload at most.
    5. Taken by device-staged allreduces beyond the one-shot on one node, not compressed on
       the wire (the rows would hold 16-bit copies, which the device cannot make), when every
       rank stages (a host rank would pick another algorithm and get CollectiveMismatchError,
       as before; NOTE [algorithm selection] 1 in comm/select.py). The gate speaks the rows'
       protocol (NOTE [staging gate] in comm/message.py).
    6. A rank reduces its part on the collective's own thread. Splitting it among helper
       threads (a pool per group, each share whole 64-byte lines of at least 128 KiB, the
       kernel run without the GIL) was built and measured slower on the H100's host (Xeon, 16
       cores), 2 ranks, 8 float32 CUDA tensors, each run against the segment's way in the same
       run: at 16 MiB 2.73x the segment's rate on one thread, 1.93x on two, 1.32x on four; at
       64 MiB 3.27x, 2.01x, 1.66x. It was taken out.
"""

from __future__ import annotations

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import divide, segments
from .segment import chunks as segment_chunks
from .segment import reduce_rows

__all__ = ["allreduce"]


def _part(shm, rows: np.ndarray, op: int, start: int, length: int, kind: int) -> None:
    """This rank's columns ``[start, start + length)`` of every row = op over the rows, divided
    for avg (NOTE [staged rows] 1), on the collective's thread (clause 6)."""
    if length <= 0:
        return
    me = shm.local_rank
    if not kind:
        kreduce.allreduce_rows(rows, me, op, start, length, shm.size if op == kreduce.AVG else 1)
        return
    reduce_rows(shm, rows, op, start, length, kind)
    mine = rows[me, start:start + length]
    if op == kreduce.AVG:
        divide(mine, shm.size, kind)
    for q in range(shm.local_size):
        if q != me:
            rows[q, start:start + length] = mine


def allreduce(shm, gate, n: int, op: int, dtype, kind: int) -> None:
    """Allreduce ``n`` fused elements of ``dtype`` (uint16 bits for 16-bit ``kind``) that
    ``gate`` (a comm/staging.py StagedGroup) downloads into and uploads from the rows; one
    node, every rank staging; the agreement has run (NOTE [staged rows])."""
    if n == 0:
        return
    p, me = shm.local_size, shm.local_rank
    seg = shm.segment
    gate.pin(seg.buf.ctypes.data, seg.nbytes)
    rows = shm.rows(dtype)
    chunks = list(segment_chunks(shm, n, np.dtype(dtype).itemsize))  # the halves, taken now
    rec = timeline.enabled()
    c0, length, h = chunks[0]
    gate.copy_in(c0, length, rows[me, h:h + length])
    for k, (c0, length, h) in enumerate(chunks):
        t = timeline.now() if rec else 0
        gate.wait_in()
        if rec:
            t = timeline.phase("comm", "wait for device", t)
        shm.board.barrier(shm.timeout, "allreduce")  # B1(k)
        if rec:
            t = timeline.phase("comm", "wait for peers", t)
        if k + 1 < len(chunks):  # clause 3
            c1, length1, h1 = chunks[k + 1]
            gate.copy_in(c1, length1, rows[me, h1:h1 + length1])
        lo, hi = segments(length, p)[me]
        _part(shm, rows, op, h + lo, hi - lo, kind)
        if rec:
            t = timeline.phase("comm", "reduce (rows)", t, {"bytes": (hi - lo) * rows.itemsize})
        shm.board.barrier(shm.timeout, "allreduce")  # B2(k)
        if rec:
            timeline.phase("comm", "wait for peers", t)
        gate.copy_out(c0, rows[me, h:h + length])
    gate.settle()  # clause 4
