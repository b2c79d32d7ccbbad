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
"""

from __future__ import annotations

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import segments
from ..transports import cma

__all__ = ["allreduce", "allgather", "reduce_scatter", "MIN_BYTES", "REDUCE_SCATTER_MIN_BYTES"]

# The smallest allreduce (bytes) that goes single-copy; smaller ones take the one-shot
# (NOTE [algorithm selection] 7 in comm/select.py).
MIN_BYTES = 2 << 20
# A reduce-scatter reads only its own part of every peer's message: it gains from half the size
# (NOTE [single-copy allreduce] 6).
REDUCE_SCATTER_MIN_BYTES = 1 << 20


def _reduce_from_peers(shm, dst: np.ndarray, shift: int, src: np.ndarray, lo: int, hi: int,
                       op: int, coll: str) -> None:
    """Phase one (NOTE [single-copy allreduce] 2): ``dst[lo - shift:hi - shift]`` = op over
    every local rank's posted source ``[lo, hi)`` (``src`` is mine), divided for avg."""
    peers, addrs = shm.peers, shm.board.addrs
    failed = cma.reduce_part(dst, shift, src, peers.pids, np.ascontiguousarray(addrs[:, 0]),
                             shm.local_rank, op, lo, hi, shm.size if op == kreduce.AVG else 1,
                             src.dtype.kind in "iu", peers.tile(src.dtype), peers.iov)
    if failed >= 0:
        raise peers.failed(failed, coll, int(addrs[failed, 0]))

def allreduce(shm, src: np.ndarray, dst: np.ndarray, op: int) -> None:
    """Allreduce ``src`` (1-D, native dtype, this rank's private memory) into ``dst`` (same
    shape and dtype; may be ``src``) by reading the peers' memory (NOTE [single-copy
    allreduce]); ``shm.post_single_copy`` and the agreement have run. One node."""
    board, peers = shm.board, shm.peers
    me = shm.local_rank
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
    bounds = np.array([a for a, _ in parts] + [n], np.int64)
    failed = cma.gather_parts(dst, peers.pids, np.ascontiguousarray(board.addrs[:, 1]), bounds, me,
                              peers.iov)
    if failed >= 0:
        raise peers.failed(failed, "allreduce", int(board.addrs[failed, 1]))
    if rec:
        t = timeline.phase("comm", "copy parts (single copy)", t, {"bytes": (n - hi + lo) * src.itemsize})
    board.barrier(shm.timeout, "allreduce")  # nobody reads my destination any more
    if rec:
        timeline.phase("comm", "wait for peers", t)

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
