"""The interface every transport offers: how the ranks of a group agree, meet and part.

A transport moves bytes among a group's ranks and knows nothing of reduce ops beyond calling the
kernels an algorithm hands it; which algorithm runs a collective over which transport is
decided in comm/select.py. The transports:

=========  ==================================================  ===========================
transport  moves bytes through                                 module
=========  ==================================================  ===========================
shm        the node's shared segment: rows per rank, a board   comm/transports/shm.py,
           of step counters and signatures                     comm/transports/board.py
cma        the peers' own memory (``process_vm_readv``)        comm/transports/cma.py
mpi        MPI point-to-point and MPI's own collectives        comm/transports/mpi.py
gloo       torch.distributed's Gloo and its collectives        comm/transports/gloo.py
tcp        a ring of TCP streams between machines (no MPI)     comm/transports/tcp.py
nccl       torch.distributed's NCCL (CUDA tensors)             comm/transports/nccl.py
=========  ==================================================  ===========================

Ranks are always the group's ranks. Arrays are flat host NumPy arrays (uint16 bits for 16-bit
floats, ``kind`` saying which format); the caller owns them and the transport only reads ``src``
and writes ``out`` during the call.

Transports over a library with collectives of its own (MPI, Gloo) also offer them
(:class:`OwnCollectives`): the algorithm comm/algorithms/native.py runs a collective as that
library's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ..message import NO_GATE, Fused

__all__ = ["Transport", "OwnCollectives"]


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
    def barrier(self) -> None:
        """Return once every rank called it."""

    def send(self, flat: np.ndarray, dest: int, tag: int) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point transfers")

    def recv(self, flat: np.ndarray, source: int, tag: int) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point transfers")

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (collective: every rank calls it)."""


class OwnCollectives(Transport):
    """A transport whose library has collectives of its own, run by comm/algorithms/native.py."""

    @abstractmethod
    def allreduce(self, srcs: Fused, dsts: Fused, op: int, dtype: np.dtype, kind: int, ckind: int = 0,
                  root: int = -1, gate=NO_GATE) -> None:
        """The reduction (kernels.reduce op code; ``avg`` divides) of every rank's ``srcs`` into
        ``dsts``; ``root`` >= 0: only that rank's ``dsts`` is written (a reduce). ``dtype``: of
        the values exchanged (uint16 when ``kind`` names a 16-bit format); ``ckind``: float32
        inputs travel as that 16-bit format. ``gate``: NOTE [staging gate] in comm/message.py."""

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
