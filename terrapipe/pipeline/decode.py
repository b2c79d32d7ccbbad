"""Decoding encoded images with Pillow, for the loader's threads: every format, and the JPEGs
that the libjpeg-turbo region decoder (:mod:`.roi_jpeg`) declines or is turned off for. The DCT
scale rule (:func:`draft_scale`) is shared by both.

Two things make this cheaper than ``np.asarray(Image.open(f).convert("RGB"))``:

* ``draft``: the crop box is known before decoding, so libjpeg is asked for the smallest DCT
  scale (1/2, 1/4, 1/8) at which the box still covers the output size.
* zero-copy pixels: Pillow >= 11.2 exports an image through the Arrow C Data Interface (a stable
  C ABI). With Pillow's single-block allocator, that export is the decoded RGBX buffer itself,
  so the resize kernel reads it in place instead of ``tobytes`` packing a copy while holding the
  GIL. Older Pillow falls back to ``np.asarray``.
"""

from __future__ import annotations

import ctypes
import io
import math

import numpy as np
from numba import njit
from PIL import Image, UnidentifiedImageError

__all__ = ["open_image", "draft_scale", "draft_denominator", "scale_box", "scaled_box", "draft_box", "pixels"]


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.POINTER(_ArrowArray)),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _enable_zero_copy() -> bool:
    core = Image.core
    if not hasattr(Image.Image, "__arrow_c_array__") or not hasattr(core, "set_use_block_allocator"):
        return False
    # One malloc per image instead of Pillow's arena of shared blocks: what makes the Arrow
    # export zero-copy. Process-wide, and harmless for other Pillow users.
    core.set_use_block_allocator(1)
    return True


_ZERO_COPY = _enable_zero_copy()


def open_image(payload: bytes) -> Image.Image:
    """Parse the header only; pixels are decoded by :func:`pixels`. ``payload`` is any
    bytes-like object (borrowed while the image lives). An empty payload, or one that is no
    format Pillow reads, raises an error saying which (its length and first bytes: Pillow's own
    message names only the in-memory stream it was given)."""
    size = memoryview(payload).nbytes
    if size == 0:
        raise ValueError("the file is empty (0 bytes)")
    try:
        im = Image.open(io.BytesIO(payload))
    except UnidentifiedImageError:
        head = bytes(memoryview(payload).cast("B")[:8])
        raise UnidentifiedImageError(
            f"not an image format Pillow reads ({size} bytes, starting {head!r})") from None
    # One decoder call for the whole payload instead of one per 64 KiB block: each call releases
    # and retakes the GIL, and with many loader threads every retake can wait behind the others
    # (and behind the training thread).
    im.decodermaxblock = max(len(payload), im.decodermaxblock)
    return im


def draft_scale(w: int, h: int, box: tuple[float, float, float, float], out_hw: tuple[int, int]) -> int:
    """The DCT scale denominator (1, 2, 4 or 8) for a ``w x h`` JPEG: the largest at which
    ``box`` still covers ``out_hw`` (the choice Pillow's ``draft`` makes when asked for that
    size). The scaled image is ``ceil(w / denom) x ceil(h / denom)``."""
    return draft_denominator(int(w), int(h), float(box[2] - box[0]), float(box[3] - box[1]),
                             int(out_hw[0]), int(out_hw[1]))


@njit(cache=True)
def draft_denominator(w, h, bw, bh, oh, ow):
    """:func:`draft_scale` for a box ``bw x bh`` (floats) and output ``oh x ow``, compiled:
    the one rule, for Python callers and for the batch fill (pipeline/compiled_fill.py)."""
    need_w, need_h = math.ceil(w * ow / bw), math.ceil(h * oh / bh)
    if need_w >= w or need_h >= h:
        return 1
    scale = min(w // need_w, h // need_h)
    for denom in (8, 4, 2):
        if scale >= denom:
            return denom
    return 1


def scale_box(box: tuple[float, float, float, float], w: int, h: int, sw: int,
              sh: int) -> tuple[float, float, float, float]:
    """``box`` in a ``w x h`` image, mapped onto the same image scaled to ``sw x sh``."""
    return scaled_box(float(box[0]), float(box[1]), float(box[2]), float(box[3]), int(w), int(h),
                      int(sw), int(sh))


@njit(cache=True)
def scaled_box(x0, y0, x1, y1, w, h, sw, sh):
    """:func:`scale_box` of the box ``(x0, y0, x1, y1)`` (floats), compiled."""
    sx, sy = sw / w, sh / h
    return x0 * sx, y0 * sy, min(x1 * sx, float(sw)), min(y1 * sy, float(sh))


def draft_box(im: Image.Image, box: tuple[float, float, float, float],
              out_hw: tuple[int, int]) -> tuple[float, float, float, float]:
    """Ask a JPEG decoder for the smallest scale whose box still covers ``out_hw``
    (:func:`draft_scale`); return the box in the coordinates of the (possibly) reduced image.
    Other formats are left as they are."""
    if im.format != "JPEG":
        return box
    w, h = im.size
    denom = draft_scale(w, h, box, out_hw)
    if denom == 1:
        return box
    # Asking for (w // denom, h // denom) makes Pillow pick exactly ``denom``.
    im.draft("RGB", (w // denom, h // denom))
    return scale_box(box, w, h, *im.size)


def pixels(im: Image.Image) -> tuple[np.ndarray, object]:
    """Decode and return ``(array, keepalive)``: uint8 (H, W, 3) or (H, W, 4) RGBX with the
    padding byte last. The array may point into Pillow's memory: keep ``keepalive`` referenced
    until the array is no longer read."""
    if im.mode not in ("RGB", "RGBA", "RGBX"):
        im = im.convert("RGB")
    im.load()
    if _ZERO_COPY and im.mode in ("RGB", "RGBX") and im.im.isblock():
        _, array_capsule = im.__arrow_c_array__()
        arr = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
        if arr.n_children == 1:  # RGB(X) is exported as FixedSizeList<uint8>[4] per pixel
            child = arr.children[0].contents
            w, h = im.size
            if child.length == w * h * 4 and child.offset == 0:
                raw = (ctypes.c_uint8 * (h * w * 4)).from_address(child.buffers[1])
                return np.frombuffer(raw, np.uint8).reshape(h, w, 4), (array_capsule, im)
    if im.mode == "RGBA":
        im = im.convert("RGB")
    return np.asarray(im), im
