"""Decoding a share of each batch on the GPU: nvJPEG (through torchvision), then the plan's crop,
resample and flip on the device (:mod:`.device_resample`), for ``FastLoader(decode="gpu" |
"auto")``.

NOTE [GPU decode share]
    1. Every batch is split: rows [0, k) go to the loader's workers (threads or the worker
       process) as on the CPU path; rows [k, count) to one GPU decode thread in the training
       process, the process that owns the device (:class:`SplitWorkers`).
    2. The GPU decode thread reads each of its samples (``source.read``), decodes the JPEGs in
       one batched nvJPEG call on its own stream, crops, resamples and flips them into the
       device rows it keeps for that host slot, records the slot's ``ready`` event, and writes
       the labels into the host slot's label rows (:class:`GpuDecoder`).
    3. What nvJPEG declines (not a JPEG, an array sample, CMYK, a read or decode error) goes
       through the CPU path's :class:`~terrapipe.pipeline.samples.SampleWriter` on that thread
       and is uploaded: a corrupt file raises the same SampleError naming it, or is replaced
       under ``on_error="skip"``, as on the CPU path.
    4. The device feed copies host rows [0, k) and, after waiting for ``ready`` on its side
       stream, device rows [k, count) into the batch, then normalizes the whole batch once
       (NOTE [device feed streams] in device.py). ``host_free[slot]``, recorded after both
       copies, fences the device rows too: the iterator waits for it before it submits the
       slot's next batch, so the decode thread never overwrites rows still being copied.
    5. ``decode="gpu"``: k = 0 for every batch. ``decode="auto"``: k starts at count (all on
       the CPU) and moves by :attr:`DecodeShare.step` rows at each batch the consumer asks
       for: towards the GPU when the CPU's rows were the last to be ready, back when the GPU's
       were; by one row back when both were ready (the loader is ahead, and the GPU's time is
       the trainer's). So the GPU takes the share by which the CPU falls behind, and the two
       decode rates add up. Batches submitted ahead keep the split they were given.
    6. Values: the order, crops and flips are the CPU path's (drawn from (seed, epoch, sample)).
       Pixels differ by decoder (nvJPEG's IDCT and chroma upsampling against libjpeg-turbo's,
       and no DCT-scaled decode, which the CPU path uses when the crop allows) and by rounding
       (NOTE [resampling by matrix products] in device_resample.py); docs/loader.md gives the
       measured differences. With ``"auto"`` which rows the GPU decodes depends on timing, so
       batches are not reproducible bit for bit; ``"cpu"`` and ``"gpu"`` are.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .. import timeline
from .device_resample import resample_into
from .samples import SampleWriter
from .sources import Source
from .transforms import Plan
from .workers import Workers, cancel_and_wait

__all__ = ["DECODE", "DecodeShare", "GpuDecoder", "SplitWorkers", "nvjpeg_decoder"]

DECODE = ("cpu", "gpu", "auto")

# A batched decode: N encoded JPEGs (1-D uint8 CPU tensors) -> N uint8 (3, H, W) device tensors.
DecodeFn = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]


def nvjpeg_decoder(device: torch.device) -> DecodeFn:
    """torchvision's batched nvJPEG decode to RGB on ``device``, checked once on a tiny JPEG so
    a torchvision without nvJPEG fails here, naming the reason, not at the first batch."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as exc:
        raise RuntimeError(f"decode='gpu'/'auto' needs torchvision (its nvJPEG decoder), which does "
                           f"not import here: {exc}") from None

    def decode(data: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    from PIL import Image

    probe = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 90)).save(probe, "JPEG")
    try:
        decode([torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8)])
    except Exception as exc:
        raise RuntimeError(f"decode='gpu'/'auto': torchvision's GPU JPEG decoder failed on {device} "
                           f"({type(exc).__name__}: {exc})") from None
    return decode


