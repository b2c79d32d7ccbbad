"""The resampling filter's taps for a batch of crops, as index/weight arrays a matrix multiply
can use: the GPU decode path resamples with the same filter as
:func:`terrapipe.kernels.image.resize_crop_bilinear`, as two batched products with weight
matrices built from these taps on the device.

The weights are those of :func:`terrapipe.kernels.image.bilinear_coeffs` (Pillow's bilinear,
antialiased when shrinking): the same taps, the same normalisation, read back from its fixed
point (``PRECISION_BITS`` bits), so a float product differs from the CPU path's integer passes
only by rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .image import PRECISION_BITS, bilinear_coeffs, max_taps

__all__ = ["batch_taps_size", "batch_taps"]


def batch_taps_size(boxes: np.ndarray, out_h: int, out_w: int) -> tuple[int, int]:
    """(x taps, y taps): the most taps any output pixel of these boxes needs, per axis.

    boxes: float64 (N, 4) ``(x0, y0, x1, y1)`` in source pixels.
    """
    kx = max(max_taps(b[2] - b[0], out_w) for b in boxes)
    ky = max(max_taps(b[3] - b[1], out_h) for b in boxes)
    return kx, ky


@njit(nogil=True, cache=True)
def batch_taps(sizes, boxes, flips, xidx, xw, yidx, yw):
    """Taps of N crops resampled to one output size, in each source image's pixels.

    sizes: int64 (N, 2) ``(w, h)`` of each source image; boxes: float64 (N, 4) ``(x0, y0, x1,
    y1)`` inside it; flips: bool (N,), mirror the output horizontally.
    Filled (all owned by the caller, overwritten): xidx int64 (N, OW, KX) and xw float32 (N, OW,
    KX): output column o of sample i is ``sum_t xw[i, o, t] * row[xidx[i, o, t]]``; yidx / yw
    (N, OH, KY) likewise for rows. Unused taps have index 0 and weight 0. KX, KY from
    :func:`batch_taps_size` (else ValueError from bilinear_coeffs).
    """
    n = sizes.shape[0]
    out_w = xidx.shape[1]
    out_h = yidx.shape[1]
    kx = xidx.shape[2]
    ky = yidx.shape[2]
    xbounds = np.empty((out_w, 2), np.int32)
    xweights = np.empty((out_w, kx), np.int32)
    ybounds = np.empty((out_h, 2), np.int32)
    yweights = np.empty((out_h, ky), np.int32)
    for i in range(n):
        bilinear_coeffs(sizes[i, 0], boxes[i, 0], boxes[i, 2], out_w, xbounds, xweights)
        bilinear_coeffs(sizes[i, 1], boxes[i, 1], boxes[i, 3], out_h, ybounds, yweights)
        _axis(xbounds, xweights, flips[i], xidx[i], xw[i])
        _axis(ybounds, yweights, False, yidx[i], yw[i])


@njit(nogil=True, cache=True)
def _axis(bounds, weights, flip, idx, w):
    # One axis of one sample: tap indices, weights as floats, output pixels in reverse order
    # when flipped; unused taps index 0 with weight 0.
    out = idx.shape[0]
    one = 1.0 / float(1 << PRECISION_BITS)
    for o in range(out):
        dst = out - 1 - o if flip else o
        for t in range(idx.shape[1]):
            if t < bounds[o, 1]:
                idx[dst, t] = bounds[o, 0] + t
                w[dst, t] = weights[o, t] * one
            else:
                idx[dst, t] = 0
                w[dst, t] = 0.0

