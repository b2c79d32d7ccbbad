"""Feeds: where the loader's threads write batches and how a batch reaches the consumer.

One interface, two implementations: :class:`HostFeed` (batches stay in host memory, handed out
as tensors over the slot buffers) and :class:`terrapipe.pipeline.device.DeviceFeed` (pinned
host slots copied to the GPU on a side stream). The epoch iterator drives either the same way
(NOTE [batch buffer ownership] in loader.py).
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .shared_slots import SharedSlots
from .transforms import Plan

__all__ = ["Feed", "HostFeed", "Alloc"]

# Makes a host slot's array (np.empty's signature): np.empty, or SharedSlots.empty.
Alloc = Callable[[tuple, np.dtype], np.ndarray]


class Feed(ABC):
    """Batch slots and their hand-out, driven from the thread that iterates the loader.

    images / labels: per slot, the NumPy views pool threads write: images (N, C, H, W) of
    ``lut``'s dtype in any strides, labels int64 (N,). lut: (C, 256), the table the per-sample
    kernel writes through (the host applies Normalize here; a device feed normalizes later).
    """

    images: list[np.ndarray]
    labels: list[np.ndarray]
    lut: np.ndarray
    # per host slot, the shared mapping its arrays live in (None: this process's own memory). A
    # slot that moves gets a new one, which a worker process is told of before the slot's next
    # batch (NOTE [batch buffer ownership] 3 in loader.py).
    mappings: list[SharedSlots | None]

    @abstractmethod
    def start_pass(self) -> None:
        """A new epoch iterator begins; whatever an abandoned one left queued is forgotten."""

    @abstractmethod
    def slot_writable(self, slot: int) -> None:
        """Block until nothing still reads host slot ``slot``, so pool threads may refill it."""

    @abstractmethod
    def deliver(self, batch: int, slot: int, count: int,
                filled: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``batch`` (``count`` rows of ``slot``) as the consumer's tensors. ``filled``
        blocks until every row is written (re-raising a worker's error); a feed calls it
        before anything reads the slot."""

    @abstractmethod
    def copy_ahead(self, batch: int, slot: int, count: int) -> None:
        """Batch ``batch`` is fully written: a feed may start moving it early."""

    @abstractmethod
    def close(self) -> None:
        """Wait for anything the feed still has in flight."""


def _as_batch(arr: np.ndarray, torch_dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    """``arr`` (N, C, H, W), or (N, H, W, C) when ``channels_last``, as the NCHW tensor handed
    out (channels_last strides if asked), sharing its memory and keeping ``arr`` (the object)
    alive. 16-bit floats are stored as their uint16 bits."""
    t = torch.from_numpy(arr)
    if torch_dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch_dtype)
    return t.permute(0, 3, 1, 2) if channels_last else t


class HostFeed(Feed):
    """Batches in host memory: ``ring`` slots of ``shape`` (N, C, H, W), written through the
    plan's table, handed out as views (NOTE [batch buffer ownership]); in ``shared`` (a worker
    process's slots) when given.

    A batch still referenced when its slot is about to be refilled (clause 3 of that NOTE: the
    consumer kept it past the next one, as ``list(loader)`` does) is never overwritten: the slot
    gets new buffers and the consumer keeps the old ones, as DataLoader's batches are kept. A
    shared slot moves to a mapping of its own (``mappings[slot]``), which the worker process maps
    before it writes the slot again. ``replaced`` counts the swaps.
    """

    def __init__(self, ring: int, shape: Sequence[int], plan: Plan, channels_last: bool,
                 shared: SharedSlots | None = None) -> None:
        self._shape = tuple(shape)
        self._torch_dtype, self._channels_last = plan.torch_dtype, channels_last
        self.lut = plan.lut
        # per slot: the kernels' views (workers index these lists), and the memory as allocated
        self.images, self.labels = [None] * ring, [None] * ring
        self._memory: list[tuple[np.ndarray, np.ndarray]] = [None] * ring
        self.mappings = [shared] * ring
        for slot in range(ring):
            self._allocate(slot, np.empty if shared is None else shared.empty)
        # per slot: weak references to the arrays its last hand-out's tensors keep alive
        self._handed: list[tuple[weakref.ref, weakref.ref] | None] = [None] * ring
        self.replaced = 0

    def _arrays(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of a slot's memory: images (NCHW, or NHWC when channels_last), labels."""
        n, c, h, w = self._shape
        images = (n, h, w, c) if self._channels_last else self._shape
        return [(images, self.lut.dtype), ((n,), np.dtype(np.int64))]

    def _allocate(self, slot: int, alloc: Alloc) -> None:
        """New memory for ``slot`` from ``alloc``, written in place into the lists the workers index."""
        (image_shape, dtype), (label_shape, _) = self._arrays()
        memory = alloc(image_shape, dtype)
        labels = alloc(label_shape, np.int64)
        self._memory[slot] = (memory, labels)
        # The kernels write NCHW views in any strides, so the layout costs them nothing.
        self.images[slot] = memory.transpose(0, 3, 1, 2) if self._channels_last else memory
        self.labels[slot] = labels

    def start_pass(self) -> None:
        pass  # nothing is queued beyond the pool's own work, which the iterator owns

    def slot_writable(self, slot: int) -> None:
        # The consumer released the slot by the ring's rule; whether it let go of the tensors
        # is told by the per-hand-out arrays they keep alive (a view of a view keeps them too).
        handed = self._handed[slot]
        if handed is None or (handed[0]() is None and handed[1]() is None):
            return
        self._handed[slot] = None
        if self.mappings[slot] is None:
            self._allocate(slot, np.empty)
        else:  # the worker process maps the new memory before it writes the slot again
            moved = SharedSlots(SharedSlots.size_of(self._arrays()),
                                purpose="a new batch slot (a batch is still held past the next, as "
                                        "list(loader) holds every batch)")
            self._allocate(slot, moved.empty)
            self.mappings[slot] = moved
        self.replaced += 1

    def deliver(self, batch: int, slot: int, count: int,
                filled: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        filled()
        # New array objects over the same memory, one pair per hand-out: what the handed
        # tensors (and any view of them) keep alive, so slot_writable can tell they are held.
        images, labels = (a.view() for a in self._memory[slot])
        self._handed[slot] = (weakref.ref(images), weakref.ref(labels))
        return (_as_batch(images, self._torch_dtype, self._channels_last)[:count],
                torch.from_numpy(labels)[:count])

    def copy_ahead(self, batch: int, slot: int, count: int) -> None:
        pass  # the batch already is where the consumer reads it

    def close(self) -> None:
        pass
