"""Huge pages for private buffers that collectives reduce again and again (DDP's buckets, a
model's gradient tensors, the staging copy of fused messages).

NOTE [huge pages for reused buffers]
    1. Why: the single-copy collectives (NOTE [single-copy allreduce] in
       comm/algorithms/single_copy.py) have the kernel
       pin the peer's pages for every read, page by page. PyTorch's CPU allocator hands out 4 KiB
       pages (unless ``THP_MEM_ALLOC_ENABLE=1`` was set before torch started), and on its memory
       those reads take 1.3-1.5x as long: interleaved at 2 ranks, ``comm.allreduce`` of a
       ``torch.ones`` tensor took 5.03 ms at 25 MiB and 13.7 at 64 MiB on 4 KiB pages, 3.84 and
       9.3 once the same memory was backed by 2 MiB pages. NumPy's large arrays get 2 MiB pages
       already.
    2. What: the second time a collective sees the same private buffer (address and length),
       its 2 MiB-aligned interior is advised ``MADV_HUGEPAGE`` (later faults there take huge
       pages) and ``MADV_COLLAPSE`` (Linux 6.1+: the kernel moves the present pages into huge
       ones now; a one-off cost about that of one reduction of it). The bytes do not change,
       nor does who owns the memory; a failed advice (an older kernel, THP ``never``, no free
       huge pages) is ignored. A buffer seen once (a temporary) is left alone; the record of
       sightings is bounded.
    3. ``TERRAPIPE_HUGEPAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import sys

from ... import settings

__all__ = ["Advisor", "HUGE"]

HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_SEEN_MAX = 512  # sightings remembered (addresses of buffers not yet advised)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def advise(addr: int, nbytes: int) -> bool:
    """Ask for huge pages under the 2 MiB-aligned interior of ``[addr, addr + nbytes)`` (NOTE
    [huge pages for reused buffers] 2); True when the kernel took the collapse."""
    lo = -(-addr // HUGE) * HUGE
    hi = (addr + nbytes) // HUGE * HUGE
    if hi <= lo:
        return False
    _libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)
    return _libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0


class Advisor:
    """Which buffers a group's collectives reuse, and advising them once (one per transport;
    used by one collective at a time)."""

    def __init__(self) -> None:
        self.enabled = settings.get("TERRAPIPE_HUGEPAGES") and sys.platform.startswith("linux")
        self._seen: set[tuple[int, int]] = set()
        self._advised: set[tuple[int, int]] = set()

    def saw(self, addr: int, nbytes: int) -> None:
        """A collective is about to read or write ``nbytes`` at ``addr`` of private memory."""
        if not self.enabled or nbytes < 2 * HUGE:
            return
        key = (addr, nbytes)
        if key in self._advised:
            return
        if key not in self._seen:
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen.add(key)
            return
        self._seen.discard(key)
        if len(self._advised) >= _SEEN_MAX:
            self._advised.clear()
        self._advised.add(key)
        advise(addr, nbytes)
