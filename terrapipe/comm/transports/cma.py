"""Single-copy transfers between the ranks of a node: Linux cross-memory attach
(``process_vm_readv``) copies a peer's private memory straight into ours, with no shared segment
in between, as MPICH and Open MPI do for large messages on a node.

The algorithms over it: NOTE [single-copy allreduce] in comm/algorithms/single_copy.py.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
from numba import njit, types

from ... import settings
from ...kernels import reduce as kreduce
from ..errors import CommError

__all__ = ["Peers", "read", "reduce_part", "gather_parts", "read_value", "read_error", "TILE_BYTES",
           "enabled"]

# Bytes per phase-one read: the tile and the part of the destination it folds into stay in L2
# while every peer's tile is folded (1 MiB L2 per core here). Interleaved at 2 ranks, float32
# sum: 4 MiB took 1.21 ms with 64 KiB tiles (a syscall each), 0.90 with 256 KiB, 0.95 with
# 1 MiB; at 25 MiB all three within 3% (4.48, 4.40, 4.34 ms).
TILE_BYTES = 256 << 10

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
