"""FastLoader: decode + augmentation on a persistent thread pool into a ring of batch buffers.

NOTE [one iterator per epoch]
    ``iter(loader)`` creates an :class:`_EpochIterator` (torch's ``_BaseDataLoaderIter`` plays
    the same part). It captures, when created:
    1. the epoch, seed and sample order (``set_epoch`` or ``load_state_dict`` afterwards affect
       the next iterator, never a running one);
    2. the resume point (``load_state_dict``'s batch, consumed by this iterator);
    3. the loader's slots: pool threads receive (seed, epoch) as arguments and never read the
       loader's attributes, so nothing they compute can change under them.
    Only one iterator over a loader is live at a time: a second ``iter()`` while the first is
    neither exhausted nor closed raises, because both would write the same batch slots. An
    iterator ends (and frees the slots) when exhausted, when ``close()``d, when it raises, or
    when it is garbage collected (``break`` out of a ``for`` loop drops the last reference).

NOTE [batch buffer ownership]
    1. The loader owns ``prefetch + 2`` batch slots, allocated once. Batch ``b`` of a pass is
       written into slot ``(base + b) % ring`` (``base``: the batches the loader's earlier
       passes yielded, so the slot sequence runs on from pass to pass, NOTE [the next epoch's
       first batches]) by pool threads, each thread writing only the samples it was given
       (disjoint rows), and handed to the consumer once every write to it has finished.
       Scratch (resize weights, intermediate rows) is per thread.
    2. The consumer owns that slot until it asks for batch ``b + 2``: at that point batch
       ``b + 2 + prefetch`` may be submitted, which is the first batch to reuse its slot. So a
       yielded tensor stays valid while the consumer holds the next batch too, which is all a
       training loop does, and ``copy=True`` yields tensors the caller owns outright.
    3. A consumer that keeps batches longer (``list(loader)``, a validation loop collecting its
       inputs) keeps them intact with host batches and thread workers: each hand-out's tensors
       keep alive an array made for that hand-out, and a slot whose last hand-out is still
       alive when it is to be refilled gets new memory instead (HostFeed.slot_writable), so the
       kept batch is the consumer's, as DataLoader's batches are. A loop that lets go costs
       nothing but that array. A shared slot (``workers="process"``) moves to a mapping of its
       own, which the worker process is handed before it writes that slot again (NOTE [the
       loader's worker process] 3); the kept batch holds the old memory until it is let go.
       CUDA batches follow clause 2 (NOTE [device feed streams] in pipeline/device.py).

NOTE [the next epoch's first batches]
    1. Why: an iterator that starts with an empty pipeline makes its consumer wait for a whole
       batch's decode, and a GPU idles meanwhile. Measured with a consumer slower than the
       loader (it sleeps 0.25 s per batch, 2 threads, real photographs, batch 128, 2-core Xeon):
       0.3 ms of waiting per batch inside an epoch, 140 ms at each epoch's first batch; with
       epochs of two batches the consumer waited 31% of the time. At 25 batches an epoch and
       a step as long as a batch's decode, that is about 4% of a training run.
    2. So an iterator whose remaining batches are all submitted goes on submitting, with the
       same look-ahead (``prefetch``) and the same slot sequence, the first batches of the pass
       it expects next: the next epoch's (the current one's, when the last two passes ran the
       same epoch), from its start, at the same rank, world size and seed. The slot sequence
       continuing, NOTE [batch buffer ownership] holds across the boundary as within a pass.
    3. The next ``iter()`` takes those batches over when its pass is that one (epoch, seed,
       rank, world size, from the start); otherwise (``set_epoch`` to another epoch,
       ``set_world``, ``load_state_dict``) they are cancelled first and the pass starts empty,
       as it always did. The bytes are the same either way: a batch is a function of its
       indices, seed and epoch (NOTE [one iterator per epoch] 3).
    4. A pass stopped early (``break``, ``close()``, an error) cancels them with its own, and
       ``cancel_ahead()`` does between passes (a benchmark that alternates loaders times each
       pass from an empty pipeline; begun batches would be decoded in another case's time).
       After the last epoch up to ``prefetch + 1`` batches are decoded for nothing. Under
       ``on_error="skip"`` nothing is submitted ahead: a cancelled batch would have added its
       bad samples to ``skipped`` for a pass that never ran.

NOTE [resume at any world size]
    1. An epoch's order is the permutation of ``(seed, epoch)`` (or 0..n-1), read
       DistributedSampler's way at world size W: global position ``r + W * i`` is rank r's i-th
       sample. Data-parallel ranks stop at the same step k, so after k batches of B every rank
       has consumed the same prefix of that order: ``consumed = k * B * W`` samples. That one
       number, with the epoch and seed, is the state; any rank's ``state_dict()`` holds it.
    2. A loader at world size V that loads it deals ``order[consumed:]`` the same way at V
       (:func:`~terrapipe.pipeline.order.epoch_indices`'s ``start``), padded by wrap-around from
       the order's beginning with at most V - 1 samples, so every rank yields the same number of
       samples and batches. At V = W this is exactly the rest of the uninterrupted pass.
    3. Augmentation is keyed by (seed, epoch, sample index), never by rank or position, so each
       sample's bytes are those of the uninterrupted run.
    4. A resumed pass counts its own consumption from its start, so a checkpoint taken inside
       it resumes again, at yet another world size. The next epoch is an ordinary one.

Why one module: FastLoader and its per-epoch iterator share the slot protocol described
above; the decode, transforms, sources and device copy live in their own modules.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .. import launch_env, timeline
from .device import DeviceFeed, resolve_device
from .feed import Feed, HostFeed
from .gpu_decode import DECODE, DecodeShare, GpuDecoder, SplitWorkers, nvjpeg_decoder
from .order import epoch_indices
from .samples import SampleError, SampleWriter
from .shared_slots import SharedSlots
from .sources import Source, TorchDataset
from .transforms import Plan, Transform, compile_plan
from .worker_process import ProcessWorkers
from .workers import ThreadWorkers, Workers

__all__ = ["FastLoader", "SampleError"]

WORKERS = ("threads", "process")


class FastLoader:
    """Drop-in for ``torch.utils.data.DataLoader`` over a terrapipe source.

    dataset: a source (``ImageFolder``, ``TarShards``, ``ArrayDataset``, anything with
    ``__len__``, ``read`` and ``describe``), or a map-style ``torch.utils.data.Dataset``, which
    is wrapped in :class:`~terrapipe.pipeline.TorchDataset` (its ``__getitem__`` then runs on the
    loader's threads).

    Yields ``(images, labels)``: images (N, C, H, W) (float per ``Normalize``, else uint8;
    ``channels_last=True`` gives channels-last strides), labels int64 (N,), on ``device``.
    Yielded tensors are views of reused buffers, valid while the next batch is held too (NOTE
    [batch buffer ownership]); host batches that are kept longer are never overwritten, with
    either kind of ``workers`` (clause 3). Pass ``copy=True`` for owned tensors. Augmentation is a pure
    function of (seed, epoch, sample index), so any ``num_threads`` gives the same bytes. Each
    ``iter()`` is one epoch's iterator (NOTE [one iterator per epoch]); the first batches of the
    next one (the next epoch, as a loop of ``set_epoch(epoch)`` runs them) are begun while the
    consumer takes this one's last batches, and cancelled if another pass comes instead (NOTE
    [the next epoch's first batches]).

    ``device="cuda"`` / ``"cuda:N"`` (default index under a multi-process launch: the local
    rank's GPU, round-robin): host buffers are pinned, uint8 crosses the bus on a side stream and
    Normalize runs on the device; the consumer's current stream is made to wait for each batch,
    never the host (NOTE [device feed streams]). Without usable CUDA this raises at construction.

    ``workers="threads"`` (default; ``"thread"`` is the same) runs the per-sample work on
    ``num_threads`` threads of this process. ``workers="process"`` runs them in one worker process
    (started with spawn; the dataset and transforms must be picklable) that writes batches into
    slots in shared memory, which this process maps once and, with ``device="cuda"``, pins
    (``cudaHostRegister``): the training process keeps only the copy to the device and a few
    microseconds per batch, and none of the loader's Python competes with it for the GIL. Same
    batches bit for bit, same ``state_dict``; ``close()``, ``break``, Ctrl-C or a crash of either
    process leave no process or shared memory behind, and a worker process that dies is raised
    naming its pid (NOTE [the loader's worker process] in pipeline/worker_process.py).

    ``yield_cpu``: the workers run at a lower scheduling priority than the consumer, so the
    thread that launches the training step is never queued behind them for a core (NOTE [loader
    threads yield the CPU] in pipeline/workers.py); default: when feeding a GPU.

    ``decode="gpu"`` (with ``device="cuda"``) decodes every JPEG on the GPU (nvJPEG, through
    torchvision) and crops, resamples and flips it there with the CPU path's filter; the
    workers then only take what nvJPEG declines. ``decode="auto"`` gives the GPU the share of
    each batch by which the workers fall behind, so CPU and GPU decode add up. Rows decoded on
    the GPU differ from the CPU path's by a few levels (decoder and rounding); ``"auto"``
    batches are not reproducible bit for bit (NOTE [GPU decode share] in
    pipeline/gpu_decode.py). ``gpu_share`` says what fraction of rows the GPU decoded.
    """

    def __init__(
        self,
        dataset: Source,
        transforms: Sequence[Transform] = (),
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
        workers: str = "threads",
        yield_cpu: bool | None = None,
        decode: str = "cpu",
    ) -> None:
        if not all(hasattr(dataset, a) for a in ("read", "describe")) and isinstance(
                dataset, torch.utils.data.Dataset):
            dataset = TorchDataset(dataset)
        for attr in ("__len__", "read", "describe"):
            if not hasattr(dataset, attr):
                raise TypeError(f"dataset: a source needs {attr} (see terrapipe.pipeline.sources), "
                                f"or pass a map-style torch.utils.data.Dataset")
        if len(dataset) == 0:
            raise ValueError("dataset: the dataset is empty")
        if isinstance(transforms, Transform):
            transforms = (transforms,)  # one transform, as torchvision's transform= takes one
        try:
            transforms = tuple(transforms)
        except TypeError:
            raise TypeError(f"transforms: expected a list of terrapipe.pipeline transforms, got "
                            f"{type(transforms).__name__}") from None
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if workers == "thread":
            workers = "threads"  # the spelling of releases before DESIGN.md's, still accepted
        if workers not in WORKERS:
            raise ValueError(f"workers must be one of {WORKERS}, got {workers!r}")
        if decode not in DECODE:
            raise ValueError(f"decode must be one of {DECODE}, got {decode!r}")
        if yield_cpu not in (None, True, False):
            raise ValueError(f"yield_cpu must be None, True or False, got {yield_cpu!r}")
        self.device = resolve_device(device)
        if decode != "cpu" and self.device.type != "cuda":
            raise ValueError(f"decode={decode!r} decodes on a CUDA device: pass device='cuda', "
                             f"got device={str(device)!r}")
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
        self.workers = workers
        self.skipped: list[tuple[int, str, str]] = []  # (index, where, error) under "skip"
        self._resume_consumed = 0  # samples of the epoch's order consumed before the next pass
        self._live: weakref.ref[_EpochIterator] | None = None
        self._last_state: dict | None = None
        self._next: _NextPass | None = None  # NOTE [the next epoch's first batches]
        self._base = 0  # where the slot sequence stands (NOTE [batch buffer ownership])
        self._epoch_step = 1  # the last two passes' epochs differed by it (0 or 1), else None
        self._last_epoch: int | None = None

        first, _ = dataset.read(0)
        if isinstance(first, np.ndarray):
            channels = 1 if first.ndim == 2 else first.shape[2]
        else:
            channels = 3
        plan = compile_plan(list(transforms), channels)
        if plan.out_hw is None:
            if not isinstance(first, np.ndarray):
                raise ValueError("transforms: encoded images need a crop/resize so batches have one size")
            plan = plan.with_size(first.shape[:2])
        if decode != "cpu" and isinstance(first, np.ndarray):
            raise ValueError(f"decode={decode!r}: this dataset yields decoded arrays (sample 0 is "
                             f"{first.dtype} {first.shape}); there is nothing to decode")
        self.decode = decode
        self._share: DecodeShare | None = None
        self.plan: Plan = plan
        oh, ow = plan.out_hw
        ring = self.prefetch + 2
        self.channels_last = bool(channels_last)
        shape = (batch_size, channels, oh, ow)
        cuda = self.device.type == "cuda"
        nice = cuda if yield_cpu is None else yield_cpu
        slots = None
        if workers == "process":  # the host slots in memory the worker process maps too
            host_dtype = np.uint8 if cuda else plan.lut.dtype
            arrays = [(shape, host_dtype)] * ring + [((batch_size,), np.int64)] * ring
            slots = SharedSlots(SharedSlots.size_of(arrays))
        try:
            self._feed: Feed = (
                DeviceFeed(self.device, ring, shape, plan, self.channels_last, shared=slots) if cuda
                else HostFeed(ring, shape, plan, self.channels_last, shared=slots))
        except BaseException:
            if slots is not None:
                slots.unlink()  # no worker will map it: the name would outlive the failure
            raise
        try:
            if slots is None:
                writer = SampleWriter(dataset, plan, self._feed.lut, on_error, self.skipped)
                self._workers: Workers = ThreadWorkers(writer, self._feed.images, self._feed.labels,
                                                       self.num_threads, nice=nice)
            else:
                self._workers = ProcessWorkers(dataset, list(transforms), channels, plan.out_hw, slots,
                                               self._feed.images, self._feed.labels, self._feed.mappings,
                                               self._feed.lut, on_error, self.num_threads, nice=nice,
                                               skipped=self.skipped)
            if decode != "cpu":
                self._workers = self._split(self._workers, decode, shape, ring)
        except BaseException:
            self._feed.close()
            raise
        self._finalizer = weakref.finalize(self, _close, self._workers, self._feed)
        self._closed = False

    def _split(self, workers: Workers, decode: str, shape: tuple[int, ...], ring: int) -> Workers:
        """``workers`` sharing each batch with a GPU decode thread (NOTE [GPU decode share])."""
        try:
            fallback = SampleWriter(self.dataset, self.plan, self._feed.lut, self.on_error, self.skipped)
            gpu = GpuDecoder(self.dataset, self.plan, self.device, shape, ring, self._feed.labels, fallback,
                             nvjpeg_decoder(self.device))
        except BaseException:
            workers.close()
            raise
        self._share = DecodeShare(decode, self.batch_size)
        split = SplitWorkers(workers, gpu, self._share)
        self._feed.device_part = split.device_part
        return split

    @property
    def gpu_share(self) -> float:
        """The fraction of rows decoded on the GPU so far (0.0 with ``decode="cpu"``)."""
        return 0.0 if self._share is None else self._share.fraction

    # -- order ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iterator runs (order and augmentation draws)."""
        self.epoch = int(epoch)
        self._last_state = None  # a pass stopped early belongs to the epoch left behind

    def set_world(self, rank: int, world_size: int) -> None:
        """Deal the next iterators' samples to ``rank`` of ``world_size`` (an elastic job's next
        generation): with :meth:`load_state_dict`, the rest of an epoch resumes over the new
        world (NOTE [resume at any world size]). A live iterator keeps the world it began with."""
        rank, world_size = int(rank), int(world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"set_world: rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self._last_state = None  # a state of the old world would name its rank and size

    def _per_rank(self) -> int:
        return math.ceil(len(self.dataset) / self.world_size)

    def __len__(self) -> int:
        n = self._per_rank()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict:
        """Where iteration stands (NOTE [resume at any world size]): the live iterator's
        position (else the last one's, or the start of ``epoch``). A dict of ints and bools:
        ``torch.save`` it, and ``torch.load(..., weights_only=True)`` reads it back."""
        live = self._live() if self._live is not None else None
        if live is not None and not live.finished:
            return live.state_dict()
        if self._last_state is not None:
            return dict(self._last_state)
        return self._state(self.epoch, self.seed, self._resume_consumed)

    def _state(self, epoch: int, seed: int, consumed: int) -> dict:
        per_step = self.world_size * self.batch_size
        return {"epoch": epoch, "seed": seed, "consumed": consumed, "batch": consumed // per_step,
                "rank": self.rank, "world_size": self.world_size, "num_samples": len(self.dataset),
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``, from any rank of a job at any world size: the next iterator runs
        the rest of its epoch at this loader's rank and world size (NOTE [resume at any world
        size]). A dict from a loader over another dataset, or with another seed, batch size or
        shuffle, raises ValueError naming the field."""
        mine = {"num_samples": len(self.dataset), "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": self.shuffle}
        for field, value in mine.items():
            if field in state and state[field] != value:
                raise ValueError(f"state_dict: {field} is {state[field]!r} in the saved state but "
                                 f"{value!r} in this loader")
        if "consumed" in state:
            consumed = int(state["consumed"])
        else:  # a dict from before resumes at other world sizes: whole steps at its world size
            consumed = int(state["batch"]) * int(state["world_size"]) * self.batch_size
        if not 0 <= consumed <= len(self.dataset):
            raise ValueError(f"state_dict: consumed is {consumed}, outside [0, {len(self.dataset)}]")
        self.epoch = int(state["epoch"])
        self._resume_consumed = consumed
        self._last_state = None

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> _EpochIterator:
        if self._closed:
            raise RuntimeError("FastLoader is closed")
        live = self._live() if self._live is not None else None
        if live is not None and not live.finished:
            raise RuntimeError(
                f"FastLoader: an iterator over this loader is still live (epoch {live.epoch}, "
                f"{live.position} of {live.num_batches} batches yielded); both would write the same "
                f"batch buffers. Exhaust it, close() it or drop it before starting another")
        if self._last_epoch is not None:
            step = self.epoch - self._last_epoch
            self._epoch_step = step if step in (0, 1) else None
        self._last_epoch = self.epoch
        it = _EpochIterator(self, self.epoch, self.seed, self._resume_consumed)
        self._resume_consumed = 0
        self._last_state = None
        self._live = weakref.ref(it)
        return it

    def cancel_ahead(self) -> None:
        """Cancel the next pass's batches begun ahead (NOTE [the next epoch's first batches]):
        the next ``iter()`` starts with an empty pipeline, as on a loader that ran nothing
        before. Returns once no worker writes a slot (samples being decoded are finished). Does
        nothing while an iterator is live or when nothing was begun. For benchmarks that
        alternate loaders, each timed from an empty pipeline, and for a consumer that wants the
        cores back between passes."""
        live = self._live() if self._live is not None else None
        if self._next is None or (live is not None and not live.finished):
            return
        self._next = None
        self._workers.stop()

    def close(self) -> None:
        """Stop the pool; no loader thread survives this call, and no copy is left in flight."""
        self._closed = True
        live = self._live() if self._live is not None else None
        if live is not None:
            live.close()
        self._finalizer()

    def __enter__(self) -> FastLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _EpochIterator:
    """One pass over a FastLoader (NOTE [one iterator per epoch]); created by ``iter(loader)``.

    Yields ``(images, labels)`` as described on :class:`FastLoader`. ``close()`` stops it early:
    queued samples are cancelled and running ones waited for, so no thread writes a slot after.
    """

    def __init__(self, loader: FastLoader, epoch: int, seed: int, start: int) -> None:
        self._loader = loader
        self.epoch, self.seed = epoch, seed
        self.start = start  # samples of the epoch's order consumed before this pass
        self.position = 0  # the next batch to yield
        self.finished = False
        self._ring = loader.prefetch + 2
        nxt, loader._next = loader._next, None
        if nxt is not None and nxt.runs(loader, epoch, seed, start):  # NOTE [the next epoch's ...] 3
            self._indices, self._base, self._submitted = nxt.indices, nxt.base, nxt.submitted
        else:
            if nxt is not None:
                loader._workers.stop()  # its batches belong to a pass that is not this one
            self._indices = epoch_indices(len(loader.dataset), seed=seed, epoch=epoch, shuffle=loader.shuffle,
                                          rank=loader.rank, world_size=loader.world_size, start=start)
            self._base = loader._base  # the slot sequence goes on (NOTE [batch buffer ownership])
            self._submitted: set[int] = set()
            loader._workers.start_pass()
        self.num_batches = _batches_of(loader, len(self._indices))
        loader._feed.start_pass()

    def state_dict(self) -> dict:
        loader = self._loader
        if self.position >= self.num_batches:
            return loader._state(self.epoch, self.seed, 0)  # a finished epoch resumes at its start
        consumed = self.start + self.position * loader.batch_size * loader.world_size
        return loader._state(self.epoch, self.seed, min(consumed, len(loader.dataset)))

    def __iter__(self) -> _EpochIterator:
        return self

    def _rows(self, b: int) -> int:
        return min(self._loader.batch_size, len(self._indices) - b * self._loader.batch_size)

    def _submit(self, b: int) -> None:
        if b >= self.num_batches:
            self._submit_next(b - self.num_batches)
            return
        if b in self._submitted:
            return
        self._queue(self._base + b, self._indices, b, self.seed, self.epoch)
        self._submitted.add(b)

    def _queue(self, key: int, indices: np.ndarray, b: int, seed: int, epoch: int) -> None:
        """Batch ``b`` of a pass of ``indices`` to the workers as ``key``, into slot ``key %
        ring`` once no copy still reads it."""
        loader = self._loader
        loader._feed.slot_writable(key % self._ring)
        rows = indices[b * loader.batch_size:(b + 1) * loader.batch_size]
        loader._workers.submit(key, key % self._ring, rows, seed, epoch)

    def _submit_next(self, j: int) -> None:
        """Batch ``j`` of the pass expected after this one (NOTE [the next epoch's first batches] 2)."""
        loader = self._loader
        nxt = loader._next
        if nxt is None:
            if loader.on_error == "skip" or loader._epoch_step is None:  # clause 4; no pattern to follow
                return
            nxt = loader._next = _NextPass(loader, self.epoch + loader._epoch_step, self.seed,
                                           self._base + self.num_batches)
        if j >= nxt.num_batches or j in nxt.submitted:
            return
        self._queue(nxt.base + j, nxt.indices, j, nxt.seed, nxt.epoch)
        nxt.submitted.add(j)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.finished or self.position >= self.num_batches:
            self.close()
            raise StopIteration
        b = self.position
        key = self._base + b  # the batch's name for the workers and the feed, and its slot
        loader = self._loader
        try:
            for ahead in range(b, b + loader.prefetch + 1):
                self._submit(ahead)
            workers = loader._workers

            def filled() -> None:
                workers.wait(key)  # re-raises a SampleError from a worker

            with timeline.span("loader", "wait batch", args={"batch": b}):
                images, labels = loader._feed.deliver(key, key % self._ring, self._rows(b), filled)
            if b + 1 in self._submitted and workers.done(key + 1):
                loader._feed.copy_ahead(key + 1, (key + 1) % self._ring, self._rows(b + 1))
        except BaseException:
            self.close()  # the error is this iterator's end; no thread keeps writing its slots
            raise
        self.position = b + 1
        if loader.copy:
            images, labels = images.clone(), labels.clone()
        return images, labels

    def close(self) -> None:
        """End this pass: nothing may still write a slot once it returns."""
        if self.finished:
            return
        self.finished = True
        loader = self._loader
        loader._base = self._base + self.position
        if self.position < self.num_batches or loader._next is None:
            loader._workers.stop()  # the next pass's batches too (NOTE [the next epoch's ...] 4)
            loader._next = None
        if 0 < self.position < self.num_batches:  # stopped early: state_dict() says where
            loader._last_state = self.state_dict()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _batches_of(loader: FastLoader, per_rank: int) -> int:
    """Batches of a pass of ``per_rank`` samples."""
    bs = loader.batch_size
    return per_rank // bs if loader.drop_last else math.ceil(per_rank / bs)


class _NextPass:
    """The pass an iterator expects after its own, from the start of ``epoch`` at the loader's
    rank and world size, and which of its batches (keys ``base + j``) it submitted (NOTE [the
    next epoch's first batches])."""

    def __init__(self, loader: FastLoader, epoch: int, seed: int, base: int) -> None:
        self.epoch, self.seed, self.base = epoch, seed, base
        self.rank, self.world_size = loader.rank, loader.world_size
        self.indices = epoch_indices(len(loader.dataset), seed=seed, epoch=epoch, shuffle=loader.shuffle,
                                     rank=loader.rank, world_size=loader.world_size, start=0)
        self.num_batches = _batches_of(loader, len(self.indices))
        self.submitted: set[int] = set()

    def runs(self, loader: FastLoader, epoch: int, seed: int, start: int) -> bool:
        """Whether an iterator of these arguments runs this pass (clause 3)."""
        return (start == 0 and epoch == self.epoch and seed == self.seed and loader.rank == self.rank
                and loader.world_size == self.world_size)


def _close(workers: Workers, feed: Feed) -> None:
    """End a loader's workers, then its feed (a weakref finalizer: holds no loader)."""
    try:
        workers.close()
    finally:
        feed.close()
