"""Bucketed gradient averaging overlapped with backward.

NOTE [bucket launch order]
    1. Parameters are first bucketed in reverse registration order (roughly the order backward
       produces their gradients). During the first backward the order the gradients actually
       arrive in is recorded; at the end of the first ``synchronize()`` rank 0's order is
       broadcast and, where it differs, the buckets are cut again along it (as DDP rebuilds its
       buckets after the first iteration). Otherwise a bucket holding one late parameter (a
       first layer's bias registered beside the second layer) waits for the end of backward,
       and with it every bucket after it. Parameters without a gradient on rank 0 go last.
    2. A bucket is reduced (an async ``jit_allreduce``, in place on the ``.grad`` tensors) as
       soon as it and every bucket before it are complete, so all ranks issue the same
       collectives in the same order even when one rank's backward skips a parameter: such a
       bucket, and all after it, are launched by ``synchronize()``, where missing gradients
       become zeros. Until ``synchronize()`` returns, the ``.grad`` tensors of launched buckets
       belong to the reduction; ``zero_grad()`` in that window raises.

NOTE [gradients as bucket views]
    1. Each bucket owns one flat buffer (host buffers come from NumPy's allocator, which asks the
       OS for 2 MiB pages on large arrays; PyTorch's does not, and the reduction then runs at
       ~75% of the speed), and every parameter's ``.grad`` is a view into it, as DDP's
       ``gradient_as_bucket_view`` does. A bucket is reduced in place as one tensor: no copy in
       or out, and on MPI the ring reduces straight in the buffer.
    2. Autograd accumulates into an existing ``.grad`` in place, so after ``zero_grad(
       set_to_none=False)`` the views stay. After ``set_to_none=True`` (the default) autograd
       makes a new tensor; the post-accumulate hook copies it into the view and points ``.grad``
       back at the view (one copy while the gradient is hot in cache).
    3. Not for the NCCL backend with compression: its bucket travels in 16 bits, so gradients are
       copied into (and back out of) a separate 16-bit device buffer.
    4. Host buckets of a group with shared memory live in one node-shared array
       (``Group.shared_array``; NOTE [shared arrays] in comm/algorithms/shared.py), so each bucket's
       allreduce reads the peers' gradients where the hooks put them and writes the result
       into every rank's bucket in one pass: about 2 bytes moved per gradient byte instead of
       5.5. Made collectively with the buckets (construction and :meth:`rebucket`); where the
       group has no shared memory, or /dev/shm is full, the buckets are private NumPy buffers
       as in 1.

Why one module: DistributedGradients' bucketing, hooks and completion share one state
(buckets, views, counts, handles); its NOTEs above are the contract between them.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import numpy as np
import torch

from .. import comm, timeline

__all__ = ["DistributedGradients", "bucket_buffer"]

_BACKENDS = ("auto", "jit", "nccl")


class DistributedGradients:
    """Average ``model``'s gradients across ranks while backward runs.

    bucket_mb: bucket size; first_bucket_mb: the first (last layers') bucket, small so its
    reduction starts early; compression: None, "bf16" or "fp16" on the wire (float32
    accumulation); op: "avg" or "sum"; backward_passes_per_step: reduce every k-th backward
    (gradient accumulation); ``no_sync()`` skips reduction for the backward passes inside it.
    Shared (tied) parameters are reduced once. Call :meth:`synchronize` before using gradients.

    backend: "jit" reduces each bucket's ``.grad`` tensors in place with ``comm.jit_allreduce``
    (the CPU-staged path; CUDA gradients go through pinned host memory); "nccl" copies a CUDA
    bucket into one flat device buffer (16-bit with compression: NCCL then also accumulates in
    16 bits), reduces it with ``comm.allreduce`` on NCCL and copies it back in ``synchronize``;
    "auto" takes "nccl" for CUDA parameters when ``terrapipe.comm`` can use NCCL, else "jit".
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Parameter], bucket_mb: float = 25,
                 first_bucket_mb: float = 1, compression: str | None = None, op: str = "avg",
                 backward_passes_per_step: int = 1, group: comm.Group | None = None, backend: str = "auto",
                 buckets: list[list[torch.nn.Parameter]] | None = None) -> None:
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError("bucket_mb and first_bucket_mb must be positive, got "
                             f"{bucket_mb}, {first_bucket_mb}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if compression not in (None, "bf16", "fp16"):
            raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}")
        self.group = group if group is not None else comm.world()
        self.op = op
        self.compression = compression
        self.passes_per_step = backward_passes_per_step
        if isinstance(model, torch.nn.Module):
            params = [p for p in model.parameters() if p.requires_grad]  # parameters() dedupes ties
        else:
            seen: set[int] = set()
            params = [p for p in model if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
        if not params:
            raise ValueError("model: no parameters require gradients")
        on_cuda = all(p.is_cuda for p in params)
        if backend == "nccl" and not on_cuda:
            where = next(p.device for p in params if not p.is_cuda)
            raise ValueError(f"backend='nccl' needs every parameter on a CUDA device; one is on {where}")
        if backend == "auto":
            backend = "nccl" if on_cuda and comm.cuda_collectives(self.group) == "nccl" else "jit"
        self.backend = backend
        self._params = params
        self._shared = None  # the node-shared array holding the buckets, if any
        self.sized = buckets is None  # buckets cut by size (rebucket() may cut them again)
        self.bucket_mb, self.first_bucket_mb = float(bucket_mb), float(first_bucket_mb)
        # NOTE [bucket launch order] 1: the launch order, and the first backward's arrivals
        self._order = list(reversed(params))
        self._arrived: list[int] | None = [] if self.sized else None
        # NOTE [gradients as bucket views]
        self.as_views = not (backend == "nccl" and compression)
        self.set_buckets(_size_buckets(self._order, first_bucket_mb, bucket_mb) if buckets is None
                          else _explicit_buckets(buckets, params))
        self._counts = {id(p): 0 for p in params}
        self._next = 0  # first bucket not yet launched
        self._handles: list = []  # comm.Handle, or _FlatBucket for "nccl"
        self._passes = 0
        self._skip = False
        self.synchronized = False  # every bucket reduced, and no backward since
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def set_buckets(self, buckets: list[list[torch.nn.Parameter]]) -> None:
        """Make ``buckets`` current: their flat buffers, with each ``.grad`` (if any) moved into
        its view (NOTE [gradients as bucket views])."""
        self.buckets = buckets
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_flats: list[torch.Tensor] = []
        if self.as_views:
            self._release_shared()
            self._bucket_flats = self._shared_flats(buckets) or [
                bucket_buffer(sum(p.numel() for p in bucket), bucket[0].dtype, bucket[0].device)
                for bucket in buckets]
            for bucket, flat in zip(buckets, self._bucket_flats, strict=True):
                o = 0
                for p in bucket:
                    view = flat[o:o + p.numel()].view_as(p)
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
                    self._views[id(p)] = view
                    o += p.numel()
        self._bucket_of = {id(p): b for b, bucket in enumerate(buckets) for p in bucket}
        self._ready = [0] * len(buckets)
        self._wire_flats: dict[int, torch.Tensor] = {}  # NCCL + compression: 16-bit buffers, made once

    def _shared_flats(self, buckets: list[list[torch.nn.Parameter]]) -> list[torch.Tensor] | None:
        """Every bucket's flat buffer in one node-shared array (NOTE [gradients as bucket views]
        4), or None where there is none. Collective over the group."""
        if not buckets or self.backend != "jit" or buckets[0][0].device.type != "cpu":
            return None
        sizes = [sum(p.numel() for p in b) * b[0].element_size() for b in buckets]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + -(-n // 64) * 64)  # each bucket on its own cache lines
        region = self.group.shared_array(starts[-1])
        if region is None:
            return None
        self._shared = region
        return [torch.from_numpy(region[o:o + n]).view(b[0].dtype)
                for o, n, b in zip(starts[:-1], sizes, buckets, strict=True)]

    def _release_shared(self) -> None:
        if self._shared is not None:
            self.group.release_shared(self._shared)
            self._shared = None

    @property
    def shared(self) -> bool:
        """Whether the buckets live in node-shared memory (NOTE [gradients as bucket views] 4)."""
        return self._shared is not None

    def rebucket(self, bucket_mb: float, first_bucket_mb: float) -> None:
        """Cut the buckets again by size (the autotuner does, between steps). Gradients present
        move into the new buffers. Raises while reductions are in flight, or for buckets given
        explicitly. Collective in effect: every rank must rebucket alike before its next backward."""
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError("bucket_mb and first_bucket_mb must be positive, got "
                             f"{bucket_mb}, {first_bucket_mb}")
        if not self.sized:
            raise ValueError("rebucket: the buckets were given explicitly (buckets=...)")
        if self.in_flight() or self.step_started():
            raise RuntimeError("rebucket() while gradient reductions are in flight or a step is half "
                               "done: call it after optimizer.step()")
        self.bucket_mb, self.first_bucket_mb = float(bucket_mb), float(first_bucket_mb)
        self.set_buckets(_size_buckets(self._order, first_bucket_mb, bucket_mb))

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this averages, in the model's order (the caller must
        not change the list)."""
        return self._params

    def step_started(self) -> bool:
        """Whether a backward pass produced a gradient since the last synchronize (reduced or
        not): zero_grad or rebucket now would lose it."""
        return any(self._counts.values())

    # -- hooks -------------------------------------------------------------------------------
    # NOTE [gradient hooks for subclasses]: take_grad, bucketed, set_buckets, broadcast_order,
    # reduce_bucket and too_many_passes are what a subclass may override to take some gradients
    # elsewhere or route buckets through another channel (terrapipe.horovod's optimizer does:
    # sparse gradients and name negotiation); nothing else of this class is meant to be.
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._skip:
            return
        key = id(p)
        if self._counts[key] >= self.passes_per_step:
            self.too_many_passes()
        self.take_grad(p, self._counts[key] + 1 == self.passes_per_step)
        self.synchronized = False
        if self._arrived is not None and self._counts[key] == 0:
            self._arrived.append(key)
        self._counts[key] += 1
        b = self._bucket_of.get(key)  # None: a subclass reduces it outside the buckets
        if self._counts[key] == self.passes_per_step and b is not None:
            self._ready[b] += 1
            self._launch_ready()

    def take_grad(self, p: torch.Tensor, last: bool) -> None:
        """Put ``p``'s fresh ``.grad`` where its bucket reduces it (``last``: the step's final
        backward pass for ``p``; subclasses take some gradients elsewhere: terrapipe.horovod's
        sparse gradients)."""
        if p.grad.is_sparse:  # buckets are dense: a sparse gradient is reduced as its dense form
            p.grad = p.grad.to_dense()
        if self.as_views:
            view = self._views[id(p)]
            if p.grad.data_ptr() != view.data_ptr():  # NOTE [gradients as bucket views] 2
                view.copy_(p.grad)
                p.grad = view

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        if timeline.enabled():
            timeline.instant("engine", f"bucket {b} ready", args={"parameters": len(self.buckets[b])})
        if not self.as_views:
            for p in self.buckets[b]:
                if p.grad is None:  # no gradient on this rank: it contributes zeros
                    p.grad = torch.zeros_like(p)
            self._handles.append(self._launch_wire(b, [p.grad for p in self.buckets[b]]))
            return
        for p in self.buckets[b]:
            view = self._views[id(p)]
            if p.grad is None:  # no gradient on this rank: it contributes zeros
                view.zero_()
                p.grad = view
            elif p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():  # made outside the hook (no_sync)
                view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                p.grad = view
        self._handles.append(self.reduce_bucket(b, self._bucket_flats[b]))

    def reduce_bucket(self, b: int, flat: torch.Tensor):
        """Start reducing bucket ``b``'s flat buffer in place; returns an object whose ``wait()``
        waits for it (subclasses route buckets elsewhere: terrapipe.horovod's negotiation)."""
        if self.backend == "nccl":
            return comm.allreduce(flat, op=self.op, async_op=True, group=self.group)
        return comm.jit_allreduce(flat, op=self.op, compression=self.compression, async_op=True,
                                  group=self.group)

    def broadcast_order(self, order: np.ndarray) -> np.ndarray:
        """Rank 0's ``order`` (int64, one index per parameter) on every rank (subclasses send it
        elsewhere: terrapipe.horovod's negotiation)."""
        comm.broadcast(order, root=0, group=self.group)
        return order

    def too_many_passes(self) -> None:
        raise RuntimeError("a parameter's gradient was computed more than backward_passes_per_step="
                           f"{self.passes_per_step} times before synchronize() (or optimizer.step()); "
                           "raise backward_passes_per_step to accumulate more passes locally")

    def _launch_wire(self, b: int, grads: list[torch.Tensor]) -> _FlatBucket:
        """NCCL with compression: the gradients copied into the bucket's 16-bit device buffer."""
        flat = self._wire_flats.get(b)
        if flat is None:
            dtype = grads[0].dtype
            if self.compression and dtype == torch.float32:
                dtype = torch.bfloat16 if self.compression == "bf16" else torch.float16
            flat = self._wire_flats[b] = torch.empty(sum(g.numel() for g in grads), dtype=dtype,
                                                device=grads[0].device)
        o = 0
        for g in grads:  # on the current stream: the one backward produced the gradient on
            flat[o:o + g.numel()].copy_(g.reshape(-1))
            o += g.numel()
        return _FlatBucket(comm.allreduce(flat, op=self.op, async_op=True, group=self.group), flat, grads)

    # -- public ------------------------------------------------------------------------------
    def in_flight(self) -> bool:
        return bool(self._handles) or self._next > 0

    def synchronize(self) -> None:
        """Launch the buckets not yet launched (missing gradients as zeros), wait for all, and
        start counting the next step. After this, every rank holds the averaged gradients."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        handles, self._handles = self._handles, []
        with timeline.span("comm", "wait gradients", args={"buckets": len(handles)}):
            for h in handles:
                h.wait()
        self.synchronized = True
        self._next = 0
        self._ready = [0] * len(self.buckets)
        for k in self._counts:
            self._counts[k] = 0
        if self._arrived:
            self._follow_arrivals()

    def _follow_arrivals(self) -> None:
        """NOTE [bucket launch order] 1: cut the buckets along rank 0's first arrivals. Collective
        (every rank's first synchronize); the gradients, already reduced, move along."""
        index = {id(p): i for i, p in enumerate(self._params)}
        seen = set(self._arrived)
        mine = [index[k] for k in self._arrived] + [index[id(p)] for p in self._order if id(p) not in seen]
        self._arrived = None
        order = self.broadcast_order(np.asarray(mine, np.int64))
        ordered = self.bucketed([self._params[i] for i in order])
        if [id(p) for p in ordered] == [id(p) for p in self._order]:
            return
        self._order = ordered
        self.set_buckets(_size_buckets(ordered, self.first_bucket_mb, self.bucket_mb))

    def bucketed(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters to keep in buckets when they are cut along the first arrivals (all of
        them; terrapipe.horovod reduces agreed sparse ones outside)."""
        return params

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none``: ``.grad`` becomes None (the next backward's hook puts it back in its
        bucket); else the bucket buffers are zeroed, one fill per bucket, and stay the grads."""
        if self.in_flight():
            raise RuntimeError("zero_grad() while gradient reductions are in flight: call "
                               "synchronize() (or optimizer.step()) first")
        self.synchronized = False
        params = [p for bucket in self.buckets for p in bucket]
        if set_to_none:
            for p in params:
                p.grad = None
        elif self.as_views:
            for flat in self._bucket_flats:
                flat.zero_()
            for p in params:
                if p.grad is not None:
                    p.grad = self._views[id(p)]
        else:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._release_shared()


def _size_buckets(order: list[torch.nn.Parameter], first_mb: float,
                  mb: float) -> list[list[torch.nn.Parameter]]:
    """Parameters in launch order (NOTE [bucket launch order]), cut into buckets of at most
    ``mb`` MiB (the first: ``first_mb``); a flat bucket holds one dtype on one device."""
    out: list[list[torch.nn.Parameter]] = []
    limit, current, size = first_mb * 2**20, [], 0
    for p in order:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > limit or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            out.append(current)
            current, size, limit = [], 0, mb * 2**20
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


def _explicit_buckets(buckets, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``buckets`` checked against ``params`` (each exactly once) and split where a bucket mixes
    dtypes or devices (a flat bucket holds one of each)."""
    wanted = {id(p) for p in params}
    placed: dict[int, int] = {}
    out = []
    for i, bucket in enumerate(buckets):
        parts: dict[tuple, list] = {}
        for p in bucket:
            if id(p) not in wanted:
                raise ValueError(f"buckets[{i}]: holds a tensor that is not a parameter requiring gradients")
            if id(p) in placed:
                raise ValueError(f"buckets[{i}]: a parameter already in buckets[{placed[id(p)]}]")
            placed[id(p)] = i
            parts.setdefault((p.dtype, p.device), []).append(p)
        out.extend(parts.values())
    missing = [p for p in params if id(p) not in placed]
    if missing:
        out.append(missing)  # parameters no bucket names: one more bucket, reduced last
    return out


def bucket_buffer(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat bucket buffer of ``n`` elements: on the host, memory from NumPy's allocator (2 MiB
    pages for large arrays: NOTE [gradients as bucket views] 1), viewed as ``dtype``."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(n * itemsize, np.uint8)).view(dtype)


class _FlatBucket:
    """An NCCL bucket in flight: ``wait()`` waits for the reduction, then copies the result back
    into the gradients (on the current stream, which the reduction's stream already precedes)."""

    def __init__(self, handle: comm.Handle, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        self.handle, self.flat, self.grads = handle, flat, grads

    def wait(self) -> None:
        self.handle.wait()
        o = 0
        for g in self.grads:
            g.copy_(self.flat[o:o + g.numel()].view_as(g))
            o += g.numel()
