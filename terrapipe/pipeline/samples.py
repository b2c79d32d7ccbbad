"""Per-sample work: read one sample, decode it (the libjpeg-turbo region decoder, else Pillow),
and write it through the plan's kernel into its row of a batch buffer.

:class:`SampleWriter` is what every loader worker runs, a thread of the loader's process or of
its worker process (NOTE [the loader's worker process] in pipeline/worker_process.py): the same
code on the same inputs (sample index, seed, epoch) writes the same bytes wherever it runs.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import timeline
from ..kernels import image as kimage
from . import decode, roi_jpeg
from .sources import Source
from .transforms import Plan

__all__ = ["SampleError", "SampleWriter"]


class SampleError(RuntimeError):
    """A sample could not be read or decoded; the message names its index and path."""

    def __init__(self, index: int, where: str, cause: BaseException | str) -> None:
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"sample {index} ({where}): {what}")
        self.index = index
        self.where = where
        self.cause_text = what


class _Scratch(threading.local):
    """Each worker thread's own decoder and resize scratch, grown to the largest source seen."""

    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.bufs: tuple[np.ndarray, ...] = ()
        self.jpeg: roi_jpeg.RoiDecoder | None = None

    def roi_decoder(self) -> roi_jpeg.RoiDecoder:
        if self.jpeg is None:
            self.jpeg = roi_jpeg.RoiDecoder()
        return self.jpeg

    def get(self, h: int, w: int, out_h: int, out_w: int, c: int) -> tuple[np.ndarray, ...]:
        k = self.key
        if not k or h > k[0] or w > k[1] or (out_h, out_w, c) != k[2:]:
            h, w = max(h, k[0] if k else 0), max(w, k[1] if k else 0)
            self.bufs = kimage.alloc_resize_scratch(h, w, out_h, out_w, c)
            self.key = (h, w, out_h, out_w, c)
        return self.bufs


class SampleWriter:
    """Writes samples of ``dataset`` into batch rows, from any number of threads at once.

    plan: the compiled transforms; lut: (C, 256), the table the kernel writes through (the
    plan's own on the host, the identity where normalization runs on the device); on_error:
    "raise" or "skip" (a failed sample is replaced by the next readable one in dataset order, and
    appended to ``skipped`` as (index, where, error): the caller's list when given). Threads
    share nothing but ``skipped``.
    """

    def __init__(self, dataset: Source, plan: Plan, lut: np.ndarray, on_error: str,
                 skipped: list | None = None) -> None:
        self.dataset = dataset
        self.plan = plan
        self.lut = lut
        self.on_error = on_error
        self.skipped: list[tuple[int, str, str]] = [] if skipped is None else skipped
        self._skip_lock = threading.Lock()
        self._scratch = _Scratch()
        self._roi = roi_jpeg.enabled()

    def decode_into(self, index: int, out: np.ndarray, seed: int, epoch: int) -> int:
        """Sample ``index``, augmented as (seed, epoch) draw it, into ``out`` (C, H, W) of the
        lut's dtype (any strides); returns its label. Raises whatever reading or decoding raised."""
        rec = timeline.enabled()  # read, decode, kernel on the timeline at one clock read each
        t = timeline.now() if rec else 0
        payload, label = self.dataset.read(index)
        if rec:
            t = timeline.phase("loader", "read", t, {"index": index})
        plan = self.plan
        oh, ow = plan.out_hw
        # Each path gives the pixels ``arr`` holding [ox, ox + W) x [oy, oy + H) of an
        # img_w x img_h image (the whole of it but for the region decoder), and the box in it.
        if isinstance(payload, np.ndarray):
            arr = payload if payload.ndim == 3 else payload[:, :, None]
            ox = oy = 0
            img_h, img_w = arr.shape[:2]
            box = plan.box(img_w, img_h, seed, epoch, index)
        else:
            region = None
            if self._roi:
                # libjpeg-turbo decodes only what the crop reads, without the GIL; anything it
                # declines (not a JPEG, CMYK, corrupt data) goes to Pillow below.
                dec = self._scratch.roi_decoder()
                size = dec.header(payload)
                if size is not None:
                    region = dec.decode(plan.box(*size, seed, epoch, index), plan.out_hw)
            if region is not None:
                arr, ox, oy, img_w, img_h, box = region
                if rec:
                    t = timeline.phase("loader", "decode region", t)
            else:
                im = decode.open_image(payload)
                w, h = im.size
                box = decode.draft_box(im, plan.box(w, h, seed, epoch, index), plan.out_hw)
                arr, keepalive = decode.pixels(im)  # noqa: F841 (arr may point into Pillow's memory)
                ox = oy = 0
                img_h, img_w = arr.shape[:2]
                if rec:
                    t = timeline.phase("loader", "decode", t)
        if arr.shape[2] < plan.channels:
            raise ValueError(f"expected {plan.channels} channels, got image of shape {arr.shape}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        scratch = self._scratch.get(arr.shape[0], arr.shape[1], oh, ow, arr.shape[2])
        flip = plan.flip(seed, epoch, index)
        kimage.resize_crop_bilinear_region(arr, ox, oy, img_w, img_h, box[0], box[1], box[2], box[3], out,
                                           self.lut, flip, *scratch)
        if rec:
            timeline.phase("loader", "kernel", t)
        return label

    def fill(self, images: np.ndarray, labels: np.ndarray, row0: int, indices: np.ndarray, seed: int,
             epoch: int) -> None:
        """Rows ``row0 ..`` of ``images`` (N, C, H, W) and ``labels`` (N,) int64 from ``indices``.
        Raises :class:`SampleError` naming the sample under on_error="raise"."""
        n = len(self.dataset)
        for k, index in enumerate(indices):
            index = int(index)
            try:
                labels[row0 + k] = self.decode_into(index, images[row0 + k], seed, epoch)
            except Exception as exc:
                err = SampleError(index, self.dataset.describe(index), exc)
                if self.on_error == "raise":
                    raise err from exc
                # Deterministic replacement: the next readable sample in dataset order.
                with self._skip_lock:
                    self.skipped.append((index, err.where, str(exc)))
                for step in range(1, n):
                    alt = (index + step) % n
                    try:
                        labels[row0 + k] = self.decode_into(alt, images[row0 + k], seed, epoch)
                        break
                    except Exception:
                        continue
                else:
                    raise err from exc
