"""FastLoader: decode + augmentation on a persistent thread pool into a ring of batch buffers.

NOTE [batch buffer ownership]
    The loader owns ``prefetch + 2`` batch slots, allocated once. Batch ``b`` is written into
    slot ``b % ring`` by pool threads, each thread writing only the samples it was given (disjoint
    rows), and handed to the consumer once every write to it has finished. The consumer then
    owns that slot until it asks for batch ``b + 2``: at that point batch ``b + 2 + prefetch``
    may be submitted, which is the first batch to reuse slot ``b % ring``. So a yielded tensor
    stays valid while the consumer holds the next batch too, and ``copy=True`` yields tensors the
    caller owns outright. Scratch (resize weights, intermediate rows) is per thread.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .. import launch_env
from ..kernels import image as kimage
from . import decode, roi_jpeg
from .device import DeviceFeed, resolve_device
from .order import epoch_indices
from .sources import Source
from .transforms import Plan, compile_plan

__all__ = ["FastLoader", "SampleError"]

_CHUNK = 8  # samples per pool task: amortises task overhead, still balances across threads


class SampleError(RuntimeError):
    """A sample could not be read or decoded; the message names its index and path."""

    def __init__(self, index: int, where: str, cause: BaseException) -> None:
        super().__init__(f"sample {index} ({where}): {type(cause).__name__}: {cause}")
        self.index = index
        self.where = where


def _host_batch(shape: tuple[int, int, int, int], np_dtype: np.dtype, torch_dtype: torch.dtype,
                channels_last: bool) -> tuple[torch.Tensor, np.ndarray]:
    """One host batch buffer: the torch tensor handed out (NCHW shape, channels_last strides if
    asked) and the NumPy view of the same memory pool threads write (kernel outputs take any
    strides, so the layout costs nothing). 16-bit floats are stored as their uint16 bits."""
    n, c, h, w = shape
    arr = np.empty((n, h, w, c) if channels_last else shape, np_dtype)
    t = torch.from_numpy(arr)
    if torch_dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch_dtype)
    if channels_last:
        return t.permute(0, 3, 1, 2), arr.transpose(0, 3, 1, 2)
    return t, arr


# NOTE [loader threads yield the CPU]
#     Feeding a GPU, loader threads run at a lower scheduling priority (nice + _NICE, Linux, per
#     thread) than the thread that consumes batches. When the loader keeps up, the consumer never
#     waits for a batch, and whatever delays the consumer's own work (launching CUDA kernels, the
#     optimizer step) costs the whole training step; with every core decoding, an equal-priority
#     consumer gets one core's fair share among num_threads + 1 runnable threads. When the loader
#     falls behind, the consumer is blocked on a batch and the loader threads have every core
#     anyway. Measured on 16 vCPUs, ResNet-50 AMP fed by 16 loader threads: see the README.
#     Not on the CPU path: there the model's own compute threads (OpenMP, which spin while idle)
#     would take the loader's cores, and that trade has not been measured.
_NICE = 10


def _yield_cpu_to_the_consumer() -> None:
    if hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _NICE))
        except OSError:  # not permitted here: equal priority is still correct, only slower
            pass


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.bufs: tuple[np.ndarray, ...] = ()
        self.jpeg: roi_jpeg.RoiDecoder | None = None

    def roi_decoder(self) -> roi_jpeg.RoiDecoder:
        if self.jpeg is None:
            self.jpeg = roi_jpeg.RoiDecoder()
        return self.jpeg

    def get(self, h: int, w: int, out_h: int, out_w: int, c: int) -> tuple[np.ndarray, ...]:
        # Grown to the largest source this thread has seen; reused afterwards.
        k = self.key
        if not k or h > k[0] or w > k[1] or (out_h, out_w, c) != k[2:]:
            h, w = max(h, k[0] if k else 0), max(w, k[1] if k else 0)
            self.bufs = kimage.alloc_resize_scratch(h, w, out_h, out_w, c)
            self.key = (h, w, out_h, out_w, c)
        return self.bufs


class FastLoader:
    """Drop-in for ``torch.utils.data.DataLoader`` over a terrapipe source.

    Yields ``(images, labels)``: images (N, C, H, W) (float per ``Normalize``, else uint8;
    ``channels_last=True`` gives channels-last strides), labels int64 (N,), on ``device``.
    Yielded tensors are views of reused buffers (NOTE [batch buffer ownership]); pass
    ``copy=True`` for owned tensors. Augmentation is a pure function of (seed, epoch, sample
    index), so any ``num_threads`` gives the same bytes.

    ``device="cuda"`` / ``"cuda:N"`` (default index under a multi-process launch: the local
    rank's GPU, round-robin): host buffers are pinned, uint8 crosses the bus on a side stream and
    Normalize runs on the device; the consumer's current stream is made to wait for each batch,
    never the host (NOTE [device feed streams]). Without usable CUDA this raises at construction.
    """

    def __init__(
        self,
        dataset: Source,
        transforms: Sequence[object] = (),
        *,
        batch_size: int = 256,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        num_threads: int | None = None,
        prefetch: int = 3,
        device: str | torch.device = "cpu",
        channels_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: str = "raise",
        copy: bool = False,
    ) -> None:
        for attr in ("__len__", "read", "describe"):
            if not hasattr(dataset, attr):
                raise TypeError(f"dataset: a source needs {attr} (see terrapipe.pipeline.sources)")
        if len(dataset) == 0:
            raise ValueError("dataset: the dataset is empty")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.device = resolve_device(device)
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {num_threads}")
        r0, w0 = launch_env.world()
        self.rank = r0 if rank is None else int(rank)
        self.world_size = w0 if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.num_threads = int(num_threads)
        self.prefetch = int(prefetch)
        self.on_error = on_error
        self.copy = copy
        self.epoch = 0
        self.skipped: list[tuple[int, str, str]] = []  # (index, where, error) under "skip"
        self._skip_lock = threading.Lock()
        self._resume_batch = 0
        self._next_batch = 0

        first, _ = dataset.read(0)
        channels = 1 if (isinstance(first, np.ndarray) and first.ndim == 2) else (
            first.shape[2] if isinstance(first, np.ndarray) else 3)
        self.plan: Plan = compile_plan(list(transforms), channels)
        if self.plan.out_hw is None:
            if not isinstance(first, np.ndarray):
                raise ValueError("transforms: encoded images need a crop/resize so batches have one size")
            self.plan.out_hw = (first.shape[0], first.shape[1])
        oh, ow = self.plan.out_hw
        ring = self.prefetch + 2
        self.channels_last = bool(channels_last)
        shape = (batch_size, channels, oh, ow)
        self._feed: DeviceFeed | None = None
        if self.device.type == "cuda":
            # uint8 crosses the bus; Normalize runs on the device (NOTE [device feed streams]).
            self._lut = kimage.identity_lut(channels)
            self._feed = DeviceFeed(self.device, ring, shape, self.plan.torch_dtype, self.plan.norm,
                                    self.channels_last)
            self._images, self._labels = self._feed.host_views()
        else:
            self._lut = self.plan.lut
            self._images_t, self._images = [], []
            for _ in range(ring):
                t, a = _host_batch(shape, self._lut.dtype, self.plan.torch_dtype, self.channels_last)
                self._images_t.append(t)
                self._images.append(a)
            self._labels = [np.empty(batch_size, np.int64) for _ in range(ring)]
            self._labels_t = [torch.from_numpy(a) for a in self._labels]
        self._scratch = _Scratch()
        self._roi = roi_jpeg.enabled()
        self._pool = ThreadPoolExecutor(
            self.num_threads, thread_name_prefix="terrapipe-loader",
            initializer=_yield_cpu_to_the_consumer if self._feed is not None else None)
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=True, cancel_futures=True)
        self._closed = False

    # -- order ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _indices(self) -> np.ndarray:
        return epoch_indices(len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle,
                             rank=self.rank, world_size=self.world_size)

    def _per_rank(self) -> int:
        return math.ceil(len(self.dataset) / self.world_size)

    def __len__(self) -> int:
        n = self._per_rank()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict:
        """Where iteration stands: resuming skips the batches already yielded, without decoding."""
        return {"epoch": self.epoch, "batch": self._next_batch, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != len(self.dataset) or state["world_size"] != self.world_size:
            raise ValueError("state_dict: saved for a different dataset size or world size")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._resume_batch = int(state["batch"])

    # -- per-sample work (pool threads) -------------------------------------------------------
    def _decode_into(self, index: int, out: np.ndarray) -> int:
        payload, label = self.dataset.read(index)
        plan = self.plan
        oh, ow = plan.out_hw
        # Each path gives the pixels ``arr`` holding [ox, ox + W) x [oy, oy + H) of an
        # img_w x img_h image (the whole of it but for the region decoder), and the box in it.
        if isinstance(payload, np.ndarray):
            arr = payload if payload.ndim == 3 else payload[:, :, None]
            ox = oy = 0
            img_h, img_w = arr.shape[:2]
            box = plan.box(img_w, img_h, self.seed, self.epoch, index)
        else:
            region = None
            if self._roi:
                # libjpeg-turbo decodes only what the crop reads, without the GIL; anything it
                # declines (not a JPEG, CMYK, corrupt data) goes to Pillow below.
                dec = self._scratch.roi_decoder()
                size = dec.header(payload)
                if size is not None:
                    region = dec.decode(plan.box(*size, self.seed, self.epoch, index), plan.out_hw)
            if region is not None:
                arr, ox, oy, img_w, img_h, box = region
            else:
                im = decode.open_image(payload)
                w, h = im.size
                box = decode.draft_box(im, plan.box(w, h, self.seed, self.epoch, index), plan.out_hw)
                arr, keepalive = decode.pixels(im)  # noqa: F841 (arr may point into Pillow's memory)
                ox = oy = 0
                img_h, img_w = arr.shape[:2]
        if arr.shape[2] < plan.channels:
            raise ValueError(f"expected {plan.channels} channels, got image of shape {arr.shape}")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        scratch = self._scratch.get(arr.shape[0], arr.shape[1], oh, ow, arr.shape[2])
        flip = plan.flip(self.seed, self.epoch, index)
        kimage.resize_crop_bilinear_region(arr, ox, oy, img_w, img_h, box[0], box[1], box[2], box[3], out,
                                           self._lut, flip, *scratch)
        return label

    def _fill(self, slot: int, row0: int, indices: np.ndarray) -> None:
        images, labels = self._images[slot], self._labels[slot]
        n = len(self.dataset)
        for k, index in enumerate(indices):
            index = int(index)
            try:
                labels[row0 + k] = self._decode_into(index, images[row0 + k])
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
                        labels[row0 + k] = self._decode_into(alt, images[row0 + k])
                        break
                    except Exception:
                        continue
                else:
                    raise err from exc

    def _submit(self, slot: int, batch_indices: np.ndarray) -> list[Future]:
        return [self._pool.submit(self._fill, slot, r, batch_indices[r:r + _CHUNK])
                for r in range(0, len(batch_indices), _CHUNK)]

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._closed:
            raise RuntimeError("FastLoader is closed")
        indices = self._indices()
        nb = len(self)
        start = self._resume_batch
        self._resume_batch = 0
        ring = self.prefetch + 2
        pending: dict[int, list[Future]] = {}

        feed = self._feed
        if feed is not None:
            feed.start_pass()

        def submit(b: int) -> None:
            if b < nb and b not in pending:
                if feed is not None:
                    feed.host_slot_writable(b % ring)
                pending[b] = self._submit(b % ring, indices[b * self.batch_size:(b + 1) * self.batch_size])

        def rows(b: int) -> int:
            return min(self.batch_size, len(indices) - b * self.batch_size)

        try:
            for b in range(start, nb):
                for ahead in range(b, b + self.prefetch + 1):
                    submit(ahead)
                futures = pending.pop(b)
                slot = b % ring
                count = rows(b)
                if feed is None:
                    for f in futures:
                        f.result()  # re-raises a SampleError from a worker
                    images, labels = self._images_t[slot][:count], self._labels_t[slot][:count]
                else:
                    feed.request()
                    if not feed.is_enqueued(b):
                        for f in futures:
                            f.result()
                        feed.issue(b, slot, count)
                    images, labels = feed.hand_out(b, count)
                    # Copy the next batch ahead if its samples are already decoded, so the copy
                    # overlaps the consumer's step; a failed one is left to raise in its turn.
                    nxt = pending.get(b + 1)
                    if nxt and all(f.done() and f.exception() is None for f in nxt):
                        feed.issue(b + 1, (b + 1) % ring, rows(b + 1))
                self._next_batch = b + 1
                if self.copy:
                    images, labels = images.clone(), labels.clone()
                yield images, labels
            self._next_batch = 0
        finally:
            # Nothing may still write a slot once iteration ends (break, error, Ctrl-C, GC).
            for fs in pending.values():
                for f in fs:
                    f.cancel()
            for fs in pending.values():
                for f in fs:
                    if not f.cancelled():
                        try:
                            f.result()
                        except Exception:
                            pass

    def close(self) -> None:
        """Stop the pool; no loader thread survives this call, and no copy is left in flight."""
        self._closed = True
        self._finalizer()
        if self._feed is not None:
            self._feed.drain()

    def __enter__(self) -> FastLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
