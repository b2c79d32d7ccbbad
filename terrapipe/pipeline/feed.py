"""Feeds: where the loader's threads write batches and how a batch reaches the consumer.

One interface, two implementations: :class:`HostFeed` (batches stay in host memory, handed out
as tensors over the slot buffers) and :class:`terrapipe.pipeline.device.DeviceFeed` (pinned
host slots copied to the GPU on a side stream). The epoch iterator drives either the same way
(NOTE [batch buffer ownership] in loader.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .shared_slots import SharedSlots
from .transforms import Plan

__all__ = ["Feed", "HostFeed", "host_batch", "Alloc"]

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


def host_batch(shape: tuple[int, int, int, int], np_dtype: np.dtype, torch_dtype: torch.dtype,
               channels_last: bool, alloc: Alloc = np.empty) -> tuple[torch.Tensor, np.ndarray]:
    """One host batch buffer: the torch tensor handed out (NCHW shape, channels_last strides if
    asked) and the NumPy view of the same memory pool threads write (kernel outputs take any
    strides, so the layout costs nothing). 16-bit floats are stored as their uint16 bits. ``alloc``
    makes the memory (``np.empty``'s signature; shared slots for a worker process)."""
    n, c, h, w = shape
    arr = alloc((n, h, w, c) if channels_last else shape, np_dtype)
    t = torch.from_numpy(arr)
    if torch_dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch_dtype)
    if channels_last:
        return t.permute(0, 3, 1, 2), arr.transpose(0, 3, 1, 2)
    return t, arr


class HostFeed(Feed):
    """Batches in host memory: ``ring`` slots of ``shape`` (N, C, H, W), written through the
    plan's table, handed out as views (NOTE [batch buffer ownership]); in ``shared`` (a worker
    process's slots) when given."""

    def __init__(self, ring: int, shape: Sequence[int], plan: Plan, channels_last: bool,
                 shared: SharedSlots | None = None) -> None:
        alloc = np.empty if shared is None else shared.empty
        self.lut = plan.lut
        self._images_t: list[torch.Tensor] = []
        self.images = []
        for _ in range(ring):
            t, a = host_batch(tuple(shape), self.lut.dtype, plan.torch_dtype, channels_last, alloc)
            self._images_t.append(t)
            self.images.append(a)
        self.labels = [alloc((shape[0],), np.int64) for _ in range(ring)]
        self._labels_t = [torch.from_numpy(a) for a in self.labels]

    def start_pass(self) -> None:
        pass  # nothing is queued beyond the pool's own work, which the iterator owns

    def slot_writable(self, slot: int) -> None:
        pass  # the consumer released the slot (the ring's rule); nothing else reads it

    def deliver(self, batch: int, slot: int, count: int,
                filled: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        filled()
        return self._images_t[slot][:count], self._labels_t[slot][:count]

    def copy_ahead(self, batch: int, slot: int, count: int) -> None:
        pass  # the batch already is where the consumer reads it

    def close(self) -> None:
        pass
