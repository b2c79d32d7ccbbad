"""Image kernels over uint8 HWC arrays: crop + bilinear resize, flip, normalize + layout change.

All arrays may be arbitrary strided views, which is how the loader fuses steps for free:

* a crop is a *box* argument to :func:`resize_crop_bilinear` (the source is read in place);
* a horizontal flip is writing through ``out[:, ::-1]``;
* HWC -> CHW is writing through ``chw.transpose(1, 2, 0)``, or :func:`normalize_lut` /
  :func:`hwc_to_chw` for the conversions that change dtype.

Resampling uses Pillow's ``Image.resize(size, BILINEAR, box=...)`` filter: a separable triangle
filter whose support widens by the scale factor when downscaling (antialiasing), with Pillow's
22-bit fixed-point weights. The passes run in the other order than Pillow's, R output rows at a
time: vertical first, over whole interleaved source rows of the crop, into a 16-bit intermediate
with 8 fractional bits; then horizontal on only the output rows, where each tap multiplies the R
rows of one channel of one pixel as one vector (14-bit weights, so the int32 sum is exact).
Rounding happens once, at the end, so results stay within one level of Pillow's (which rounds
twice) and of pillow-simd's. The passes are LLVM IR emitted at the CPU's vector width (R = 8
int32 lanes on AVX2, 16 on AVX-512): :mod:`terrapipe.kernels.resample_ir`; the filter's
coefficients and the checks are here, in Numba. Where AVX-512BW is present the passes run in
16-bit arithmetic by default (Q15 weights, 7 then 6 fractional bits; within one level of the
exact arithmetic): NOTE [a kernel generated for the machine at hand] 6 in resample_ir.

Scratch memory is the caller's: weights from :func:`alloc_resize_scratch`, reused across calls.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import resample_ir

__all__ = [
    "PRECISION_BITS",
    "max_taps",
    "alloc_resize_scratch",
    "identity_lut",
    "bilinear_coeffs",
    "region_taps",
    "resize_crop_bilinear",
    "resize_crop_bilinear_region",
    "resize_kernel",
    "resize_region_at",
    "hflip",
    "hwc_to_chw",
    "normalize_lut",
    "build_normalize_lut",
    "resize_crop",
]

# Pillow's fixed point for 8-bit resampling: 32 bits - 8 bits of value - 2 bits of headroom.
PRECISION_BITS = 22
# Fixed point of the 16-bit intermediate: value * 2**_FRAC.
_FRAC = 8
_VSHIFT = PRECISION_BITS - _FRAC
# Horizontal weights: 16-bit value x 14-bit weight, summed over weights totalling 2**14, fits int32.
_HBITS = 14
_HSHIFT = _HBITS + _FRAC


def max_taps(in_len: float, out_len: int) -> int:
    """Filter taps per output pixel when resampling ``in_len`` source pixels to ``out_len``."""
    scale = max(float(in_len) / out_len, 1.0)
    return int(math.ceil(scale)) * 2 + 1


def alloc_resize_scratch(
    max_src_h: int, max_src_w: int, out_h: int, out_w: int, channels: int, lanes: int | None = None,
    narrow: bool | None = None,
) -> tuple[np.ndarray, ...]:
    """Scratch for :func:`resize_crop_bilinear` covering any box within a ``max_src_h x max_src_w``
    source: ``(block, xbounds, xweights, ybounds, yweights, params)``.

    block: uint16 (max_src_w * channels * R,), R vertically resampled rows (8 fractional bits),
    interleaved by row; R = ``lanes``, by default this CPU's int32 vector lanes
    (:func:`resample_ir.vector_lanes`; another power of two runs too, e.g. to test a width);
    ``channels`` here is the source's bytes per pixel (4 for RGBX sources).
    xbounds/ybounds: int32 (out, 2), first tap and tap count per output pixel;
    xweights/yweights: int32 (out, taps), fixed-point weights; params: int64 (N_PARAMS,), the
    compiled passes' arguments. Owned by one thread: the kernel overwrites all of it on every call.
    narrow: resample in 16-bit arithmetic (within one level of the exact 32-bit one, and faster
    where vectors are 512 bits wide); by default where :func:`resample_ir.narrow_default` says.
    """
    if min(max_src_h, max_src_w, out_h, out_w, channels) <= 0:
        raise ValueError("alloc_resize_scratch: every size must be positive")
    lanes = resample_ir.vector_lanes() if lanes is None else int(lanes)
    if lanes & (lanes - 1) or not 2 <= lanes <= 64:
        raise ValueError(f"alloc_resize_scratch: lanes must be a power of two in [2, 64], got {lanes}")
    params = np.zeros(resample_ir.N_PARAMS, np.int64)
    params[resample_ir.P_LANES] = lanes
    params[resample_ir.P_NARROW] = resample_ir.narrow_default() if narrow is None else bool(narrow)
    return (
        np.empty(max_src_w * channels * lanes, np.uint16),
        np.empty((out_w, 2), np.int32),
        np.empty((out_w, max_taps(max_src_w, out_w)), np.int32),
        np.empty((out_h, 2), np.int32),
        np.empty((out_h, max_taps(max_src_h, out_h)), np.int32),
        params,
    )


def identity_lut(channels: int) -> np.ndarray:
    """The (channels, 256) uint8 table that stores resampled values unchanged."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 256)))


