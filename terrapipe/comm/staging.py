"""Pinned host staging of CUDA tensors for the CPU-staged allreduce (``jit_allreduce``).

The tensors of one dtype are fused into one flat pinned host buffer. Device-to-host copies are
queued at once on a side stream, in pieces, each followed by an event; the reduction waits only
for the pieces it is about to read (``ready``), and each finished piece of the result goes back
host-to-device as soon as the reduction has written it (``wrote``), so the two copies and the
reduction overlap (the chunked shared-memory allreduce calls both, chunk by chunk).

On one node the copies can skip that buffer: the staged-rows allreduce
(comm/algorithms/staged_rows.py) has each chunk downloaded straight into this rank's row of the
node's segment, registered with CUDA once per group, and uploaded from there (``copy_in``,
``wait_in``, ``copy_out``, ``settle``), so the host only reduces. Downloads are queued by
whichever protocol the chosen algorithm speaks: all at once at its first ``ready``, or chunk by
chunk through ``copy_in``.

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
    - Copies straight to and from the segment's rows follow the same stream order; the rows
      are the algorithm's to fence (NOTE [staged rows] in comm/algorithms/staged_rows.py): the
      host waits for a chunk's download before the peers may read it, and for the last upload
      before the call returns, since the rows are not this call's once it has.
"""

from __future__ import annotations

import warnings
from collections import deque

import numpy as np

from ..cuda_host import register_host_memory, unregister_host_memory
from .buffers import Buffer
from .message import spans

__all__ = ["StagedGroup", "PIECE_BYTES"]

# Download/upload granularity: small enough that the reduction starts on the first piece while
# the rest are in flight, large enough that per-copy and per-event costs (~10 us) stay hidden.
PIECE_BYTES = 4 << 20


def _torch():
    import torch

    return torch