def _is_jpeg(payload) -> bool:
    """A JPEG with an end-of-image marker after its start. nvJPEG may decode a truncated file
    from what it has; without the marker the sample goes to the CPU path, which names the
    truncation (Pillow's error, as pipeline/_jpeg.c's check leaves it)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return False
    data = bytes(payload) if isinstance(payload, memoryview) else payload
    return data[:3] == b"\xff\xd8\xff" and data.rfind(b"\xff\xd9") > 2


class DecodeShare:
    """How many rows of each batch the GPU decodes (NOTE [GPU decode share], clause 5).

    mode: "gpu" (every row) or "auto"; batch_size: the loader's. ``rows(count)`` is the GPU's
    share of a batch of ``count`` rows; ``observe(late)`` moves it after a batch was asked for:
    late is "cpu", "gpu", or None when both parts were ready. ``rows_total`` /
    ``gpu_rows_total`` count what was dealt, for reports.
    """

    def __init__(self, mode: str, batch_size: int) -> None:
        if mode not in ("gpu", "auto"):
            raise ValueError(f"DecodeShare: mode must be 'gpu' or 'auto', got {mode!r}")
        self.mode = mode
        self.batch_size = batch_size
        self.gpu_rows = batch_size if mode == "gpu" else 0
        self.step = max(1, batch_size // 16)
        self.rows_total = 0
        self.gpu_rows_total = 0

    def rows(self, count: int) -> int:
        g = min(count, self.gpu_rows)
        self.rows_total += count
        self.gpu_rows_total += g
        return g

    def observe(self, late: str | None) -> None:
        if self.mode != "auto":
            return
        if late == "cpu":
            self.gpu_rows = min(self.batch_size, self.gpu_rows + self.step)
        elif late == "gpu":
            self.gpu_rows = max(0, self.gpu_rows - self.step)
        else:
            self.gpu_rows = max(0, self.gpu_rows - 1)

    @property
    def fraction(self) -> float:
        """The share of rows dealt to the GPU so far."""
        return self.gpu_rows_total / self.rows_total if self.rows_total else 0.0


class GpuDecoder:
    """One thread decoding rows of batches on ``device`` (NOTE [GPU decode share], clauses 2-4).

    dataset, plan: the loader's; rows_shape: (N, C, H, W) of a full batch; ring: host slots;
    labels: the feed's host label slots (NumPy int64 (N,), written here for the rows decoded
    here); writer: the CPU path for what nvJPEG declines (identity table: uint8 rows);
    decode: the batched decoder (:func:`nvjpeg_decoder`; another one for tests).
    Owns ``ring`` device row buffers uint8 (N, C, H, W) and one event per slot.
    """

    def __init__(self, dataset: Source, plan: Plan, device: torch.device, rows_shape: tuple[int, ...],
                 ring: int, labels: list[np.ndarray], writer: SampleWriter, decode: DecodeFn) -> None:
        self.dataset = dataset
        self.plan = plan
        self.device = device
        self._labels = labels
        self._writer = writer
        self._decode = decode
        cuda = device.type == "cuda"
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            self.stream = torch.cuda.Stream(device) if cuda else None
            self.rows = [torch.empty(tuple(rows_shape), dtype=torch.uint8, device=device)
                         for _ in range(ring)]
        self.ready = [torch.cuda.Event() if cuda else None for _ in range(ring)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="terrapipe-gpu-decode")

    def submit(self, slot: int, indices: np.ndarray, row0: int, seed: int, epoch: int) -> Future:
        """Queue rows ``row0 ..`` of slot ``slot`` from ``indices``; device rows 0.. hold them."""
        return self._pool.submit(self._run, slot, np.asarray(indices), row0, seed, epoch)

    def _streams(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _decode_many(self, payloads: list) -> list[torch.Tensor | None]:
        if not payloads:
            return []
        # Two torch calls for the whole batch, not one per sample (NOTE [resampling by matrix
        # products], clause 2, in device_resample.py says why the count matters).
        flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        data = list(torch.split(flat, [len(p) for p in payloads]))
        try:
            return list(self._decode(data))
        except Exception:
            pass
        # The batch failed: find which samples nvJPEG declines; they go to the CPU path.
        out: list[torch.Tensor | None] = []
        for d in data:
            try:
                out.append(self._decode([d])[0])
            except Exception:
                out.append(None)
        return out

    def _run(self, slot: int, indices: np.ndarray, row0: int, seed: int, epoch: int) -> None:
        plan = self.plan
        labels = self._labels[slot]
        rows = self.rows[slot]
        c = rows.shape[1]
        jpeg_rows, payloads, cpu_rows = [], [], []
        with timeline.span("loader", "gpu decode read", args={"rows": len(indices)}):
            for r, index in enumerate(indices):
                try:
                    payload, label = self.dataset.read(int(index))
                except Exception:
                    cpu_rows.append(r)  # the CPU path reads it again and names the failure
                    continue
                if _is_jpeg(payload):
                    jpeg_rows.append(r)
                    payloads.append(payload)
                    labels[row0 + r] = label
                else:
                    cpu_rows.append(r)
        with self._streams(), timeline.span("loader", "gpu decode queued", args={"rows": len(indices)}):
            ok = []
            for r, im in zip(jpeg_rows, self._decode_many(payloads), strict=True):
                if im is not None and im.dim() == 3 and im.shape[0] >= c:
                    ok.append((r, im))
                else:
                    cpu_rows.append(r)
            if ok:
                boxes = np.array([plan.box(im.shape[2], im.shape[1], seed, epoch, int(indices[r]))
                                  for r, im in ok], dtype=np.float64)
                flips = np.array([plan.flip(seed, epoch, int(indices[r])) for r, _ in ok], dtype=np.bool_)
                where = [r for r, _ in ok]
                if where == list(range(len(where))):
                    resample_into([im for _, im in ok], boxes, flips, rows[:len(where)])
                else:
                    tmp = torch.empty((len(where), *rows.shape[1:]), dtype=torch.uint8, device=self.device)
                    resample_into([im for _, im in ok], boxes, flips, tmp)
                    rows.index_copy_(0, torch.tensor(where, device=self.device), tmp)
            if cpu_rows:
                cpu_rows.sort()
                host = np.empty((len(cpu_rows), *rows.shape[1:]), np.uint8)
                host_labels = np.empty(len(cpu_rows), np.int64)
                self._writer.fill(host, host_labels, 0, indices[cpu_rows], seed, epoch)
                for j, r in enumerate(cpu_rows):
                    rows[r].copy_(torch.from_numpy(host[j]))
                    labels[row0 + r] = host_labels[j]
            if self.stream is not None:
                self.ready[slot].record(self.stream)

    def device_rows(self, slot: int, count: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The first ``count`` device rows of ``slot`` and the event after which they hold them."""
        return self.rows[slot][:count], self.ready[slot]

    def close(self) -> None:
        """End the thread (queued batches are cancelled) and wait for its queued device work."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.stream is not None:
            self.stream.synchronize()


class SplitWorkers(Workers):
    """The loader's workers and a :class:`GpuDecoder` sharing each batch (NOTE [GPU decode
    share]): rows [0, k) to ``cpu``, the rest to ``gpu``, k from ``share``.
    :meth:`device_part` tells the device feed where a slot's GPU rows are."""

    def __init__(self, cpu: Workers, gpu: GpuDecoder, share: DecodeShare) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.share = share
        self._parts: dict[int, tuple[bool, Future | None]] = {}
        self._split: dict[int, int] = {}  # slot -> k of the batch last submitted into it

    def start_pass(self) -> None:
        self.cpu.start_pass()
        self._parts = {}

    def submit(self, batch: int, slot: int, indices: np.ndarray, seed: int, epoch: int) -> None:
        count = len(indices)
        k = count - self.share.rows(count)
        if k:
            self.cpu.submit(batch, slot, indices[:k], seed, epoch)
        fut = self.gpu.submit(slot, indices[k:], k, seed, epoch) if k < count else None
        self._parts[batch] = (k > 0, fut)
        self._split[slot] = k

    def device_part(self, slot: int, count: int) -> tuple[int, torch.Tensor, torch.cuda.Event | None] | None:
        """(k, device rows for batch rows [k, count), their event), or None: no GPU rows."""
        k = self._split.get(slot, count)
        if k >= count:
            return None
        rows, ready = self.gpu.device_rows(slot, count - k)
        return k, rows, ready

    def wait(self, batch: int) -> None:
        has_cpu, fut = self._parts.pop(batch)
        cpu_ready = not has_cpu or self.cpu.done(batch)
        gpu_ready = fut is None or fut.done()
        if has_cpu:
            self.cpu.wait(batch)
        gpu_after_cpu = fut is not None and not fut.done()
        if fut is not None:
            fut.result()  # re-raises a SampleError from the decode thread
        if cpu_ready and gpu_ready:
            self.share.observe(None)
        else:
            self.share.observe("gpu" if gpu_after_cpu or not has_cpu else "cpu")

    def done(self, batch: int) -> bool:
        part = self._parts.get(batch)
        if part is None:
            return False
        has_cpu, fut = part
        gpu_done = fut is None or (fut.done() and fut.exception() is None)
        return gpu_done and (not has_cpu or self.cpu.done(batch))

    def stop(self) -> None:
        parts, self._parts = self._parts, {}
        try:
            self.cpu.stop()
        finally:
            cancel_and_wait([f for _, f in parts.values() if f is not None])

    def close(self) -> None:
        try:
            self.cpu.close()
        finally:
            self.gpu.close()