@njit(nogil=True, cache=True)
def bilinear_coeffs(in_size, lo, hi, out_size, bounds, weights):
    """Pillow's ``precompute_coeffs`` for the bilinear filter, in fixed point.

    Maps the source interval [lo, hi) of an axis of ``in_size`` pixels onto ``out_size`` pixels.
    Fills ``bounds[o] = (first source pixel, tap count)`` and ``weights[o, :taps]``; returns the
    tap count used (at most ``weights.shape[1]``, else ValueError).
    """
    scale = (hi - lo) / out_size
    filterscale = scale if scale > 1.0 else 1.0
    support = 1.0 * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    if ksize > weights.shape[1]:
        raise ValueError("bilinear_coeffs: weights buffer has too few taps for this scale")
    ss = 1.0 / filterscale
    one = float(1 << PRECISION_BITS)
    for o in range(out_size):
        center = lo + (o + 0.5) * scale
        xmin = int(center - support + 0.5)
        if xmin < 0:
            xmin = 0
        xmax = int(center + support + 0.5)
        if xmax > in_size:
            xmax = in_size
        n = xmax - xmin
        ww = 0.0
        # Two passes (sum, then normalise) exactly as Pillow does, so rounding matches.
        for t in range(n):
            x = (t + xmin - center + 0.5) * ss
            if x < 0.0:
                x = -x
            ww += 1.0 - x if x < 1.0 else 0.0
        for t in range(ksize):
            w = 0.0
            if t < n:
                x = (t + xmin - center + 0.5) * ss
                if x < 0.0:
                    x = -x
                w = 1.0 - x if x < 1.0 else 0.0
                if ww != 0.0:
                    w = w / ww
            if w < 0:
                weights[o, t] = np.int32(-0.5 + w * one)
            else:
                weights[o, t] = np.int32(0.5 + w * one)
        bounds[o, 0] = xmin
        bounds[o, 1] = n
    return ksize




def resize_crop_bilinear(
    src: np.ndarray, x0: float, y0: float, x1: float, y1: float, out: np.ndarray, lut: np.ndarray,
    flip: bool, block: np.ndarray, xbounds: np.ndarray, xweights: np.ndarray, ybounds: np.ndarray,
    yweights: np.ndarray, params: np.ndarray,
) -> None:
    """Crop, resample (bilinear, antialiased), flip, map through ``lut``, write planar: one call.

    src: uint8 (H, W, S), rows of any stride, pixels contiguous, read in place: the box is never
    copied. S >= C: the first C bytes of each pixel are used, so padded RGBX pixels (S=4, C=3)
    work as they are.
    x0, y0, x1, y1: float box [x0, x1) x [y0, y1) in source pixels (Pillow's ``box``), inside
    the image.
    out: (C, OH, OW) of ``lut``'s dtype, any strides (a sample's slot in an NCHW batch).
    lut: (C, 256), rows contiguous; out[c, y, x] = lut[c, resampled value]. :func:`identity_lut`
    for uint8, :func:`build_normalize_lut` for mean/std normalisation to float32/float16/bfloat16.
    flip: mirror horizontally.
    block, xbounds, xweights, ybounds, yweights, params: scratch from :func:`alloc_resize_scratch`.
    Releases the GIL for the whole call but the argument checks.
    """
    resize_crop_bilinear_region(src, 0, 0, src.shape[1], src.shape[0], x0, y0, x1, y1, out, lut,
                                flip, block, xbounds, xweights, ybounds, yweights, params)


