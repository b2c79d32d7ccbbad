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
from . import compiled_fill, decode, roi_jpeg
from .sources import Source
from .transforms import BOX_WHOLE, Plan

__all__ = ["SampleError", "SampleWriter"]

# The compiled fill's file buffer starts at this size and grows to the largest file a thread
# has read whole; the most samples one fill call takes (a chunk: workers.CHUNK is 8).
_FILE_START = 1 << 20
_MAX_CHUNK = 64
# The region a thread's buffers cover before any sample has grown them (pixels, RGBX): a
# photograph of ImageNet's size and most crops of larger ones, at their draft scale.
_FIRST_REGION = (640, 640)
_NO_TIMES = np.zeros((0, 4), np.int64)


class SampleError(RuntimeError):
    """A sample could not be read or decoded; the message names its index and path."""

    def __init__(self, index: int, where: str, cause: BaseException | str) -> None:
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"sample {index} ({where}): {what}")
        self.index = index
        self.where = where
        self.cause_text = what


class _Scratch(threading.local):
    """Each worker thread's own decoder and resize scratch, grown to the largest source seen,
    and for the compiled fill its file buffer (grown to the largest file) and small arrays."""

    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.bufs: tuple[np.ndarray, ...] = ()
        self.jpeg: roi_jpeg.RoiDecoder | None = None
        self.filebuf = np.empty(_FILE_START, np.uint8)
        self.ints = np.zeros(4, np.int32)
        self.clock = np.zeros(2, np.int64)
        self.status = np.zeros(_MAX_CHUNK, np.int32)

    def roi_decoder(self) -> roi_jpeg.RoiDecoder:
        if self.jpeg is None:
            self.jpeg = roi_jpeg.RoiDecoder()
        return self.jpeg

    def get(self, h: int, w: int, out_h: int, out_w: int, c: int) -> tuple[np.ndarray, ...]:
        k = self.key
        if not k or h > k[0] or w > k[1] or (out_h, out_w, c) != k[2:]:
            # Grown by half again past the source at hand, so a run of sources a little larger
            # each does not reallocate (nor send the compiled fill back here) every time.
            if k and h > k[0]:
                h = max(h, k[0] * 3 // 2)
            if k and w > k[1]:
                w = max(w, k[1] * 3 // 2)
            h, w = max(h, k[0] if k else 0), max(w, k[1] if k else 0)
            self.bufs = kimage.alloc_resize_scratch(h, w, out_h, out_w, c)
            self.key = (h, w, out_h, out_w, c)
        return self.bufs


def _check_size(plan: Plan, w: int, h: int) -> None:
    """Without a geometry every image is taken whole, at the one size of a batch: refuse another
    (a resampled whole image would be squeezed to the first image's aspect ratio, where
    DataLoader's collate refuses to stack it)."""
    if w <= 0 or h <= 0:
        raise ValueError(f"image is {w}x{h} (width x height): no pixels")
    if plan.box_kind == BOX_WHOLE and (h, w) != tuple(plan.out_hw):
        raise ValueError(f"image is {w}x{h} (width x height), the batch's {plan.out_hw[1]}x{plan.out_hw[0]}: "
                         f"without a crop or resize transform every image must have one size (add "
                         f"Resize + CenterCrop, or RandomResizedCrop)")


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
        # NOTE [one compiled call per chunk] in pipeline/compiled_fill.py: where every sample is
        # a file the compiled fill can read and the plan's box rule is one it draws.
        self._files: compiled_fill.FileTable | None = None
        table = getattr(dataset, "file_table", lambda: None)()
        if table is not None and plan.box_kind in compiled_fill.BOX_KINDS and compiled_fill.available():
            self._files = table
            self._box_args = np.asarray(plan.box_args, np.float64)
            self._address = 0  # the kernel, found at the first compiled call (it compiles there)

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
            _check_size(plan, img_w, img_h)
            box = plan.box(img_w, img_h, seed, epoch, index)
        else:
            region = None
            if self._roi:
                # libjpeg-turbo decodes only what the crop reads, without the GIL; anything it
                # declines (not a JPEG, CMYK, corrupt data) goes to Pillow below.
                dec = self._scratch.roi_decoder()
                size = dec.header(payload)
                if size is not None:
                    _check_size(plan, *size)
                    region = dec.decode(plan.box(*size, seed, epoch, index), plan.out_hw)
            if region is not None:
                arr, ox, oy, img_w, img_h, box = region
                if rec:
                    t = timeline.phase("loader", "decode region", t)
            else:
                im = decode.open_image(payload)
                w, h = im.size
                _check_size(plan, w, h)
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
        left = range(len(indices))
        if self._files is not None and len(indices) <= _MAX_CHUNK and images.dtype == self.lut.dtype:
            left = self._fill_compiled(images, labels, row0, np.asarray(indices, np.int64), seed, epoch)
        n = len(self.dataset)
        for k in left:
            index = int(indices[k])
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

    def _fill_compiled(self, images: np.ndarray, labels: np.ndarray, row0: int, indices: np.ndarray,
                       seed: int, epoch: int) -> list[int]:
        """The chunk in one compiled call (NOTE [one compiled call per chunk]); returns the
        positions it left to the per-sample path."""
        sc = self._scratch
        plan = self.plan
        oh, ow = plan.out_hw
        dec = sc.roi_decoder()
        key = sc.key
        cap_h, cap_w = (key[0], key[1]) if key and key[4] == 4 else _FIRST_REGION
        bufs = sc.get(cap_h, cap_w, oh, ow, 4)
        cap_h, cap_w = sc.key[0], sc.key[1]
        dec.reserve(4 * cap_h * cap_w)
        if not self._address:
            self._address = kimage.resize_kernel(4, images.shape[1], self.lut, bufs[-1])
        files = self._files
        status = sc.status[:len(indices)]
        rec = timeline.enabled()
        times = np.zeros((len(indices), 4), np.int64) if rec else _NO_TIMES
        try:
            compiled_fill.fill_rows(dec.handle, files.names, files.starts, files.file_of, files.offsets,
                                    files.sizes, files.labels, indices, images, labels, row0, plan.box_kind,
                                    self._box_args, plan.flip_p, seed, epoch, self._address, self.lut,
                                    sc.filebuf, dec.pixel_buffer, cap_h, cap_w, *bufs, sc.ints, sc.clock,
                                    status, times)
        except Exception:  # not expected (its checks precede the kernel's): the slow way names it
            return list(range(len(indices)))
        if rec:
            offset = timeline.clock_offset()
            for k in np.flatnonzero(status == compiled_fill.OK):
                t0, t1, t2, t3 = (int(v) + offset for v in times[k])
                args = {"index": int(indices[k])}
                timeline.record("loader", "read", t0, t1, args=args)
                timeline.record("loader", "decode region", t1, t2)
                timeline.record("loader", "kernel", t2, t3)
        left = [int(k) for k in np.flatnonzero(status != compiled_fill.OK)]
        for k in left:
            if status[k] == compiled_fill.BIG_FILE:  # the next chunk reads such a file itself
                try:
                    size = files.size_of(int(indices[k]))
                except OSError:
                    continue
                if size >= sc.filebuf.size:
                    sc.filebuf = np.empty(max(size + 1, 2 * sc.filebuf.size), np.uint8)
        return left
