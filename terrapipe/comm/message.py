"""A message as the algorithms see it: the caller's flat arrays fused into one (:class:`Fused`),
the gate of device-staged messages (``NO_GATE`` for host ones), and the division that finishes
an ``avg``.

NOTE [staging gate]
    An allreduce takes a gate for sources and destinations that are host copies of device
    memory (comm/staging.py, NOTE [staging streams]). Every algorithm calls ``gate.ready(upto)``
    before reading a source element below fused index ``upto`` and ``gate.wrote(upto)`` once
    every result below ``upto`` is final; the chunked segment (comm/algorithms/segment.py) does
    both per chunk, so downloads, reduction and uploads overlap. The gate owns those host arrays:
    nothing else writes them during the call.

    A gate also speaks a second protocol, for staged_rows (NOTE [staged rows] in
    comm/algorithms/staged_rows.py), whose device copies skip those arrays: ``pin(address,
    nbytes)`` registers the segment's mapping, ``copy_in(c0, length, dst)`` queues the
    download of fused elements ``[c0, c0 + length)`` into a row, ``wait_in()`` waits for the
    oldest one queued, ``copy_out(c0, src)`` queues the upload of final results from a row,
    and ``settle()`` waits until every upload has read its row. An algorithm speaks one of the
    two per call.
"""

from __future__ import annotations

import bisect

import numpy as np

from ..kernels import compress, decompress
from ..kernels import reduce as kreduce

__all__ = ["Fused", "divide", "reduce_flat", "segments", "spans", "NO_GATE"]


def segments(n: int, p: int) -> list[tuple[int, int]]:
    """[start, end) of each of p owners' segments of n elements (np.array_split's boundaries:
    sizes differ by at most one, the first ones larger): the part of a message each rank owns in
    a reduce-scatter, and in every algorithm that reduces by parts."""
    q, r = divmod(n, p)
    bounds = [i * q + min(i, r) for i in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def spans(offsets: list[int], c0: int, length: int):
    """(part, start, end, offset in the range) of elements ``[c0, c0 + length)`` of a message
    made of parts laid end to end, part i being ``[offsets[i], offsets[i + 1])``: each part's
    overlap with the range, in the part's own elements. Empty parts are skipped."""
    i = bisect.bisect_right(offsets, c0) - 1
    end = c0 + length
    while i < len(offsets) - 1 and offsets[i] < end:
        a, b = max(c0, offsets[i]) - offsets[i], min(end, offsets[i + 1]) - offsets[i]
        if b > a:
            yield i, a, b, offsets[i] + a - c0
        i += 1


class _NoGate:
    """The gate of host-only calls (NOTE [staging gate]): nothing to wait for."""

    @staticmethod
    def ready(upto: int) -> None:
        pass

    @staticmethod
    def wrote(upto: int) -> None:
        pass


NO_GATE = _NoGate()


class Fused:
    """Several flat arrays seen as one: ``read``/``write`` copy a range of the concatenation,
    compressing float32 to 16 bits (``ckind``) on the way in and back on the way out."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self.views = views
        self.offsets = [0]
        for v in views:
            self.offsets.append(self.offsets[-1] + v.shape[0])
        self.n = self.offsets[-1]

    def _pieces(self, c0: int, length: int):
        if len(self.views) == 1:
            yield self.views[0], c0, c0 + length, 0
            return
        for i, a, b, o in spans(self.offsets, c0, length):
            yield self.views[i], a, b, o

    def read(self, c0: int, length: int, out: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            out[:length] = self.views[0][c0:c0 + length]
            return
        for v, a, b, o in self._pieces(c0, length):
            if ckind:
                compress(v[a:b], out[o:o + b - a], ckind)
            else:
                out[o:o + b - a] = v[a:b]

    def write(self, c0: int, src: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            self.views[0][c0:c0 + src.shape[0]] = src
            return
        for v, a, b, o in self._pieces(c0, src.shape[0]):
            if ckind:
                decompress(src[o:o + b - a], v[a:b], ckind)
            else:
                v[a:b] = src[o:o + b - a]

    def only(self) -> np.ndarray | None:
        """The single array when there is one, else None."""
        return self.views[0] if len(self.views) == 1 else None


def divide(arr: np.ndarray, n: int, kind: int) -> None:
    """``arr /= n`` in place: ``avg`` is a sum divided once, at the end (floor for integers)."""
    if kind:
        kreduce.divide_16(arr, n, 0, arr.shape[0], kind)
    elif arr.dtype.kind == "f":
        kreduce.divide_float(arr, n, 0, arr.shape[0])
    else:
        kreduce.divide_int(arr, n, 0, arr.shape[0])


def reduce_flat(srcs: Fused, dsts: Fused, dtype, ckind: int, mine: bool, reduce) -> None:
    """Call ``reduce(buf)``, which reduces ``buf`` in place (1-D, C-contiguous, ``dtype``), on
    ``srcs``' values and leave the result in ``dsts`` when ``mine`` (a reduce's non-root ranks
    pass False). ``buf`` is ``dsts``' own array when that is one C-contiguous array of ``dtype``
    this rank may overwrite and nothing is compressed (nothing copied out; nothing copied in
    either when the call is in place), else a fresh array."""
    out = dsts.only()
    direct = (out is not None and not ckind and out.dtype == np.dtype(dtype) and out.flags.c_contiguous
              and mine)
    if direct:
        buf = out
        src = srcs.only()
        if src is None or src.ctypes.data != out.ctypes.data:
            srcs.read(0, srcs.n, buf)
    else:
        buf = np.empty(srcs.n, dtype)
        srcs.read(0, srcs.n, buf, ckind)
    reduce(buf)
    if not direct and mine:
        dsts.write(0, buf, ckind)