def resize_crop_bilinear_region(
    src: np.ndarray, ox: int, oy: int, img_w: int, img_h: int, x0: float, y0: float, x1: float,
    y1: float, out: np.ndarray, lut: np.ndarray, flip: bool, block: np.ndarray, xbounds: np.ndarray,
    xweights: np.ndarray, ybounds: np.ndarray, yweights: np.ndarray, params: np.ndarray,
) -> None:
    """:func:`resize_crop_bilinear` from a decoded *region* of a larger image: ``src`` holds
    pixels [ox, ox + W) x [oy, oy + H) of an ``img_w x img_h`` image, and the box is in image
    coordinates. Filter taps are computed on the whole image, so the result is bit-identical to
    cropping the same box from the whole image, provided the region holds every tap (else
    ValueError: the caller decodes a margin around the box). The loader's per-sample call.
    """
    if src.dtype != np.uint8 or src.ndim != 3 or not _pixels_contiguous(src):
        raise ValueError(f"src: expected uint8 (H, W, S) with contiguous pixels, got {src.dtype} "
                         f"{src.shape} strides {src.strides}")
    if out.ndim != 3 or lut.dtype != out.dtype or lut.ndim != 2 or lut.strides[1] != lut.itemsize:
        raise ValueError(f"out/lut: expected (C, H, W) out and (C, 256) lut of one dtype, got "
                         f"{out.dtype} {out.shape} and {lut.dtype} {lut.shape}")
    if out.shape[0] > src.shape[2] or lut.shape[0] < out.shape[0] or lut.shape[1] != 256:
        raise ValueError(f"resize_crop_bilinear: {out.shape[0]} output channels from a source of "
                         f"{src.shape[2]} bytes per pixel and a lut of shape {lut.shape}")
    address = resize_kernel(src.shape[2], out.shape[0], lut, params)
    resize_region_at(address, src, ox, oy, img_w, img_h, x0, y0, x1, y1, out, lut, flip, block,
                     xbounds, xweights, ybounds, yweights, params)


def resize_kernel(stride: int, channels: int, lut: np.ndarray, params: np.ndarray) -> int:
    """Address of the resampling passes (``resample_ir.kernel``) for ``stride`` source bytes
    per pixel into ``channels`` planes of ``lut``'s dtype, the lut's identity, and the lanes and
    arithmetic of a scratch's ``params``: what :func:`resize_region_at` is handed, by
    :func:`resize_crop_bilinear_region` or by a compiled caller."""
    identity = lut.dtype == np.uint8 and _is_identity(lut, channels)
    return resample_ir.kernel(stride, channels, lut.itemsize, int(params[resample_ir.P_LANES]), identity,
                              bool(params[resample_ir.P_NARROW]))


@njit(nogil=True, cache=True)
def region_taps(src, ox, oy, img_w, img_h, x0, y0, x1, y1, out_w, out_h, xbounds, xweights, ybounds,
                yweights):
    """The filter's taps for a box resampled from a decoded region (see
    :func:`resize_crop_bilinear_region`): fills ``xbounds``/``ybounds`` with first taps relative
    to the region's origin, and ``xweights`` rounded to the horizontal pass's _HBITS bits
    (16-bit intermediates times them must sum exactly in int32); ``yweights`` stay at
    PRECISION_BITS. Returns ``(col_first, col_last)``: the region's source columns
    [col_first, col_last) that the horizontal taps read. ValueError when the region lacks a tap.
    """
    in_h, in_w = src.shape[0], src.shape[1]
    bilinear_coeffs(img_w, x0, x1, out_w, xbounds, xweights)
    bilinear_coeffs(img_h, y0, y1, out_h, ybounds, yweights)
    if (xbounds[0, 0] < ox or xbounds[out_w - 1, 0] + xbounds[out_w - 1, 1] > ox + in_w
            or ybounds[0, 0] < oy or ybounds[out_h - 1, 0] + ybounds[out_h - 1, 1] > oy + in_h):
        raise ValueError("resize_crop_bilinear_region: the region lacks filter taps of the box")
    for x in range(out_w):
        xbounds[x, 0] -= ox
    for y in range(out_h):
        ybounds[y, 0] -= oy
    for x in range(out_w):
        for t in range(xbounds[x, 1]):
            xweights[x, t] = (xweights[x, t] + (1 << (PRECISION_BITS - _HBITS - 1))) >> (
                PRECISION_BITS - _HBITS)
    return xbounds[0, 0], xbounds[out_w - 1, 0] + xbounds[out_w - 1, 1]


