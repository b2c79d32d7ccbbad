"""Crop, resample and flip a batch of decoded images with torch operations, on their device.

The GPU decode path's second half (:mod:`.gpu_decode`): images decoded on the GPU come out as
one tensor each, of their own size; this writes them into rows of a fixed-size uint8 batch with
the filter of the CPU path (:func:`terrapipe.kernels.image.resize_crop_bilinear`): the same taps
and weights (:func:`terrapipe.kernels.taps.batch_taps`), applied as two batched matrix products
per group of samples instead of two integer passes per sample.

NOTE [resampling by matrix products]
    1. Per sample, each output row is a weighted sum of source rows and each output column of
       source columns: ``out = Wy @ image @ Wx^T`` per channel, with ``Wy`` (OH, H) and ``Wx``
       (OW, W) holding the filter's taps (zero elsewhere).
    2. Samples are grouped and each group's images go into one zero-padded block of the
       group's largest height and width, in two torch calls whatever the group's size (a
       nested tensor, then its padded form), so a group is one batched product per axis. The
       calls per batch do not grow with its samples: each torch call releases and retakes the
       GIL, and the thread launching the model's kernels is queued behind every retake (docs/
       loader.md measures it). A group's block holds at most ``GROUP_PIXELS`` pixels (a huge
       photograph is a group of its own), about 12 bytes of working memory per block pixel.
    3. On the CPU the products are float32 and round once at the end (round half up, clamped
       to [0, 255]), where the CPU kernel rounds twice in fixed point (8 fractional bits between
       its passes): a pixel differs by at most 1 from the kernel's resampling of the same
       decoded pixels. On a GPU they are float16 on its tensor cores (float32 accumulation):
       pixel values are exact in float16, the weights carry 11 bits and the intermediate
       rows 3 fractional bits at the top of the range, so a pixel may differ by 2 (measured in
       tests/pipeline/test_gpu_decode.py); float32 costs the training step it shares the GPU
       with several times more.
    4. The horizontal product runs first when it shrinks more work away (wide sources), else
       the vertical one: the result is the same up to float rounding.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..kernels import taps as ktaps

__all__ = ["GROUP_PIXELS", "plan_groups", "resample_into"]

# Block pixels per group (NOTE [resampling by matrix products], clause 2): 32 images of
# 512 x 512, about 100 MB of working memory on the device.
GROUP_PIXELS = 32 * 512 * 512


def plan_groups(sizes: np.ndarray, limit: int = GROUP_PIXELS) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` groups of images whose zero-padded block (count x largest
    height x largest width) holds at most ``limit`` pixels; an image too large for any group is
    a group of its own. sizes: int (N, 2) ``(w, h)`` of each image."""
    groups: list[tuple[int, int]] = []
    start, hmax, wmax = 0, 0, 0
    for i, (w, h) in enumerate(sizes):
        h, w = int(h), int(w)
        nh, nw = max(hmax, h), max(wmax, w)
        if i > start and (i - start + 1) * nh * nw > limit:
            groups.append((start, i))
            start, nh, nw = i, h, w
        hmax, wmax = nh, nw
    if len(sizes):
        groups.append((start, len(sizes)))
    return groups


def _dense(idx: np.ndarray, w: np.ndarray, length: int, device: torch.device,
           dtype: torch.dtype) -> torch.Tensor:
    """(G, O, K) taps -> (G, O, length) weight matrices of ``dtype`` on ``device``."""
    idx_t, w_t = torch.from_numpy(np.ascontiguousarray(idx)), torch.from_numpy(np.ascontiguousarray(w))
    if device.type == "cuda":
        # Through torch's caching pinned allocator: the copy is queued, and the pinned block is
        # not handed out again before the copy has read it.
        idx_t, w_t = idx_t.pin_memory(), w_t.pin_memory()
    idx_t, w_t = idx_t.to(device, non_blocking=True), w_t.to(device, non_blocking=True)
    dense = torch.zeros((idx.shape[0], idx.shape[1], length), dtype=torch.float32, device=device)
    return dense.scatter_add_(2, idx_t, w_t).to(dtype)


