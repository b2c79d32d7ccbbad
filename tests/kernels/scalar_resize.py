"""The scalar resampling kernel that the vector one (terrapipe.kernels.resample_ir) replaced,
kept as its bit-exact reference: the same fixed point, one value at a time, 8 rows per block.

resize_region(src, ox, oy, img_w, img_h, x0, y0, x1, y1, out, lut, flip, *alloc(...)) has the
semantics of terrapipe.kernels.image.resize_crop_bilinear_region.
"""

import numpy as np
from numba import njit

from terrapipe.kernels.image import PRECISION_BITS, max_taps, region_taps

_FRAC = 8
_VSHIFT = PRECISION_BITS - _FRAC
_HBITS = 14
_HSHIFT = _HBITS + _FRAC
_ROWS = 8


def alloc(max_src_h, max_src_w, out_h, out_w, channels):
    row = max_src_w * channels
    return (
        np.empty(row * _ROWS, np.uint16),
        np.zeros((_ROWS, row), np.int32),
        np.empty(channels * _ROWS, np.int32),
        np.empty((out_w, 2), np.int32),
        np.empty((out_w, max_taps(max_src_w, out_w)), np.int32),
        np.empty((out_h, 2), np.int32),
        np.empty((out_h, max_taps(max_src_h, out_h)), np.int32),
    )


@njit(nogil=True, cache=True, inline="always")
def _round8(ss):
    v = (ss + (np.int64(1) << (_HSHIFT - 1))) >> _HSHIFT
    if v < 0:
        return np.uint8(0)
    if v > 255:
        return np.uint8(255)
    return np.uint8(v)


@njit(nogil=True, cache=True)
def resize_region(
    src, ox, oy, img_w, img_h, x0, y0, x1, y1, out, lut, flip, block, acc, hacc, xbounds, xweights,
    ybounds, yweights
):
    """:func:`resize_crop_bilinear` from a decoded *region* of a larger image: ``src`` holds
    pixels [ox, ox + W) x [oy, oy + H) of an ``img_w x img_h`` image, and the box is in image
    coordinates. Filter taps are computed on the whole image, so the result is bit-identical to
    cropping the same box from the whole image, provided the region holds every tap (else
    ValueError: the caller decodes a margin around the box).
    """
    in_h, in_w, stride = src.shape
    channels = out.shape[0]
    out_h = out.shape[1]
    out_w = out.shape[2]
    if channels > stride or lut.shape[0] < channels:
        raise ValueError("resize_crop_bilinear: more output channels than source/lut channels")
    flat = src.reshape((in_h, in_w * stride))

    # The filter's taps are the product's (terrapipe.kernels.image.region_taps); the passes
    # below are the reference.
    col_first, col_last = region_taps(src, ox, oy, img_w, img_h, x0, y0, x1, y1, out_w, out_h, xbounds,
                                      xweights, ybounds, yweights)
    j0 = col_first * stride
    span = (col_last - col_first) * stride
    if span * _ROWS > block.shape[0] or span > acc.shape[1] or stride * _ROWS > hacc.shape[0]:
        raise ValueError("resize_crop_bilinear: scratch is too small for this box")

    for o0 in range(0, out_h, _ROWS):
        rows = min(_ROWS, out_h - o0)
        _vertical_pass(flat, j0, span, o0, rows, ybounds, yweights, block, acc)
        _horizontal_pass(block, col_first, out, o0, rows, lut, flip, stride, xbounds, xweights, hacc)


@njit(nogil=True, cache=True)
def _vertical_pass(flat, j0, span, o0, rows, ybounds, yweights, block, acc):
    # acc[r, :span] = sum_t w[o0 + r, t] * flat[ymin + t, j0 : j0 + span]: contiguous, vectorized.
    for r in range(rows):
        o = o0 + r
        ymin = ybounds[o, 0]
        n = ybounds[o, 1]
        a = acc[r]
        for j in range(span):
            a[j] = 1 << (_VSHIFT - 1)
        for t in range(n):
            wt = yweights[o, t]
            row = flat[ymin + t, j0 : j0 + span]
            for j in range(span):
                a[j] += np.int32(row[j]) * wt
    # Interleave the rows (block[j * _ROWS + r]) so the horizontal taps read _ROWS rows of one
    # pixel as one contiguous vector. Rows past ``rows`` carry stale, bounded values that are
    # never stored. The literal-width inner loop is what LLVM turns into shuffles.
    for j in range(span):
        for r in range(_ROWS):
            block[j * _ROWS + r] = np.uint16(acc[r, j] >> _VSHIFT)


@njit(nogil=True, cache=True)
def _horizontal_pass(block, col_first, out, o0, rows, lut, flip, stride, xbounds, xweights, hacc):
    # The common shapes get their own copy of the loop with literal sizes: fixed trip counts are
    # what turn the taps into a few vector instructions and the stores into straight-line code.
    channels = out.shape[0]
    if rows == _ROWS and channels == 3 and stride == 4:
        _hrows(block, col_first, out, o0, lut, flip, xbounds, xweights, hacc, 4, 3, _ROWS)
    elif rows == _ROWS and channels == 3 and stride == 3:
        _hrows(block, col_first, out, o0, lut, flip, xbounds, xweights, hacc, 3, 3, _ROWS)
    else:
        _hrows(block, col_first, out, o0, lut, flip, xbounds, xweights, hacc, stride, channels, rows)


@njit(nogil=True, cache=True, inline="always")
def _hrows(block, col_first, out, o0, lut, flip, xbounds, xweights, hacc, stride, channels, rows):
    # hacc[c * _ROWS + r] = sum_t w[x, t] * (pixel xmin + t, channel c, row o0 + r): each tap is
    # one contiguous run of stride * _ROWS values. ``stride``: bytes per source pixel, of which
    # the first ``channels`` are used.
    last = out.shape[2] - 1
    width = stride * _ROWS
    for x in range(out.shape[2]):
        base = (xbounds[x, 0] - col_first) * width
        for k in range(width):
            hacc[k] = 0
        for t in range(xbounds[x, 1]):
            wt = xweights[x, t]
            b = base + t * width
            for k in range(width):
                hacc[k] += np.int32(block[b + k]) * wt
        xo = last - x if flip else x
        for c in range(channels):
            plane = out[c]
            table = lut[c]
            for r in range(rows):
                plane[o0 + r, xo] = table[_round8(hacc[c * _ROWS + r])]
