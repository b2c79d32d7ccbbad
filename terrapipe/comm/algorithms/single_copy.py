"""Collectives on one node that read the peers' private memory straight into ours, nothing through
the shared segment (the cma transport, comm/transports/cma.py: Linux cross-memory attach, as
MPICH and Open MPI do for large messages on a node).

NOTE [single-copy allreduce]
    1. What it is for: allreduces of private memory too large for the one-shot (DDP's buckets,
       torch tensors, NumPy arrays: memory terrapipe did not allocate, so the in-place path over
       a shared array (NOTE [shared arrays] in comm/algorithms/shared.py) cannot reach it).
       Through the segment such
       a message is copied in, reduced and copied out, about 5.5 n bytes of memory traffic per
       rank; the ring over MPI moves about as much. Here each rank moves about 2.5 n at two
       ranks: it reads its part of every peer's source into a cache-sized tile and folds it into
       its own part of the destination (reads n / p from each peer, reads and writes its own
       part), then reads every peer's reduced part straight into its destination.
    2. Steps. The agreement publishes, with the signature, the addresses of each rank's source
       and destination (board words, written before the step's release store, so a peer that
       sees the step sees them). Phase one: reduce my part (``segments(n, p)[me]``) into my
       destination from my source and every peer's source, divided there for avg. A barrier:
       every part is final, and nobody reads a source again. Phase two: copy every peer's part
       from its destination into mine. A last barrier: nobody reads my destination any more, so
       the caller may write it once the call returns. Nothing else orders the phases: during
       phase one a rank writes only its own part of its own destination, which no peer reads
       until phase two; during phase two it writes only the others' parts of its destination,
       which no peer reads at all.
    3. Same order of operations as the other paths (``kernels.reduce.allreduce_rows``): my value
       first, then the peers' in rank order, one division for avg; every rank copies the
       owner's bytes, so all ranks hold identical results.
    4. Availability: the kernel allows it between processes that may ptrace each other (same
       user, no Yama restriction, no seccomp filter against it). ``ShmTransport`` (comm/transports/shm.py)
       tries it on
       every rank of the node at start-up (each reads a word of every other) and the node
       agrees; where any rank cannot, the segment and
       the ring carry these messages as before. ``TERRAPIPE_CMA=0`` turns it off.
    5. Failures: a read from a rank that died fails at once (ESRCH) and is raised naming that
       rank; the barriers time out naming late ranks, as every shared-memory wait does.
    6. The other collectives on one node. A reduce-scatter is phase one alone, into the
       caller's output, from ``REDUCE_SCATTER_MIN_BYTES`` (1 MiB of input), then one barrier
       (nobody reads a source any more). An allgather (and a gather, on its root) reads each
       peer's input into that peer's row of the output, from ``MIN_BYTES`` of input, then one
       barrier. Interleaved against the segment (each rank's input, float32): reduce-scatter at
       2 ranks 1 MiB 145 vs 193 us, 64 MiB 11.0 vs 26.8 ms; at 4 ranks on 2 cores a tie at
       1 MiB, 21.3 vs 51.2 ms at 64 MiB; allgather at 2 ranks 2 MiB 526 vs 607 us, 64 MiB
       23.3 vs 28.3 ms; at 4 ranks a tie at 2 MiB, 93 vs 123 ms at 64 MiB. A broadcast stays in
       the segment: its chunks let root copy in while the others copy out, which is as fast
       here (64 MiB 16.3 ms single-copy vs 15.3).
    7. Across nodes (:func:`allreduce_nodes`): the same two phases, with each rank's part
       allreduced between the nodes in between, chunk by chunk (``NODES_CHUNK_BYTES`` of the
       message). Per chunk a rank reduces its part from the node's sources into its
       destination, hands it to the group's ``bulk`` TCP rings (NOTE [overlap across nodes]
       in comm/algorithms/segment.py) and goes on with the next chunk's part while it
       crosses; once it is back (divided there for avg), a barrier, and the rank reads the
       peers' parts of that chunk from their destinations. Where a source is its destination,
       the reads stay safe without more barriers: a peer overwrites my part of its source
       (reading my result) only after barrier k, which I enter after I read that part; a part
       read after barrier k is final, and nobody writes it again. A last barrier: nobody reads
       my destination any more. Against the segment's way (copy in, reduce over the rows, copy
       out: about 5.5 n of memory traffic) the node moves about 2.5 n, which is what decides
       where the cores, not the link, set the pace (10gbit on two cores). Without ``bulk``
       (parts over MPI) each part crosses inline, by the ring or MPI's own.
"""

