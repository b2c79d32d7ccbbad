"""The one interface through which a Group moves data, and the helpers its transports share.

A :class:`~terrapipe.comm.group.Group` keeps the topology, the ordering of collectives (NOTE
[collective ordering] in group.py) and the signature agreement; everything that moves bytes is
a :class:`Transport`:

=========  ==========================================  =================================
transport  moves data through                          module
=========  ==========================================  =================================
shm        the node's shared segment (across nodes:    comm/shm.py
           each part over the cross-node ``mpi``), or  comm/cma.py
           the peers' own memory (single copy)
mpi        MPI over one communicator (MPI's own        comm/mpi.py
           collectives, the chunked ring)
gloo       torch.distributed's Gloo                    comm/gloo.py
nccl       torch.distributed's NCCL (CUDA tensors)     comm/nccl.py
=========  ==========================================  =================================

Which transport carries a collective is decided in one place, ``Group._route``. Ranks are
always the group's ranks. Arrays are flat host NumPy arrays (uint16 bits for 16-bit floats,
``kind`` saying which format); the caller owns them and the transport only reads ``src`` and
writes ``out`` during the call.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ..kernels import reduce as kreduce
from ..kernels.floats import compress, decompress

__all__ = ["Transport", "Fused", "divide", "NO_GATE"]


class _NoGate:
    """The gate of host-only calls (NOTE [staging gate] in shm.py): nothing to wait for."""

    @staticmethod
    def ready(upto: int) -> None:
        pass

    @staticmethod
    def wrote(upto: int) -> None:
        pass


NO_GATE = _NoGate()


class Fused:
    """Several flat arrays seen as one: ``read``/``write`` copy a range of the concatenation,
    compressing float32 to 16 bits (``ckind``) on the way in and back on the way out."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self.views = views
        self.offsets = [0]
        for v in views:
            self.offsets.append(self.offsets[-1] + v.shape[0])
        self.n = self.offsets[-1]

    def _pieces(self, c0: int, length: int):
        if len(self.views) == 1:
            yield self.views[0], c0, c0 + length, 0
            return
        i = bisect.bisect_right(self.offsets, c0) - 1
        pos = c0
        end = c0 + length
        while pos < end:
            v0 = int(self.offsets[i])
            v1 = int(self.offsets[i + 1])
            a, b = pos - v0, min(end, v1) - v0
            if b > a:
                yield self.views[i], a, b, pos - c0
            pos = max(pos, min(end, v1))
            i += 1

    def read(self, c0: int, length: int, out: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            out[:length] = self.views[0][c0:c0 + length]
            return
        for v, a, b, o in self._pieces(c0, length):
            if ckind:
                compress(v[a:b], out[o:o + b - a], ckind)
            else:
                out[o:o + b - a] = v[a:b]

    def write(self, c0: int, src: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            self.views[0][c0:c0 + src.shape[0]] = src
            return
        for v, a, b, o in self._pieces(c0, src.shape[0]):
            if ckind:
                decompress(src[o:o + b - a], v[a:b], ckind)
            else:
                v[a:b] = src[o:o + b - a]

    def only(self) -> np.ndarray | None:
        """The single array when there is one, else None."""
        return self.views[0] if len(self.views) == 1 else None


def divide(arr: np.ndarray, n: int, kind: int) -> None:
    """``arr /= n`` in place: ``avg`` is a sum divided once, at the end (floor for integers)."""
    if kind:
        kreduce.divide_16(arr, n, 0, arr.shape[0], kind)
    elif arr.dtype.kind == "f":
        kreduce.divide_float(arr, n, 0, arr.shape[0])
    else:
        kreduce.divide_int(arr, n, 0, arr.shape[0])


class Transport(ABC):
    """Data movement among the ranks of a group. ``size`` ranks; this one is ``rank``."""

    name: str = "?"
    rank: int
    size: int

    @abstractmethod
    def agree(self, coll: str, sig: np.ndarray, check: Callable[[np.ndarray, list[int]], None]) -> None:
        """Exchange this rank's signature (1-D int64) and call ``check(sigs, ranks)`` on every
        set of signatures gathered (rows: ranks), which raises on a mismatch. Also a barrier."""

    @abstractmethod
    def allreduce(self, srcs: Fused, dsts: Fused, op: int, dtype: np.dtype, kind: int, ckind: int = 0,
                  root: int = -1, gate=NO_GATE) -> None:
        """The reduction (kernels.reduce op code; ``avg`` divides) of every rank's ``srcs`` into
        ``dsts``; ``root`` >= 0: only that rank's ``dsts`` is written (a reduce). ``dtype``: of
        the values exchanged (uint16 when ``kind`` names a 16-bit format); ``ckind``: float32
        inputs travel as that 16-bit format. ``gate``: NOTE [staging gate] in shm.py."""

    @abstractmethod
    def broadcast(self, flat: np.ndarray, root: int) -> None:
        """``flat`` of ``root`` into ``flat`` of every rank."""

    @abstractmethod
    def allgather(self, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
        """``out[q]`` = rank q's ``flat`` (``out``: (size, n)); ``root`` >= 0: a gather, only
        ``root``'s ``out`` is written."""

    @abstractmethod
    def scatter(self, full: np.ndarray, out: np.ndarray, root: int) -> None:
        """``out`` = ``full[rank * n:(rank + 1) * n]`` of ``root`` (``n`` = len(out))."""

    @abstractmethod
    def reduce_scatter(self, flat: np.ndarray, out: np.ndarray, op: int, kind: int) -> None:
        """``out`` = this rank's part (np.array_split over ranks) of the reduction of ``flat``."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank called it (after ``agree``, which already synchronised)."""

    def send(self, flat: np.ndarray, dest: int, tag: int) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point transfers")

    def recv(self, flat: np.ndarray, source: int, tag: int) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point transfers")

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (collective: every rank calls it)."""
