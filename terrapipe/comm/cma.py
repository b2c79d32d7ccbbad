"""Single-copy transfers between the ranks of a node: Linux cross-memory attach
(``process_vm_readv``) copies a peer's private memory straight into ours, with no shared segment
in between, as MPICH and Open MPI do for large messages on a node.

NOTE [single-copy allreduce]
    1. What it is for: allreduces of private memory too large for the one-shot (DDP's buckets,
       torch tensors, NumPy arrays: memory terrapipe did not allocate, so the in-place path over
       a shared array (NOTE [shared arrays] in shm.py) cannot reach it). Through the segment such
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
       user, no Yama restriction, no seccomp filter against it). ``ShmTransport`` tries it on
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

import ctypes
import os
import sys

import numpy as np
from numba import njit, types

from .. import settings
from ..kernels import reduce as kreduce
from .errors import CommError

__all__ = ["Peers", "read", "reduce_part", "gather_parts", "read_value", "read_error", "TILE_BYTES",
           "MIN_BYTES", "REDUCE_SCATTER_MIN_BYTES", "enabled"]

# Bytes per phase-one read: the tile and the part of the destination it folds into stay in L2
# while every peer's tile is folded (1 MiB L2 per core here). Interleaved at 2 ranks, float32
# sum: 4 MiB took 1.21 ms with 64 KiB tiles (a syscall each), 0.90 with 256 KiB, 0.95 with
# 1 MiB; at 25 MiB all three within 3% (4.48, 4.40, 4.34 ms).
TILE_BYTES = 256 << 10

# The smallest allreduce (bytes) that goes single-copy; smaller ones take the one-shot
# (NOTE [transport selection] 7 in group.py).
MIN_BYTES = 2 << 20
# A reduce-scatter reads only its own part of every peer's message: it gains from half the size
# (NOTE [single-copy allreduce] 6).
REDUCE_SCATTER_MIN_BYTES = 1 << 20

# By symbol, resolved in the process (libc), so the compiled kernels can be cached on disk.
_readv = types.ExternalFunction(
    "process_vm_readv",
    types.intp(types.intc, types.uintp, types.uintp, types.uintp, types.uintp, types.uintp))


def enabled() -> bool:
    """Whether single-copy transfers may be tried at all (Linux; ``TERRAPIPE_CMA`` not 0)."""
    return settings.get("TERRAPIPE_CMA") and sys.platform.startswith("linux")


@njit(nogil=True, cache=True)
def read(pid, local, remote, nbytes, iov):
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to address ``local``; False on
    failure (the caller asks again through ctypes for the errno). ``iov``: uint64 scratch of 4."""
    done = 0
    while done < nbytes:
        iov[0] = local + done
        iov[1] = nbytes - done
        iov[2] = remote + done
        iov[3] = nbytes - done
        got = _readv(pid, iov.ctypes.data, 1, iov.ctypes.data + 16, 1, 0)
        if got <= 0:
            return False
        done += got
    return True


@njit(nogil=True, cache=True)
def reduce_part(dst, shift, src, pids, srcs, me, op, lo, hi, divisor, integer, tile, iov):
    """Phase one (NOTE [single-copy allreduce] 2): ``dst[lo - shift:hi - shift] = op(src[lo:hi],
    peers' sources[lo:hi])``, divided by ``divisor`` (1: none; ``integer``: floor division, as
    for integer dtypes, else true division), for native dtypes. ``shift``: 0 for an allreduce
    (dst as long as src), ``lo`` for a reduce-scatter (dst holds only this part).

    dst, src: 1-D, same dtype, this rank's (may be the same array, with ``shift`` 0). pids:
    int64 ``(p,)``, each local rank's pid. srcs: uint64 ``(p,)``, the address of element 0 of
    each rank's source. tile: 1-D scratch of ``dst``'s dtype (each read's size). iov: uint64
    scratch of 4.
    Returns -1, or the local rank whose memory could not be read."""
    if hi <= lo:
        return -1
    item = dst.itemsize
    step = tile.shape[0]
    same = shift == 0 and dst.ctypes.data == src.ctypes.data
    for t0 in range(lo, hi, step):
        t1 = min(t0 + step, hi)
        n = t1 - t0
        d = dst[t0 - shift:t1 - shift]
        if not same:
            s = src[t0:t1]
            for i in range(n):
                d[i] = s[i]
        for q in range(pids.shape[0]):
            if q == me:
                continue
            if not read(pids[q], tile.ctypes.data, srcs[q] + t0 * item, n * item, iov):
                return q
            # While the tile and this part of dst sit in L2: the other paths' own fold.
            kreduce.reduce_native(d, tile, op, 0, n)
        if divisor != 1:
            if integer:
                kreduce.divide_int(d, divisor, 0, n)
            else:
                kreduce.divide_float(d, divisor, 0, n)
    return -1


@njit(nogil=True, cache=True)
def gather_parts(dst, pids, dsts, bounds, me, iov):
    """Phase two (NOTE [single-copy allreduce] 2): ``dst[bounds[q]:bounds[q+1]]`` = local rank
    ``q``'s, read from its destination, for every ``q != me``. dst: 1-D, this rank's. dsts:
    uint64 ``(p,)``, the address of element 0 of each rank's destination. bounds: int64
    ``(p + 1,)``. Returns -1, or the local rank whose memory could not be read."""
    item = dst.itemsize
    base = dst.ctypes.data
    for q in range(pids.shape[0]):
        lo, hi = bounds[q], bounds[q + 1]
        if q == me or hi <= lo:
            continue
        if not read(pids[q], base + lo * item, dsts[q] + lo * item, (hi - lo) * item, iov):
            return q
    return -1


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                   ctypes.c_ulong, ctypes.c_ulong]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _read8(pid: int, remote: int) -> tuple[int | None, int]:
    """(the int64 at ``remote`` of process ``pid`` or None, errno)."""
    value = ctypes.c_int64(0)
    local, far = _Iovec(ctypes.addressof(value), 8), _Iovec(remote, 8)
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
    return (value.value, 0) if got == 8 else (None, ctypes.get_errno() or -1)


def read_value(pid: int, remote: int) -> int | None:
    """The int64 at address ``remote`` of process ``pid``, or None where it cannot be read."""
    return _read8(pid, remote)[0]


def read_error(pid: int, remote: int) -> int:
    """errno of reading 8 bytes at ``remote`` of process ``pid`` (0: it worked)."""
    return _read8(pid, remote)[1]


class Peers:
    """What a rank needs to read its node peers' memory: their pids and its scratch.

    pids: int64 ``(p,)`` of the node's ranks (local order); ranks: their group ranks, for
    messages. Owned by one ShmTransport, used by one collective at a time."""

    def __init__(self, pids: np.ndarray, ranks: list[int]) -> None:
        self.pids = np.ascontiguousarray(pids, np.int64)
        self.ranks = ranks
        self.iov = np.zeros(4, np.uint64)
        self._tiles: dict[np.dtype, np.ndarray] = {}

    def tile(self, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        t = self._tiles.get(dtype)
        if t is None:
            t = self._tiles[dtype] = np.empty(TILE_BYTES // dtype.itemsize, dtype)
        return t

    def failed(self, q: int, what: str, remote: int) -> CommError:
        """The error for a read of local rank ``q``'s memory at ``remote`` that failed."""
        pid = int(self.pids[q])
        err = read_error(pid, remote)
        why = "died" if err == 3 else f"could not be read ({os.strerror(err) if err > 0 else 'short read'})"
        return CommError(f"{what}: rank {self.ranks[q]} (pid {pid}) {why}")
