"""The loader's device stage: pinned host batches -> device batches on a side stream.

NOTE [device feed streams]
    Pool threads fill *host* slots (pinned; uint8 when a Normalize is present). The thread that
    iterates the loader enqueues, on the loader's own side stream, each batch's copy from its
    host slot into one of ``DEVICE_RING`` device slots, then normalization on the device, and
    records that slot's ``copied`` event. Three fences, and never a device-wide
    ``torch.cuda.synchronize()``:

    * consumer waits for data: a batch is handed out after the consumer's current stream
      ``wait_event(copied[slot])``: a device-side wait, the Python thread goes on at once.
    * device slot reuse: the consumer owns a batch until its second request after it (the rule
      of NOTE [batch buffer ownership], counted over requests, across epochs and ``break``).
      Every request records ``mark`` on the stream current at that moment, after every kernel
      the consumer has enqueued so far; a copy into a slot that held a handed-out batch first
      waits on the latest ``mark``. A slot is chosen only once its batch is released, and one of
      the three always is: the consumer holds two, at most one more is copied ahead. Work the
      consumer moves to other streams is its own to fence (``record_stream`` serves the caching
      allocator; these buffers never go back to it).
    * host slot reuse: ``host_free[slot]`` is recorded after the copy out of a host slot; before
      pool threads may refill it the iterating thread waits on that one event. The copy was
      enqueued batches earlier, so this is almost never a real wait.

    The device staging buffer (uint8) and the float32 work buffer are touched only by the side
    stream, whose order makes one of each enough.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .. import launch_env, timeline
from ..cuda_host import register_host_memory, unregister_host_memory
from ..kernels import image as kimage
from .feed import Feed
from .shared_slots import SharedSlots
from .transforms import Plan

__all__ = ["DEVICE_RING", "resolve_device", "pick_cuda_index", "normalize_into",
           "SlotLedger", "DeviceFeed"]

# Device slots: the two batches the consumer may hold + one copied ahead.
DEVICE_RING = 3

def pick_cuda_index(index: int | None, device_count: int, local_rank: int | None, current: int) -> int:
    """The CUDA device a loader uses: ``index`` if given (checked against ``device_count``);
    else under a multi-process launch the local rank's GPU, round-robin when ranks outnumber
    GPUs (TorchMPI's rule); else the current device."""
    if device_count <= 0:
        raise RuntimeError("device: no CUDA device is visible to this process")
    if index is not None:
        if not 0 <= index < device_count:
            raise ValueError(f"device: cuda:{index} does not exist; this process sees {device_count} "
                             f"CUDA device(s)")
        return index
    if local_rank is not None:
        return local_rank % device_count
    return current


def resolve_device(device: str | torch.device) -> torch.device:
    """Check ``device`` ("cpu", "cuda", "cuda:N" or a torch.device) eagerly; a CUDA device gets
    its index filled in (:func:`pick_cuda_index`). Raises RuntimeError naming the device when
    CUDA is not usable here, ValueError for anything else unsupported."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a device ({exc})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: FastLoader feeds 'cpu' or 'cuda' devices, got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r}: CUDA is not available in this process (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}, "
            f"{torch.cuda.device_count()} device(s) visible); use device='cpu'")
    count = torch.cuda.device_count()
    return torch.device("cuda", pick_cuda_index(dev.index, count, launch_env.local_rank(),
                                                torch.cuda.current_device()))


def normalize_into(out: torch.Tensor, images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                   work: torch.Tensor | None = None) -> torch.Tensor:
    """``out = ((images / 255) - mean) / std`` with float32 arithmetic, rounded once to out's dtype.

    images: uint8 (N, C, H, W); out: (N, C, H, W) float32/float16/bfloat16, any memory format;
    mean, std: float32 broadcastable to (1, C, 1, 1), on the same device. work: float32 of
    out's shape and memory format, needed (and overwritten) when out is not float32. The steps
    and their order are those of :func:`terrapipe.kernels.image.build_normalize_lut`, so IEEE
    arithmetic on any device gives the CPU path's values bit for bit. Allocates nothing.
    """
    acc = out if out.dtype == torch.float32 else work
    if acc is None or acc.dtype != torch.float32 or acc.shape != out.shape:
        raise ValueError(f"work: a float32 buffer of shape {tuple(out.shape)} is needed for "
                         f"{out.dtype} output")
    acc.copy_(images)
    # Divided by a tensor, not the number 255: for a Python-number divisor PyTorch's CUDA kernel
    # multiplies by its float32 reciprocal, which rounds differently from the CPU path's true
    # division for some pixel values.
    acc.div_(_c255(acc.device))
    acc.sub_(mean)
    acc.div_(std)
    if acc is not out:
        out.copy_(acc)
    return out


_C255: dict[torch.device, torch.Tensor] = {}


def _c255(device: torch.device) -> torch.Tensor:
    c = _C255.get(device)
    if c is None:
        c = _C255[device] = torch.tensor(255.0, dtype=torch.float32, device=device)
    return c


class SlotLedger:
    """Which device slot a batch may be copied into (NOTE [device feed streams]); no CUDA here.

    A batch handed out at request r stays the consumer's until request r + 2. ``take`` returns
    a slot holding no such batch and no batch enqueued in this pass, and whether its last
    batch was handed out (so the copy must wait on the consumer's latest mark).
    """

    def __init__(self, slots: int = DEVICE_RING) -> None:
        self.requests = 0
        self.handed_at: list[int | None] = [None] * slots  # request that handed the slot's batch out
        self.pending: dict[int, int] = {}  # batch -> slot, enqueued in this pass, not handed out

    def start_pass(self) -> None:
        self.pending.clear()  # batches copied ahead by an abandoned pass are never handed out

    def request(self) -> None:
        self.requests += 1

    def is_enqueued(self, batch: int) -> bool:
        return batch in self.pending

    def take(self, batch: int) -> tuple[int, bool]:
        busy = set(self.pending.values())
        free = [d for d, h in enumerate(self.handed_at)
                if d not in busy and (h is None or h + 2 <= self.requests)]
        # A slot never handed out needs no wait on the consumer: prefer it.
        free.sort(key=lambda d: self.handed_at[d] is not None)
        if free:
            d = free[0]
            was_handed_out = self.handed_at[d] is not None
            self.pending[batch] = d
            self.handed_at[d] = None
            return d, was_handed_out
        raise AssertionError("device feed: no released slot (NOTE [device feed streams])")

    def hand_out(self, batch: int) -> int:
        d = self.pending.pop(batch)
        self.handed_at[d] = self.requests
        return d


class DeviceFeed(Feed):
    """Pinned host slots, device slots and the side stream that moves batches between them.

    Owned by one FastLoader and driven from the thread that iterates it (NOTE [device feed
    streams]); pool threads only write the NumPy views ``images`` / ``labels``.

    device: a resolved CUDA device; host_ring: number of host slots, which hold uint8 (N, C, H, W)
    batches (pool threads write through the identity table: uint8 crosses the bus); shape:
    (N, C, H, W) of a full batch; plan: gives the consumer's image dtype and the per-channel
    mean/std applied on the device; channels_last: the device images' memory format; shared: a
    worker process's slots to hold the host slots, which this feed pins (``cudaHostRegister``,
    undone at close), else torch's pinned memory.
    """

    def __init__(self, device: torch.device, host_ring: int, shape: Sequence[int], plan: Plan,
                 channels_last: bool, shared: SharedSlots | None = None) -> None:
        self.device = device
        out_dtype, norm = plan.torch_dtype, plan.norm
        self.lut = kimage.identity_lut(shape[1])
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        n = shape[0]
        self._registered = None
        # never moved: CUDA batches follow clause 2 of NOTE [batch buffer ownership]
        self.mappings = [shared] * host_ring
        if shared is None:
            self.host_images = [torch.empty(tuple(shape), dtype=torch.uint8, pin_memory=True)
                                for _ in range(host_ring)]
            self.host_labels = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(host_ring)]
        else:
            self.host_images = [torch.from_numpy(shared.empty(tuple(shape), np.uint8))
                                for _ in range(host_ring)]
            self.host_labels = [torch.from_numpy(shared.empty((n,), np.int64)) for _ in range(host_ring)]
            register_host_memory(shared.address, shared.nbytes)
            self._registered = shared.address
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.dev_images = [torch.empty(tuple(shape), dtype=out_dtype, device=device, memory_format=fmt)
                           for _ in range(DEVICE_RING)]
            self.dev_labels = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(DEVICE_RING)]
            # A direct copy needs the host layout and dtype on the device; otherwise stage uint8.
            direct = norm is None and not channels_last
            self.staging = None if direct else torch.empty(tuple(shape), dtype=torch.uint8, device=device)
            self.work = (torch.empty(tuple(shape), dtype=torch.float32, device=device, memory_format=fmt)
                         if norm is not None and out_dtype != torch.float32 else None)
            if norm is not None:
                self.mean = torch.tensor(norm[0], dtype=torch.float32, device=device).view(1, -1, 1, 1)
                self.std = torch.tensor(norm[1], dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.norm = norm is not None
        self.copied = [torch.cuda.Event() for _ in range(DEVICE_RING)]
        self.host_free = [torch.cuda.Event() for _ in range(host_ring)]
        self.mark = torch.cuda.Event()
        self.ledger = SlotLedger()
        # Set by a loader that decodes on the GPU: (slot, count) -> (k, device rows for batch
        # rows [k, count), their event) or None (NOTE [GPU decode share] in gpu_decode.py).
        self.device_part: Callable[[int, int], tuple[int, torch.Tensor, torch.cuda.Event] | None] | None
        self.device_part = None

        self.images = [t.numpy() for t in self.host_images]
        self.labels = [t.numpy() for t in self.host_labels]

    def start_pass(self) -> None:
        """A new iteration: batches copied ahead by an abandoned pass are never handed out."""
        self.ledger.start_pass()

    def slot_writable(self, slot: int) -> None:
        """Block until no enqueued copy still reads host slot ``slot`` (host slot reuse)."""
        self.host_free[slot].synchronize()

    def deliver(self, batch: int, slot: int, count: int,
                filled: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        self.request()
        if not self.is_enqueued(batch):
            filled()
            self.issue(batch, slot, count)
        return self.hand_out(batch, count)

    def copy_ahead(self, batch: int, slot: int, count: int) -> None:
        # The copy overlaps the consumer's step instead of waiting for its next request.
        if not self.is_enqueued(batch):
            self.issue(batch, slot, count)

    def request(self) -> None:
        """The consumer asks for its next batch: everything it enqueued so far is fenced."""
        self.ledger.request()
        self.mark.record(torch.cuda.current_stream(self.device))

    def is_enqueued(self, batch: int) -> bool:
        return self.ledger.is_enqueued(batch)

    def issue(self, batch: int, slot: int, count: int) -> None:
        """Enqueue batch ``batch`` (``count`` rows of host slot ``slot``) on the side stream."""
        d, was_handed_out = self.ledger.take(batch)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if was_handed_out:
                self.stream.wait_event(self.mark)
            out = self.dev_images[d][:count]
            part = self.device_part(slot, count) if self.device_part is not None else None
            k = count if part is None else part[0]  # rows [0, k) come from the host slot
            staged = out if self.staging is None else self.staging[:count]
            # On the timeline: the host's time to queue the copy and the normalize kernels (the
            # device runs them later on the side stream).
            with timeline.span("loader", "host-to-device copy queued", args={"batch": batch}):
                self.dev_labels[d][:count].copy_(self.host_labels[slot][:count], non_blocking=True)
                if k:
                    staged[:k].copy_(self.host_images[slot][:k], non_blocking=True)
                if part is not None:
                    _, rows, ready = part
                    self.stream.wait_event(ready)
                    staged[k:].copy_(rows)
                # After both copies: it fences the host slot and the GPU decoder's rows.
                self.host_free[slot].record(self.stream)
            if self.staging is not None:
                with timeline.span("loader", "device normalize queued", args={"batch": batch}):
                    if self.norm:
                        normalize_into(out, staged, self.mean, self.std,
                                       None if self.work is None else self.work[:count])
                    else:
                        out.copy_(staged)  # layout change only (channels_last)
            self.copied[d].record(self.stream)

    def hand_out(self, batch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``batch`` (enqueued) as device tensors, ordered after its copy on the current
        stream; owned by the consumer until its second request from now."""
        d = self.ledger.hand_out(batch)
        torch.cuda.current_stream(self.device).wait_event(self.copied[d])
        return self.dev_images[d][:count], self.dev_labels[d][:count]

    def close(self) -> None:
        """Wait for everything enqueued on the side stream (not the whole device); unpin
        memory this feed pinned."""
        self.stream.synchronize()
        if self._registered is not None:
            unregister_host_memory(self._registered)
            self._registered = None