class _Pool:
    """One side stream and one growing pinned byte buffer per device, and the host memory
    registered with CUDA (the segment's mapping), owned by a Group; :meth:`close` before the
    group unmaps its segment."""

    def __init__(self) -> None:
        self.streams: dict = {}
        self.buffers: dict = {}
        self.registered: dict[int, int] = {}  # address: bytes

    def register(self, address: int, nbytes: int) -> None:
        """Pin host memory this process did not get from torch (once per mapping), for every
        device (the group's calls may stage tensors of several). Where the driver refuses (a
        locked-memory limit), a warning, and the copies run from pageable memory: correct,
        since CUDA then returns from a download once it has landed and from an upload once it
        has read the host memory, only slower; the same on every rank, nothing to agree on."""
        if address in self.registered:
            return
        try:
            register_host_memory(address, nbytes, portable=True)
        except RuntimeError as e:
            warnings.warn(f"jit_allreduce: {e}; staging through unpinned shared memory (slower)",
                          RuntimeWarning, stacklevel=2)
            nbytes = 0
        self.registered[address] = nbytes

    def close(self) -> None:
        """Wait for the side streams' copies, then unpin what :meth:`register` pinned."""
        for s in self.streams.values():
            s.synchronize()
        for address, nbytes in self.registered.items():
            if nbytes:
                unregister_host_memory(address)
        self.registered.clear()

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
    thread that runs the collective: :meth:`start`, the algorithm speaking one of two protocols
    (NOTE [staging gate] in comm/message.py): through ``views`` with :meth:`ready` / :meth:`wrote`,
    or straight to and from the segment's rows with :meth:`pin`, :meth:`copy_in`,
    :meth:`wait_in`, :meth:`copy_out` and :meth:`settle`; then :meth:`finish`.
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
        self._bounds = [int(o) for o in self.offsets]
        self.n = int(self.offsets[-1])
        self.views: list[np.ndarray] = []
        self._flat_src: list | None = None  # per member: its flat contiguous device memory
        # Through the pinned buffer:
        self._pieces: list[tuple[int, int, int]] = []  # (tensor, start, end) in the tensor's elements
        self._events: list = []
        self._downloading = False
        self._next_ready = 0
        self._next_upload = 0
        # Straight to and from the rows:
        self._direct = False
        self._arrivals: deque = deque()  # one event per copy_in, in order
        self._landed = None  # after the last copy_out

    # -- on the collective's thread ------------------------------------------------------------
    def start(self) -> None:
        """Make ``views`` (no copy is queued yet: the algorithm's protocol queues them)."""
        torch = _torch()
        itemsize = self._itemsize
        pinned = self._pool.buffer(self.device, self.n * itemsize)
        as16 = self._dtype in (torch.float16, torch.bfloat16)
        flat = pinned[:self.n * itemsize].view(torch.int16 if as16 else self._dtype)
        host = flat.numpy().view(np.uint16) if as16 else flat.numpy()
        for i in range(len(self.tensors)):
            o, n = int(self.offsets[i]), self.sizes[i]
            self.views.append(self._host[i].flat if self._host[i] is not None else host[o:o + n])
        self._flat = flat

    def _sources(self) -> list:
        """Each CUDA member as flat contiguous memory, for the side stream (None for host ones):
        the tensor itself, or for a strided one a contiguous copy made on the side stream, after
        the producer (written back at :meth:`finish` when the rows' protocol filled it)."""
        if self._flat_src is None:
            torch = _torch()
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.produced)
                srcs = []
                for t in self.tensors:
                    if t is not None:
                        t.record_stream(self.stream)
                    srcs.append(None if t is None else t.detach().reshape(-1))
            self._flat_src = srcs
        return self._flat_src

    def _download_all(self) -> None:
        """Through the pinned buffer: queue every download on the side stream, in pieces
        (NOTE [staging streams])."""
        torch = _torch()
        srcs = self._sources()
        flat_dtype = self._flat.dtype
        per_piece = max(1, PIECE_BYTES // self._itemsize)
        with torch.cuda.stream(self.stream):
            for i, src in enumerate(srcs):
                if src is None:
                    continue
                o, n = int(self.offsets[i]), self.sizes[i]
                for a in range(0, n, per_piece):
                    b = min(n, a + per_piece)
                    self._flat[o + a:o + b].copy_(src[a:b].view(flat_dtype), non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self._pieces.append((i, a, b))
                    self._events.append(ev)
        self._downloading = True

    def ready(self, upto: int) -> None:
        """Return once every element before fused index ``upto`` is in host memory."""
        if not self._downloading:
            self._download_all()
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

    # -- straight to and from the segment's rows (comm/algorithms/staged_rows.py) ---------------
    def pin(self, address: int, nbytes: int) -> None:
        """Register the host mapping the rows live in (once per group and mapping)."""
        self._pool.register(address, nbytes)

    def copy_in(self, c0: int, length: int, dst: np.ndarray) -> None:
        """Queue the download of fused elements ``[c0, c0 + length)`` into ``dst`` (1-D, in
        memory given to :meth:`pin`); host members are copied now. :meth:`wait_in` waits for
        the oldest download not yet waited for."""
        torch = _torch()
        srcs = self._sources()
        out = torch.from_numpy(dst.view(np.uint8))
        it = self._itemsize
        self._direct = True
        with torch.cuda.stream(self.stream):
            for i, a, b, o in spans(self._bounds, c0, length):
                if srcs[i] is None:
                    dst[o:o + b - a] = self._host[i].flat[a:b]
                else:
                    out[o * it:(o + b - a) * it].copy_(srcs[i][a:b].view(torch.uint8), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._arrivals.append(ev)

    def wait_in(self) -> None:
        """Return once the oldest download queued by :meth:`copy_in` and not yet waited for
        has landed in host memory."""
        self._arrivals.popleft().synchronize()

    def copy_out(self, c0: int, src: np.ndarray) -> None:
        """Queue the upload of ``src`` (final results of fused elements ``[c0, c0 + len(src))``,
        in memory given to :meth:`pin`) into the tensors; host members are written now."""
        torch = _torch()
        srcs = self._sources()
        inp = torch.from_numpy(src.view(np.uint8))
        it = self._itemsize
        with torch.cuda.stream(self.stream):
            for i, a, b, o in spans(self._bounds, c0, src.shape[0]):
                if srcs[i] is None:
                    self._host[i].flat[a:b] = src[o:o + b - a]
                else:
                    srcs[i][a:b].view(torch.uint8).copy_(inp[o * it:(o + b - a) * it], non_blocking=True)
            self._landed = torch.cuda.Event()
            self._landed.record(self.stream)

    def settle(self) -> None:
        """Return once every upload queued by :meth:`copy_out` has read its host memory."""
        if self._landed is not None:
            self._landed.synchronize()

    def finish(self) -> None:
        """Queue the remaining uploads (a strided tensor's whole copy, through the rows), write
        back host tensors, and make the caller's stream wait for the uploads (no host wait)."""
        torch = _torch()
        if self._direct:
            with torch.cuda.stream(self.stream):
                for t, src in zip(self.tensors, self._flat_src, strict=True):
                    if t is not None and not t.is_contiguous():
                        t.detach().copy_(src.view(t.shape), non_blocking=True)
        else:
            self.wrote(self.n)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.caller.wait_event(done)
        for b in self._host:
            if b is not None:
                b.commit()