@njit(nogil=True, cache=True)
def _is_identity(lut, channels):
    # lut[c, v] == v for the channels written: then the resize stores its values as they are.
    for c in range(channels):
        for v in range(256):
            if lut[c, v] != v:
                return False
    return True


def _pixels_contiguous(src: np.ndarray) -> bool:
    # Bytes of a pixel adjacent, pixels of a row adjacent (a length-1 axis may have any stride).
    _, w, s = src.shape
    return (s == 1 or src.strides[2] == 1) and (w == 1 or src.strides[1] == s)


@njit(nogil=True, cache=True)
def resize_region_at(
    address, src, ox, oy, img_w, img_h, x0, y0, x1, y1, out, lut, flip, block, xbounds, xweights,
    ybounds, yweights, params
):
    """:func:`resize_crop_bilinear_region`'s work without its checks, for compiled callers that
    made them once (a batch's rows filled in one call): the filter's taps, then the two passes
    of the kernel at ``address`` (``resample_ir.kernel`` for this source's bytes per pixel, the
    output's channels and element size, the lut's identity and ``params``' lanes and
    arithmetic). Arguments as there; the scratch must cover the region (ValueError otherwise).
    Writes ``out`` and the scratch only."""
    in_h, _, stride = src.shape
    out_h = out.shape[1]
    out_w = out.shape[2]
    col_first, col_last = region_taps(src, ox, oy, img_w, img_h, x0, y0, x1, y1, out_w, out_h, xbounds,
                                      xweights, ybounds, yweights)
    # The passes see x taps relative to col_first.
    for x in range(out_w):
        xbounds[x, 0] -= col_first
    if params[resample_ir.P_NARROW]:
        resample_ir.narrow_weights(ybounds, yweights, PRECISION_BITS)
        resample_ir.narrow_weights(xbounds, xweights, _HBITS)
    span = (col_last - col_first) * stride
    if span * params[resample_ir.P_LANES] > block.shape[0]:
        raise ValueError("resize_crop_bilinear: scratch is too small for this box")
    params[resample_ir.P_SRC_ROW] = src.strides[0]
    params[resample_ir.P_SRC_H] = in_h
    params[resample_ir.P_J0] = col_first * stride
    params[resample_ir.P_SPAN] = span
    params[resample_ir.P_KY] = yweights.shape[1]
    params[resample_ir.P_KX] = xweights.shape[1]
    params[resample_ir.P_OUT_CS] = out.strides[0]
    params[resample_ir.P_OUT_YS] = out.strides[1]
    params[resample_ir.P_OUT_XS] = out.strides[2]
    params[resample_ir.P_LUT_ROW] = lut.strides[0]
    params[resample_ir.P_OUT_H] = out_h
    params[resample_ir.P_OUT_W] = out_w
    params[resample_ir.P_FLIP] = 1 if flip else 0
    resample_ir.call_kernel(address, params, src, ybounds, yweights, xbounds, xweights, block, out,
                            lut)


@njit(nogil=True, cache=True)
def hflip(src, out):
    """out[y, x, c] = src[y, W - 1 - x, c] for (H, W, C) arrays of equal shape; must not alias."""
    h, w, channels = src.shape
    for y in range(h):
        for c in range(channels):
            # One channel of one row at a time: a 1-D reversed copy the compiler can vectorize.
            s = src[y, ::-1, c]
            d = out[y, :, c]
            for x in range(w):
                d[x] = s[x]


