"""Region-of-interest JPEG decoding on libjpeg-turbo (the C shim in ``_jpeg.c``), without the GIL.

The loader knows the crop box before decoding, so a loader thread asks libjpeg for the smallest
DCT scale that still covers the output size (Pillow's ``draft`` rule), then for only the rows and
iMCU columns that the resampling filter reads: rows below the box are never decoded, and rows
above and columns beside it skip the inverse DCT, upsampling and colour conversion. Every call
drops the GIL (ctypes), and the header is parsed in C, not by Pillow in Python.

Pixels are those of a full decode by the same library, so a crop resampled from the region with
:func:`terrapipe.kernels.image.resize_crop_bilinear_region` is bit-identical to one resampled from
the whole (drafted) image. What the shim does not handle (not a JPEG, CMYK, corrupt or truncated
data, any libjpeg warning) makes :meth:`RoiDecoder.header` / :meth:`RoiDecoder.decode` return
None, and the caller decodes that sample with Pillow, so errors and their messages stay Pillow's.

The shim is built with the package (``setup.py``, optional); :func:`available` says whether it
loaded, and :func:`enabled` whether a loader constructed now uses it: ``TERRAPIPE_JPEG=pillow``
in the environment turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import math
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
from numba import njit

from .. import settings
from .decode import draft_denominator, scaled_box

__all__ = ["available", "enabled", "register_symbols", "region_of", "RoiDecoder"]

# Margin in pixels around the filter's support: at an interior edge of a cropped region,
# libjpeg's chroma upsampling lacks its neighbour, so the outermost decoded pixel may differ
# from a full decode; it must never be read.
_MARGIN = 2
# A thread keeps its pixel buffer for the next image up to this size; a larger region (a rare
# huge image) gets a buffer of its own, so one outlier does not pin its size in every thread.
_KEEP_BYTES = 32 << 20


def _load() -> ctypes.CDLL | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_jpeg{suffix}"
        if path.exists():
            break
    else:
        return None
    try:
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: every call releases the GIL
    except OSError:
        return None
    c_int_p = ctypes.POINTER(ctypes.c_int)
    lib.tp_jpeg_new.restype = ctypes.c_void_p
    lib.tp_jpeg_new.argtypes = []
    lib.tp_jpeg_free.restype = None
    lib.tp_jpeg_free.argtypes = [ctypes.c_void_p]
    lib.tp_jpeg_message.restype = ctypes.c_char_p
    lib.tp_jpeg_message.argtypes = [ctypes.c_void_p]
    lib.tp_jpeg_header.restype = ctypes.c_int
    lib.tp_jpeg_header.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong, c_int_p, c_int_p]
    lib.tp_jpeg_decode.restype = ctypes.c_int
    lib.tp_jpeg_decode.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [
        ctypes.c_void_p, ctypes.c_ulong, c_int_p, c_int_p]
    return lib


_LIB = _load()


_registered = False


def register_symbols() -> bool:
    """Put the shim's entry points in the process's symbol table, by name, so compiled code
    (pipeline/compiled_fill.py, cached on disk by Numba) calls them as it calls libc. Idempotent;
    False where the shim is not available."""
    global _registered
    if _LIB is None:
        return False
    if not _registered:
        for name in ("tp_jpeg_header", "tp_jpeg_decode"):
            llvm.add_symbol(name, ctypes.cast(getattr(_LIB, name), ctypes.c_void_p).value)
        _registered = True
    return True


def available() -> bool:
    """Whether the libjpeg-turbo shim is built and loads."""
    return _LIB is not None


def enabled() -> bool:
    """Whether JPEGs are decoded by the shim: available and not ``TERRAPIPE_JPEG=pillow``."""
    return _LIB is not None and settings.get("TERRAPIPE_JPEG") != "pillow"


@njit(cache=True)
def region_of(w, h, bx0, by0, bx1, by1, oh, ow):
    """What decoding the box ``(bx0, by0, bx1, by1)`` of a ``w x h`` JPEG for an ``oh x ow``
    output asks of libjpeg: ``(denom, sw, sh, box..., x0, y0, x1, y1)``: the DCT scale (the
    draft rule), the scaled image's size, the box in it, and the rows and columns the
    resampling filter reads there with the margin (_MARGIN) around them. One rule for
    :meth:`RoiDecoder.decode` and for the batch fill (pipeline/compiled_fill.py)."""
    denom = draft_denominator(w, h, bx1 - bx0, by1 - by0, oh, ow)
    sw, sh = -(-w // denom), -(-h // denom)
    if denom > 1:
        bx0, by0, bx1, by1 = scaled_box(bx0, by0, bx1, by1, w, h, sw, sh)
    sup_x = max((bx1 - bx0) / ow, 1.0)
    sup_y = max((by1 - by0) / oh, 1.0)
    x0 = max(0, math.floor(bx0 - sup_x) - _MARGIN)
    x1 = min(sw, math.ceil(bx1 + sup_x) + _MARGIN)
    y0 = max(0, math.floor(by0 - sup_y) - _MARGIN)
    y1 = min(sh, math.ceil(by1 + sup_y) + _MARGIN)
    return denom, sw, sh, bx0, by0, bx1, by1, x0, y0, x1, y1


class RoiDecoder:
    """One thread's decoder: a libjpeg handle and a pixel buffer, reused image after image. Not
    thread-safe; the array :meth:`decode` returns may be overwritten by the next call."""

    def __init__(self) -> None:
        if _LIB is None:
            raise RuntimeError("the libjpeg-turbo shim is not available (see roi_jpeg.available)")
        self._lib = _LIB
        self._handle = _LIB.tp_jpeg_new()
        if not self._handle:
            raise MemoryError("tp_jpeg_new failed")
        self._buf = np.empty(0, np.uint8)
        self._w, self._h = ctypes.c_int(), ctypes.c_int()
        self._x0, self._rw = ctypes.c_int(), ctypes.c_int()
        self._payload: bytes | None = None

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.tp_jpeg_free(handle)

    @property
    def handle(self) -> int:
        """The libjpeg handle's address, for compiled callers on this decoder's thread."""
        return self._handle

    @property
    def pixel_buffer(self) -> np.ndarray:
        """The uint8 buffer :meth:`decode` writes regions into (grown as regions need, up to
        _KEEP_BYTES), for compiled callers on this decoder's thread."""
        return self._buf

    def reserve(self, nbytes: int) -> None:
        """Grow :attr:`pixel_buffer` to at least ``nbytes`` (at most _KEEP_BYTES)."""
        nbytes = min(int(nbytes), _KEEP_BYTES)
        if self._buf.size < nbytes:
            self._buf = np.empty(nbytes, np.uint8)

    def header(self, payload: bytes | bytearray | memoryview) -> tuple[int, int] | None:
        """(width, height) of a JPEG libjpeg can decode to RGB, else None (use Pillow)."""
        if not isinstance(payload, bytes):
            payload = bytes(payload)  # a source may hand out any bytes-like object
        self._payload = payload  # libjpeg reads it in place until decode returns
        rc = self._lib.tp_jpeg_header(self._handle, payload, len(payload), ctypes.byref(self._w),
                                      ctypes.byref(self._h))
        if rc != 0:
            self._payload = None
            return None
        return self._w.value, self._h.value

    def decode(self, box: tuple[float, float, float, float], out_hw: tuple[int, int]):
        """Decode what resampling ``box`` (full-image pixels) to ``out_hw`` reads, after
        :meth:`header`. Returns ``(pixels, ox, oy, img_w, img_h, box)``: uint8 (H, W, 4) RGBX
        holding pixels [ox, ox + W) x [oy, oy + H) of the image scaled to ``img_w x img_h``,
        and the box in that scaled image's coordinates; or None (use Pillow)."""
        if self._payload is None:
            raise RuntimeError("RoiDecoder.decode without a successful header()")
        w, h = self._w.value, self._h.value
        denom, sw, sh, bx0, by0, bx1, by1, x0, y0, x1, y1 = region_of(
            w, h, float(box[0]), float(box[1]), float(box[2]), float(box[3]), int(out_hw[0]),
            int(out_hw[1]))
        box = (bx0, by0, bx1, by1)
        need = sw * 4 * (y1 - y0)  # libjpeg widens columns to whole iMCUs, never past the width
        buf = self._buf
        if buf.size < need:
            # Half again past the region at hand (within _KEEP_BYTES): a run of regions a little
            # larger each does not reallocate every time.
            buf = np.empty(max(need, min(buf.size * 3 // 2, _KEEP_BYTES)), np.uint8)
            if need <= _KEEP_BYTES:
                self._buf = buf
        rc = self._lib.tp_jpeg_decode(self._handle, denom, x0, y0, x1, y1, buf.ctypes.data, buf.size,
                                      ctypes.byref(self._x0), ctypes.byref(self._rw))
        self._payload = None
        if rc != 0:
            return None
        rw = self._rw.value
        pixels = buf[:rw * 4 * (y1 - y0)].reshape(y1 - y0, rw, 4)
        return pixels, self._x0.value, y0, sw, sh, box

    def message(self) -> str:
        """libjpeg's message for the last failure, if any."""
        return self._lib.tp_jpeg_message(self._handle).decode(errors="replace")