from __future__ import annotations

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import segments
from ..transports import cma
from .segment import crossing

__all__ = ["allreduce", "allreduce_nodes", "allgather", "reduce_scatter", "MIN_BYTES",
           "REDUCE_SCATTER_MIN_BYTES", "NODES_CHUNK_BYTES"]

# The smallest allreduce (bytes) that goes single-copy; smaller ones take the one-shot
# (NOTE [algorithm selection] 7 in comm/select.py).
MIN_BYTES = 2 << 20
# A reduce-scatter reads only its own part of every peer's message: it gains from half the size
# (NOTE [single-copy allreduce] 6).
REDUCE_SCATTER_MIN_BYTES = 1 << 20
# Across nodes a message goes in chunks of this many bytes (NOTE [single-copy allreduce] 7):
# each rank's part of one crosses the nodes while the rank reduces its part of the next. Each
# chunk costs a barrier and a hand-off, which four ranks sharing two cores feel: interleaved
# against the segment's way at 2 nodes x 2 over 10gbit, 64 MiB, 1 MiB chunks ran 1.05x, 2 MiB
# 1.29x, 4 MiB 1.37-1.44x, 8 MiB 1.43x; over 1gbit all level (the link sets the pace).
NODES_CHUNK_BYTES = 4 << 20


def _reduce_from_peers(shm, dst: np.ndarray, shift: int, src: np.ndarray, lo: int, hi: int,
                       op: int, coll: str, final: bool = True) -> None:
    """Phase one (NOTE [single-copy allreduce] 2): ``dst[lo - shift:hi - shift]`` = op over
    every local rank's posted source ``[lo, hi)`` (``src`` is mine), divided for avg where
    ``final`` (not before the part crosses the nodes)."""
    peers, addrs = shm.peers, shm.board.addrs
    divisor = shm.size if op == kreduce.AVG and final else 1
    failed = cma.reduce_part(dst, shift, src, peers.pids, np.ascontiguousarray(addrs[:, 0]),
                             shm.local_rank, op, lo, hi, divisor, src.dtype.kind in "iu",
                             peers.tile(src.dtype), peers.iov)
    if failed >= 0:
        raise peers.failed(failed, coll, int(addrs[failed, 0]))


def _gather(shm, dst: np.ndarray, bounds: np.ndarray) -> None:
    """Phase two (NOTE [single-copy allreduce] 2): every peer's ``dst[bounds[q]:bounds[q+1]]``
    read from its posted destination into mine."""
    peers, addrs = shm.peers, shm.board.addrs
    failed = cma.gather_parts(dst, peers.pids, np.ascontiguousarray(addrs[:, 1]), bounds, shm.local_rank,
                              peers.iov)
    if failed >= 0:
        raise peers.failed(failed, "allreduce", int(addrs[failed, 1]))


def allreduce(shm, src: np.ndarray, dst: np.ndarray, op: int) -> None:
    """Allreduce ``src`` (1-D, native dtype, this rank's private memory) into ``dst`` (same
    shape and dtype; may be ``src``) by reading the peers' memory (NOTE [single-copy
    allreduce]); ``shm.post_single_copy`` and the agreement have run. One node."""
    board, me = shm.board, shm.local_rank
    n = src.shape[0]
    parts = segments(n, shm.local_size)
    lo, hi = parts[me]
    rec = timeline.enabled()
    t = timeline.now() if rec else 0
    _reduce_from_peers(shm, dst, 0, src, lo, hi, op, "allreduce")
    if rec:
        t = timeline.phase("comm", "reduce (single copy)", t, {"bytes": (hi - lo) * src.itemsize})
    board.barrier(shm.timeout, "allreduce")
    if rec:
        t = timeline.phase("comm", "wait for peers", t)
    _gather(shm, dst, np.array([a for a, _ in parts] + [n], np.int64))
    if rec:
        t = timeline.phase("comm", "copy parts (single copy)", t, {"bytes": (n - hi + lo) * src.itemsize})
    board.barrier(shm.timeout, "allreduce")  # nobody reads my destination any more
    if rec:
        timeline.phase("comm", "wait for peers", t)