@njit(nogil=True, cache=True)
def hwc_to_chw(src, out):
    """uint8 pass-through with layout change: out[c, y, x] = src[y, x, c]."""
    h, w, channels = src.shape
    for c in range(channels):
        plane = out[c]
        for y in range(h):
            s = src[y]
            d = plane[y]
            for x in range(w):
                d[x] = s[x, c]


@njit(nogil=True, cache=True)
def normalize_lut(src, lut, out):
    """Normalize and change layout by table: out[c, y, x] = lut[c, src[y, x, c]].

    src: uint8 (H, W, C); lut: (C, 256) of the output dtype (float32, float64, or uint16 bits of
    float16/bfloat16) from :func:`build_normalize_lut`; out: (C, H, W), any strides.
    A table makes the result bit-identical to the float32 reference arithmetic and costs one
    gather per element whatever the output type.
    """
    h, w, channels = src.shape
    for c in range(channels):
        table = lut[c]
        plane = out[c]
        for y in range(h):
            s = src[y]
            d = plane[y]
            for x in range(w):
                d[x] = table[s[x, c]]


def build_normalize_lut(mean, std, dtype: str | np.dtype = "float32") -> np.ndarray:
    """The (C, 256) table for :func:`normalize_lut`: ``((v / 255) - mean[c]) / std[c]``.

    Computed in float32 in exactly the order torchvision's ``ToTensor`` + ``Normalize`` use, then
    rounded to ``dtype``: "float32", "float64", "float16" or "bfloat16" (the last two returned as
    uint16 bit patterns). mean, std: per-channel sequences in [0, 1] units; std must be non-zero.
    """
    mean = np.asarray(mean, np.float32).reshape(-1)
    std = np.asarray(std, np.float32).reshape(-1)
    if mean.shape != std.shape:
        raise ValueError(f"mean has {mean.size} channels but std has {std.size}")
    if np.any(std == 0):
        raise ValueError(f"std must be non-zero, got {std.tolist()}")
    v = np.arange(256, dtype=np.float32) / np.float32(255)
    table = (v[None, :] - mean[:, None]) / std[:, None]
    name = np.dtype(dtype).name if dtype != "bfloat16" else "bfloat16"
    if name == "float32":
        return np.ascontiguousarray(table, np.float32)
    if name == "float64":
        return table.astype(np.float64)
    if name == "float16":
        return table.astype(np.float16).view(np.uint16)
    if name == "bfloat16":
        bits = table.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    raise TypeError(f"dtype: unsupported normalize output {dtype!r}")


def resize_crop(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    *,
    lut: np.ndarray | None = None,
    flip: bool = False,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Checked, allocating front end of :func:`resize_crop_bilinear` (tests, one-off use).

    src: uint8 (H, W, C); box: (x0, y0, x1, y1) in source pixels; size: (out_h, out_w).
    Returns ``out``: (C, out_h, out_w) of ``lut``'s dtype (uint8 without a lut). The hot path (the
    loader) calls the kernel directly with per-thread scratch instead.
    """
    if not isinstance(src, np.ndarray) or src.dtype != np.uint8 or src.ndim != 3:
        raise ValueError(f"src: expected a uint8 (H, W, C) array, got {getattr(src, 'shape', src)}")
    h, w, c = src.shape
    if h == 0 or w == 0 or c == 0:
        raise ValueError(f"src: empty image of shape {src.shape}")
    x0, y0, x1, y1 = (float(v) for v in box)
    if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
        raise ValueError(f"box {box} is not a non-empty box inside a {w}x{h} image")
    out_h, out_w = (int(v) for v in size)
    if out_h <= 0 or out_w <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if lut is None:
        lut = identity_lut(c)
    if lut.shape != (c, 256):
        raise ValueError(f"lut: expected shape ({c}, 256), got {lut.shape}")
    if out is None:
        out = np.empty((c, out_h, out_w), lut.dtype)
    elif out.shape != (c, out_h, out_w) or out.dtype != lut.dtype:
        raise ValueError(f"out: expected {lut.dtype} {(c, out_h, out_w)}, got {out.dtype} {out.shape}")
    scratch = alloc_resize_scratch(h, w, out_h, out_w, c)
    resize_crop_bilinear(np.ascontiguousarray(src), x0, y0, x1, y1, out, lut, bool(flip), *scratch)
    return out
