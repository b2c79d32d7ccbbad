"""Collectives run as the transport's own library runs them: MPI's (``Iallreduce``, ``Ibcast``,
...) over comm/transports/mpi.py, Gloo's over comm/transports/gloo.py. The library picks its own
algorithm inside; what we add is the agreement before (comm/group.py), the timeout that names
late ranks, and 16-bit formats reduced with float32 accumulation (an allgather reduced by the
kernels). NCCL's own collectives of CUDA tensors are comm/transports/nccl.py's, called from
comm/collectives.py once comm/select.py chose them.
"""

from __future__ import annotations

import numpy as np

from ..message import NO_GATE, Fused
from ..transports.base import OwnCollectives

__all__ = ["allreduce", "broadcast", "allgather", "scatter", "reduce_scatter", "barrier"]


def allreduce(t: OwnCollectives, srcs: Fused, dsts: Fused, op: int, dtype, kind: int, ckind: int = 0,
              root: int = -1, gate=NO_GATE) -> None:
    """``dsts`` = op over every rank's ``srcs`` (``root`` >= 0: on that rank only): the library's
    allreduce, on one flat array (the fused message copied in unless it is one array)."""
    t.allreduce(srcs, dsts, op, dtype, kind, ckind, root, gate)


def broadcast(t: OwnCollectives, flat: np.ndarray, root: int) -> None:
    t.broadcast(flat, root)


def allgather(t: OwnCollectives, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
    t.allgather(flat, out, root)


def scatter(t: OwnCollectives, full: np.ndarray, out: np.ndarray, root: int) -> None:
    t.scatter(full, out, root)


def reduce_scatter(t: OwnCollectives, flat: np.ndarray, out: np.ndarray, op: int, kind: int) -> None:
    t.reduce_scatter(flat, out, op, kind)


def barrier(t: OwnCollectives) -> None:
    t.barrier()