def allreduce_nodes(shm, src: np.ndarray, dst: np.ndarray, op: int, bulk=None, across=None) -> None:
    """:func:`allreduce` across nodes (NOTE [single-copy allreduce] 7): ``src`` and ``dst`` as
    there, posted and agreed; each part crosses the nodes over ``bulk`` (a transport as
    ``segment.Crossing`` takes it) while the next is reduced, or, without it, inline by
    ``across(buf, op, kind, what)`` (in place, summing for avg)."""
    board, p, me = shm.board, shm.local_size, shm.local_rank
    n = src.shape[0]
    step = max(NODES_CHUNK_BYTES // src.itemsize, p)
    rec = timeline.enabled()

    def gather(c0: int, parts: list[tuple[int, int]]):
        def then() -> None:
            t = timeline.now() if rec else 0
            board.barrier(shm.timeout, "allreduce")  # every part of this chunk is final
            if rec:
                t = timeline.phase("comm", "wait for peers", t)
            _gather(shm, dst, np.array([c0 + a for a, _ in parts] + [c0 + parts[-1][1]], np.int64))
            if rec:
                others = parts[-1][1] - (parts[me][1] - parts[me][0])
                timeline.phase("comm", "copy parts (single copy)", t, {"bytes": others * src.itemsize})
        return then

    def chunks():
        for c0 in range(0, n, step):
            parts = segments(min(step, n - c0), p)
            lo, hi = parts[me]
            t = timeline.now() if rec else 0
            _reduce_from_peers(shm, dst, 0, src, c0 + lo, c0 + hi, op, "allreduce", final=False)
            if rec:
                timeline.phase("comm", "reduce (single copy)", t, {"bytes": (hi - lo) * src.itemsize})
            yield dst[c0 + lo:c0 + hi], gather(c0, parts)

    with crossing(bulk, across, op, 0, shm.size) as parts:
        for part, then in chunks():
            parts.hand_over(part, then)
        parts.drain()
    board.barrier(shm.timeout, "allreduce")  # nobody reads my destination any more


def _read_from(shm, q: int, dst: np.ndarray, remote: int, what: str) -> None:
    """``dst`` (1-D, C-contiguous) = the bytes at ``remote`` of local rank ``q``."""
    peers = shm.peers
    if not cma.read(int(peers.pids[q]), dst.ctypes.data, remote, dst.nbytes, peers.iov):
        raise peers.failed(q, what, remote)

def allgather(shm, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
    """``out[r]`` = rank r's ``flat`` for every rank (on ``root`` only when >= 0), read from
    each peer's memory (NOTE [single-copy allreduce] 6); posted and agreed. One node."""
    coll = "gather" if root >= 0 else "allgather"
    if root < 0 or root == shm.rank:
        ranks, addrs = shm.board.ranks, shm.board.addrs
        for q in range(shm.local_size):
            row = out[ranks[q]]
            if q == shm.local_rank:
                row[...] = flat
            elif row.flags.c_contiguous:
                _read_from(shm, q, row, int(addrs[q, 0]), coll)
            else:
                tmp = np.empty_like(flat)
                _read_from(shm, q, tmp, int(addrs[q, 0]), coll)
                row[...] = tmp
    shm.board.barrier(shm.timeout, coll)  # every source is read

def reduce_scatter(shm, flat: np.ndarray, out: np.ndarray, op: int) -> None:
    """``out`` = this rank's part (``segments(n, size)``) of op over every rank's ``flat``
    (native dtypes), read from the peers' memory (NOTE [single-copy allreduce] 6); posted
    and agreed. One node."""
    lo, hi = segments(flat.shape[0], shm.size)[shm.rank]
    dst = out if out.flags.c_contiguous else np.empty(hi - lo, flat.dtype)
    _reduce_from_peers(shm, dst, lo, flat, lo, hi, op, "reduce_scatter")
    if dst is not out:
        out[...] = dst
    shm.board.barrier(shm.timeout, "reduce_scatter")  # every source is read
