"""Pinned host staging of CUDA tensors for the CPU-staged allreduce (``jit_allreduce``).

The tensors of one dtype are fused into one flat pinned host buffer. Device-to-host copies are
queued at once on a side stream, in pieces, each followed by an event; the reduction waits only
for the pieces it is about to read (``ready``), and each finished piece of the result goes back
host-to-device as soon as the reduction has written it (``wrote``), so the two copies and the
reduction overlap (the chunked shared-memory allreduce calls both, chunk by chunk).

NOTE [staging streams]
    Per call and per device, who touches what:
    - The caller's current stream produced the tensors. An event recorded on it when the call is
      issued, in the caller's thread (async calls run their body on the group's worker thread,
      whose current stream is another one), is what the side stream waits on before copying.
    - All copies of a group's staging run on that group's side stream for the device: downloads,
      then uploads, in call order. The host reads a piece of the pinned buffer only after that
      piece's download event, and writes a piece of the result only after reading it. So the
      next call's downloads (which the host waits for before writing) queue behind this call's
      uploads, and one pinned buffer per device serves every call of the group; calls of one
      group run one at a time (NOTE [collective ordering] in execution.py).
    - At the end the caller's stream waits on an event after the last upload, and every tensor
      is marked as used on the side stream (``record_stream``) so the caching allocator does not
      hand its memory out before the uploads finish. Work queued on the caller's stream after
      the call returns (or after ``Handle.wait()``) sees the result; the host never waits for
      the whole device, only for download events of pieces it needs.
    - A pinned buffer replaced by a larger one may still be read by queued uploads: torch's
      pinned allocator keeps a freed block until the copies that used it complete.
"""

from __future__ import annotations

import numpy as np

from .buffers import Buffer

__all__ = ["StagedGroup", "PIECE_BYTES"]

# Download/upload granularity: small enough that the reduction starts on the first piece while
# the rest are in flight, large enough that per-copy and per-event costs (~10 us) stay hidden.
PIECE_BYTES = 4 << 20


def _torch():
    import torch

    return torch


class _Pool:
    """One side stream and one growing pinned byte buffer per device, owned by a Group."""

    def __init__(self) -> None:
        self.streams: dict = {}
        self.buffers: dict = {}

    def stream(self, device):
        s = self.streams.get(device)
        if s is None:
            s = self.streams[device] = _torch().cuda.Stream(device)
        return s

    def buffer(self, device, nbytes: int):
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < nbytes:
            size = 1 << max(20, (nbytes - 1).bit_length())
            buf = self.buffers[device] = _torch().empty(size, dtype=_torch().uint8, pin_memory=True)
        return buf


def _pool(group) -> _Pool:
    pool = getattr(group, "staging_pool", None)
    if pool is None:
        pool = group.staging_pool = _Pool()
    return pool


class StagedGroup:
    """Tensors of one dtype (CUDA, or mixed CUDA and host) as flat host arrays for the reduction.

    ``views``: one flat host ndarray per tensor, in order (uint16 bits for float16/bfloat16):
    a slice of the group's pinned buffer for a CUDA tensor, the tensor's own memory (or a copy,
    see :class:`~terrapipe.comm.buffers.Buffer`) for a host one. ``kind`` and ``dtype_name`` as
    in Buffer. Construct in the caller's thread (it records the producer event); then, on the
    thread that runs the collective: :meth:`start`, the reduction calling :meth:`ready` /
    :meth:`wrote` (the gate protocol of ``Group.allreduce_views``), :meth:`finish`.
    """

    def __init__(self, members: list, names: list[str], group) -> None:
        torch = _torch()
        cuda = [(m, n) for m, n in zip(members, names, strict=True) if not isinstance(m, Buffer)]
        first, first_name = cuda[0]
        for t, name in cuda:
            if t.device != first.device:
                raise ValueError(f"{name}: on {t.device}, but {first_name} is on {first.device}: the "
                                 "CUDA tensors of one jit_allreduce must share a device")
        self.device = first.device
        self.tensors = [None if isinstance(m, Buffer) else m for m in members]
        self._host = [m if isinstance(m, Buffer) else None for m in members]
        like = Buffer(torch.empty(0, dtype=first.dtype), first_name)  # rejects unsupported dtypes
        self.kind = like.kind
        self.dtype_name = like.dtype_name
        self._dtype = first.dtype
        self._itemsize = first.element_size()
        pool = _pool(group)
        self._pool = pool
        self.stream = pool.stream(self.device)
        self.caller = torch.cuda.current_stream(self.device)
        self.produced = torch.cuda.Event()
        self.produced.record(self.caller)
        self.sizes = [m.size if isinstance(m, Buffer) else m.numel() for m in members]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n = int(self.offsets[-1])
        self.views: list[np.ndarray] = []
        self._pieces: list[tuple[int, int, int]] = []  # (tensor, start, end) in the tensor's elements
        self._events: list = []
        self._next_ready = 0
        self._next_upload = 0

    # -- on the collective's thread ------------------------------------------------------------
    def start(self) -> None:
        """Queue every download on the side stream (NOTE [staging streams])."""
        torch = _torch()
        itemsize = self._itemsize
        pinned = self._pool.buffer(self.device, self.n * itemsize)
        as16 = self._dtype in (torch.float16, torch.bfloat16)
        flat_dtype = torch.int16 if as16 else self._dtype
        flat = pinned[:self.n * itemsize].view(flat_dtype)
        host = flat.numpy().view(np.uint16) if as16 else flat.numpy()
        per_piece = max(1, PIECE_BYTES // itemsize)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.produced)
            for i, t in enumerate(self.tensors):
                o, n = int(self.offsets[i]), self.sizes[i]
                if self._host[i] is not None:
                    self.views.append(self._host[i].flat)
                    continue
                self.views.append(host[o:o + n])
                src = t.detach().reshape(-1)  # a copy on the side stream when not contiguous
                t.record_stream(self.stream)
                for a in range(0, n, per_piece):
                    b = min(n, a + per_piece)
                    flat[o + a:o + b].copy_(src[a:b].view(flat_dtype), non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self._pieces.append((i, a, b))
                    self._events.append(ev)
        self._flat = flat

    def ready(self, upto: int) -> None:
        """Return once every element before fused index ``upto`` is in host memory."""
        while self._next_ready < len(self._pieces):
            i, a, _ = self._pieces[self._next_ready]
            if self.offsets[i] + a >= upto:
                break
            self._events[self._next_ready].synchronize()
            self._next_ready += 1

    def wrote(self, upto: int) -> None:
        """The results before fused index ``upto`` are final: queue their uploads."""
        torch = _torch()
        with torch.cuda.stream(self.stream):
            while self._next_upload < len(self._pieces):
                i, a, b = self._pieces[self._next_upload]
                o = int(self.offsets[i])
                if o + b > upto:
                    break
                t = self.tensors[i]
                piece = self._flat[o + a:o + b]
                if t.is_contiguous():
                    dst = t.detach().view(-1)[a:b]
                    dst.copy_(piece.view(t.dtype), non_blocking=True)
                elif b == self.sizes[i]:  # strided: the whole tensor once its last piece is final
                    whole = self._flat[o:o + b].view(t.dtype).view(t.shape)
                    t.detach().copy_(whole, non_blocking=True)
                self._next_upload += 1

    def finish(self) -> None:
        """Queue the remaining uploads, write back host tensors, and make the caller's stream
        wait for the uploads (no host wait)."""
        torch = _torch()
        self.wrote(self.n)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.caller.wait_event(done)
        for b in self._host:
            if b is not None:
                b.commit()
