"""Crop-box samplers: where a sample's crop lies in its source image, drawn before decode.

Pure functions of the image size and the counter-based RNG keys, so the box of sample ``index``
in ``epoch`` is the same on any thread, rank, or after a resume, and the decoder can be told the
resolution it needs (JPEG DCT scaling) before it runs. Boxes are ``(x0, y0, x1, y1)`` floats in
source pixels, ready for :func:`terrapipe.kernels.image.resize_crop_bilinear`.
"""

from __future__ import annotations

import math

from numba import njit

from .rng import uniform

__all__ = ["random_resized_crop_box", "resize_center_crop_box"]


@njit(cache=True)  # NOTE [scalar draws keep the GIL]
def random_resized_crop_box(w, h, scale_lo, scale_hi, logr_lo, logr_hi, seed, epoch, index, op_id):
    """torchvision's ``RandomResizedCrop.get_params`` with counter-based draws.

    Up to 10 attempts at an area fraction in [scale_lo, scale_hi] and a log-uniform aspect ratio
    in [exp(logr_lo), exp(logr_hi)]; then the central crop clamped to the ratio range.
    Returns (x0, y0, x1, y1) as integers-valued floats.
    """
    area = float(w * h)
    d = 0
    for _ in range(10):
        target = area * (scale_lo + (scale_hi - scale_lo) * uniform(seed, epoch, index, op_id, d))
        aspect = math.exp(logr_lo + (logr_hi - logr_lo) * uniform(seed, epoch, index, op_id, d + 1))
        d += 4
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(uniform(seed, epoch, index, op_id, d - 2) * (h - ch + 1))
            j = int(uniform(seed, epoch, index, op_id, d - 1) * (w - cw + 1))
            return float(j), float(i), float(j + cw), float(i + ch)
    in_ratio = w / h
    if in_ratio < math.exp(logr_lo):
        cw = w
        ch = int(round(cw / math.exp(logr_lo)))
    elif in_ratio > math.exp(logr_hi):
        ch = h
        cw = int(round(ch * math.exp(logr_hi)))
    else:
        cw = w
        ch = h
    i = (h - ch) // 2
    j = (w - cw) // 2
    return float(j), float(i), float(j + cw), float(i + ch)


@njit(cache=True)  # NOTE [scalar draws keep the GIL]
def resize_center_crop_box(w, h, resize, crop_h, crop_w):
    """``Resize(resize)`` (shorter side; 0 = no resize) then ``CenterCrop((crop_h, crop_w))``,
    expressed as one box in source pixels whose output is crop_h x crop_w.

    torchvision's integer crop offsets in the resized image (``round((rh - ch) / 2)``) are kept,
    then mapped back to the source, so only the final resampling differs (one pass, not two).
    """
    if resize > 0:
        if w <= h:
            rw = resize
            rh = int(resize * h / w)
        else:
            rh = resize
            rw = int(resize * w / h)
    else:
        rw = w
        rh = h
    fx = w / rw
    fy = h / rh
    top = int(round((rh - crop_h) / 2.0))
    left = int(round((rw - crop_w) / 2.0))
    x0 = left * fx
    y0 = top * fy
    x1 = (left + crop_w) * fx
    y1 = (top + crop_h) * fy
    # A crop larger than the image is clamped to it (torchvision pads; we resample the whole).
    return max(x0, 0.0), max(y0, 0.0), min(x1, float(w)), min(y1, float(h))