def _padded(images: Sequence[torch.Tensor], channels: int, dtype: torch.dtype) -> torch.Tensor:
    """(G, C, max H, max W) of ``dtype``: the images' first ``channels`` planes, zero-padded
    (clause 2)."""
    planes = [im if im.shape[0] == channels else im[:channels] for im in images]
    with warnings.catch_warnings():  # torch calls strided nested tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor(planes, dtype=dtype, device=planes[0].device)
    return torch.nested.to_padded_tensor(nested, 0.0)


def resample_into(images: Sequence[torch.Tensor], boxes: np.ndarray, flips: np.ndarray,
                  out: torch.Tensor, group_pixels: int = GROUP_PIXELS,
                  dtype: torch.dtype | None = None) -> None:
    """Write ``images[i]`` cropped to ``boxes[i]``, resampled and flipped as the CPU path does,
    into ``out[i]`` (NOTE [resampling by matrix products]).

    images: N uint8 tensors (C', H_i, W_i) with C' >= C, on out's device (read, not kept);
    boxes: float64 (N, 4) ``(x0, y0, x1, y1)`` inside each image; flips: bool (N,);
    out: uint8 (N, C, OH, OW), any memory format, overwritten; dtype: the products' (default:
    float16 on a GPU, float32 on the CPU; clause 3). Runs on the current stream;
    allocates its working memory from torch's caching allocator and returns none of it.
    """
    n = len(images)
    if n == 0:
        return
    if out.dtype != torch.uint8 or out.dim() != 4 or out.shape[0] != n:
        raise ValueError(f"out: expected uint8 (N={n}, C, H, W), got {out.dtype} {tuple(out.shape)}")
    c, out_h, out_w = out.shape[1:]
    boxes = np.ascontiguousarray(boxes, dtype=np.float64).reshape(n, 4)
    flips = np.ascontiguousarray(flips, dtype=np.bool_).reshape(n)
    sizes = np.array([[im.shape[2], im.shape[1]] for im in images], dtype=np.int64)
    kx, ky = ktaps.batch_taps_size(boxes, out_h, out_w)
    xidx = np.empty((n, out_w, kx), np.int64)
    xw = np.empty((n, out_w, kx), np.float32)
    yidx = np.empty((n, out_h, ky), np.int64)
    yw = np.empty((n, out_h, ky), np.float32)
    ktaps.batch_taps(sizes, boxes, flips, xidx, xw, yidx, yw)  # in image pixels: the block holds whole images
    device = out.device
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    for a, b in plan_groups(sizes, group_pixels):
        x = _padded(images[a:b], c, dtype)  # (G, C, hmax, wmax)
        hmax, wmax = x.shape[2], x.shape[3]
        wx = _dense(xidx[a:b], xw[a:b], wmax, device, dtype)  # (G, OW, wmax)
        wy = _dense(yidx[a:b], yw[a:b], hmax, device, dtype)  # (G, OH, hmax)
        # Clause 4: the cheaper order of the two products.
        if hmax * wmax * out_w + out_h * hmax * out_w <= out_h * hmax * wmax + out_h * wmax * out_w:
            r = torch.matmul(x, wx.transpose(1, 2).unsqueeze(1))  # (G, C, hmax, OW)
            r = torch.matmul(wy.unsqueeze(1), r)  # (G, C, OH, OW)
        else:
            r = torch.matmul(wy.unsqueeze(1), x)  # (G, C, OH, wmax)
            r = torch.matmul(r, wx.transpose(1, 2).unsqueeze(1))  # (G, C, OH, OW)
        out[a:b].copy_(r.float().add_(0.5).floor_().clamp_(0, 255))
