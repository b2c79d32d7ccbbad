"""Where a loader's per-sample work runs: the interface the epoch iterator drives, and its
in-process implementation, a thread pool (:class:`ThreadWorkers`). The other one runs the pool
in a worker process (:class:`terrapipe.pipeline.worker_process.ProcessWorkers`).

Both write batch ``b`` into host slot ``slot`` of the loader's feed, rows split in chunks of
``CHUNK`` samples, with the same :class:`~terrapipe.pipeline.samples.SampleWriter` code: the same
bytes whichever runs them (NOTE [batch buffer ownership] in loader.py says when a slot may be
written).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .samples import SampleWriter

__all__ = ["Workers", "ThreadWorkers", "CHUNK", "NICE", "lower_priority", "thread_pool", "submit_chunks",
           "cancel_and_wait"]

CHUNK = 8  # samples per task: amortises task overhead, still balances across threads

# NOTE [loader threads yield the CPU]
#     Feeding a GPU, loader threads run at a lower scheduling priority (nice + NICE, Linux, per
#     thread) than the thread that consumes batches. When the loader keeps up, the consumer never
#     waits for a batch, and whatever delays the consumer's own work (launching CUDA kernels, the
#     optimizer step) costs the whole training step; with every core decoding, an equal-priority
#     consumer gets one core's fair share among num_threads + 1 runnable threads. When the loader
#     falls behind, the consumer is blocked on a batch and the loader threads have every core
#     anyway. A worker process's threads do the same. Not on the CPU path: there the model's own
#     compute threads (OpenMP, which spin while idle) would take the loader's cores, and that
#     trade has not been measured.
NICE = 10


def lower_priority() -> None:
    """Lower the calling thread's priority by NICE (a thread pool's initializer)."""
    if hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
        except OSError:  # not permitted here: equal priority is still correct, only slower
            pass


def thread_pool(num_threads: int, nice: bool) -> ThreadPoolExecutor:
    """The pool that runs a loader's per-sample work (``nice``: NOTE [loader threads yield the
    CPU]), in the training process or in its worker process."""
    return ThreadPoolExecutor(num_threads, thread_name_prefix="terrapipe-loader",
                              initializer=lower_priority if nice else None)


def submit_chunks(pool: ThreadPoolExecutor, writer: SampleWriter, images: np.ndarray, labels: np.ndarray,
                  indices: np.ndarray, seed: int, epoch: int) -> list[Future]:
    """Queue one batch on ``pool``: ``writer.fill`` of ``images`` / ``labels`` (one slot's views)
    from ``indices``, CHUNK samples a task; the futures in row order."""
    return [pool.submit(writer.fill, images, labels, r, indices[r:r + CHUNK], seed, epoch)
            for r in range(0, len(indices), CHUNK)]


def cancel_and_wait(futures: list[Future]) -> None:
    """Cancel what has not started and wait for what has (its errors are the pass's end, not
    raised): once this returns, none of ``futures`` writes anything."""
    for f in futures:
        f.cancel()
    concurrent.futures.wait(futures)


class Workers(ABC):
    """Writes batches into the feed's host slots for one epoch iterator at a time.

    ``start_pass`` begins an iterator's pass; ``submit`` queues batch ``batch`` (rows
    ``indices`` of the epoch's order, augmented as (seed, epoch) draw them) into ``slot``;
    ``wait`` blocks until it is written and re-raises a worker's error
    (:class:`~terrapipe.pipeline.samples.SampleError` naming the sample); ``done`` says, without
    blocking, whether it is written without error; ``stop`` cancels the pass's queued batches and
    waits for running ones: once it returns nothing writes a slot. ``close`` ends the workers.
    """

    @abstractmethod
    def start_pass(self) -> None: ...

    @abstractmethod
    def submit(self, batch: int, slot: int, indices: np.ndarray, seed: int, epoch: int) -> None: ...

    @abstractmethod
    def wait(self, batch: int) -> None: ...

    @abstractmethod
    def done(self, batch: int) -> bool: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class ThreadWorkers(Workers):
    """A persistent pool of ``num_threads`` threads in this process, writing through ``writer``
    into ``images[slot]`` / ``labels[slot]`` (the feed's NumPy views). ``nice``: the threads
    yield the CPU to the consumer (NOTE [loader threads yield the CPU])."""

    def __init__(self, writer: SampleWriter, images: list[np.ndarray], labels: list[np.ndarray],
                 num_threads: int, nice: bool) -> None:
        self._writer = writer
        self._images, self._labels = images, labels
        self._pool = thread_pool(num_threads, nice)
        self._pending: dict[int, list[Future]] = {}

    def start_pass(self) -> None:
        self._pending = {}

    def submit(self, batch: int, slot: int, indices: np.ndarray, seed: int, epoch: int) -> None:
        self._pending[batch] = submit_chunks(self._pool, self._writer, self._images[slot], self._labels[slot],
                                             indices, seed, epoch)

    def wait(self, batch: int) -> None:
        for f in self._pending.pop(batch):
            f.result()  # re-raises a SampleError from a worker

    def done(self, batch: int) -> bool:
        fs = self._pending.get(batch)
        return bool(fs) and all(f.done() and f.exception() is None for f in fs)

    def stop(self) -> None:
        pending, self._pending = self._pending, {}
        cancel_and_wait([f for fs in pending.values() for f in fs])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
