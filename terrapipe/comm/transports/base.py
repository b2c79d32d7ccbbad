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
library's. Transports between nodes (MPI's ``cross``, the TCP ring) carry the agreement across
nodes (:class:`NodeTables`: NOTE [agreement across nodes] in comm/transports/shm.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ...kernels import sync as ksync
from ..errors import CommError
from ..message import NO_GATE, Fused
from .board import SIG_WORDS, TABLE_COLS

__all__ = ["Transport", "OwnCollectives", "NodeTables"]


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


class NodeTables(ABC):
    """The exchange of NOTE [agreement across nodes] (comm/transports/shm.py) over a transport
    among the ranks of one local rank on every node: each rank's message, its node's table then
    any payload, to every other rank, and the check of every table. A transport offers
    :meth:`_tables_only` (the exchange itself), :meth:`_equal_tables` (an exchange of tables of
    one size on every rank), :meth:`largest_node` and ``frame_rows`` (rows past the node's in a
    table that the transport uses itself: 1 where its stream needs each message's length
    inside it, NOTE [a ring over TCP] 8 in comm/transports/tcp.py); ``native``: the compiled
    exchange, where there is one; ``doubling``: whether exchanges go by recursive doubling."""

    rank: int
    size: int
    native = None
    doubling = False
    frame_rows = 0

    @abstractmethod
    def largest_node(self, local_size: int) -> int:
        """The most ranks any node of this transport holds, from each rank's ``local_size``
        (collective; the same on every rank)."""

    @abstractmethod
    def _tables_only(self, coll, inbox: np.ndarray, head: int, nbytes: int, pair, reduction, user=None):
        """The exchange of :meth:`agree_tables`: each rank's message length, in rank order, or
        None where a compiled exchange found every table agreeing already."""

    @abstractmethod
    def _equal_tables(self, what: str, inbox: np.ndarray, head: int) -> None:
        """Every rank's ``inbox[rank, :head]`` into its row of ``inbox`` ((size, head) uint8),
        where every rank's message is ``head`` bytes (naming a mismatch, when every rank knows
        there is one)."""

    def agree_tables(self, coll, inbox: np.ndarray, head: int, nbytes: int, check, sigs: np.ndarray,
                     pair=None, reduction: tuple | None = None, user: np.ndarray | None = None) -> None:
        """Send this rank's message, ``inbox[rank, :nbytes]``, to every rank of the transport and
        receive theirs into their rows of ``inbox`` (:meth:`_tables_only`); call ``check(sigs,
        ranks)`` on every rank's signature, in rank order, where any differ. A message begins
        with its node's table, ``head`` bytes of int64 (rows, TABLE_COLS): a row per rank of
        the node, its signature's digest then its group rank, -1 for padding rows (NOTE
        [agreement across nodes] 4 in comm/transports/shm.py), then the transport's
        ``frame_rows``; any payload follows. ``inbox``: (size, width) uint8, C-contiguous, the
        caller's, ``width`` a multiple of 8 and at least the longest message any rank sends.
        ``sigs``: (local_size, SIG_WORDS) int64, the signatures this rank's table digests, in
        its rows' order (a mismatch is named with them). Returns once every table agrees: every
        message then has ``nbytes`` bytes.

        Where :attr:`doubling`, by recursive doubling (``pair``: its (2, width) uint8 scratch;
        ``reduction``: (partial, op, kind, scratch, acc), how the payloads are reduced on the
        way: ``partial`` this rank's payload as its dtype, the rest as for
        :func:`~terrapipe.kernels.oneshot.finish`; None where only tables travel). ``user``: the
        caller's array the payload is read from and whose result it receives, where the
        compiled exchange reduce-scatters (NOTE [MPI from compiled code] 10 in
        comm/transports/mpi_native.py)."""
        if user is not None and self.native is None:
            raise ValueError("user: only the compiled exchange reduces in the caller's array")
        counts = self._tables_only(coll, inbox, head, nbytes, pair, reduction, user)
        if counts is None:
            return
        words = inbox.view(np.int64)
        # Compiled: NumPy calls cost microseconds each, which the smallest allreduces pay.
        if ksync.tables_agree(words, head // 8, TABLE_COLS, words[self.rank, : TABLE_COLS - 1]) and \
                all(c == nbytes for c in counts):
            return
        self.raise_mismatch(coll, inbox, head, counts, check, sigs)

    def raise_mismatch(self, coll, inbox: np.ndarray, head: int, counts, check, sigs: np.ndarray) -> None:
        """Raise what an exchange that did not agree means: ``check(sigs, ranks)`` on every
        rank's signature, in rank order (CollectiveMismatchError where they differ), else
        CommError for messages of different lengths under one signature. ``inbox``, ``head``
        and ``sigs`` as in :meth:`agree_tables`; ``counts``: each rank's message length. Where
        the digests differ every rank sees it, and every rank swaps the whole signatures with
        the others first (NOTE [agreement across nodes] 4 in comm/transports/shm.py)."""
        words = inbox.view(np.int64)
        tables = words[:, : head // 8].reshape(-1, TABLE_COLS)
        digests = tables[tables[:, -1] >= 0, 0]
        if (digests != digests[0]).any():
            rows = head // 8 // TABLE_COLS
            mine = words[self.rank, : head // 8].reshape(rows, TABLE_COLS)[: len(sigs), -1]
            whole = self._whole_signatures(coll, mine, sigs, rows)
            rows = whole[whole[:, -1] >= 0]
            rows = np.ascontiguousarray(rows[np.argsort(rows[:, -1], kind="stable")])
            check(rows[:, :-1], [int(r) for r in rows[:, -1]])
        lengths = sorted({int(c) for c in counts})
        raise CommError(f"{coll}: messages of {lengths} bytes under one signature")

    def _whole_signatures(self, coll, ranks: np.ndarray, sigs: np.ndarray, rows: int) -> np.ndarray:
        """Every rank's table with whole signatures, (size x rows, SIG_WORDS + 1) int64: each
        rank's ``rows`` rows, ``sigs`` with ``ranks`` (its node's group ranks), -1 padding."""
        table = np.full((rows, SIG_WORDS + 1), -1, np.int64)
        table[: len(sigs), :-1] = sigs
        table[: len(sigs), -1] = ranks
        return self._every_table(f"{coll} (naming the mismatch)", table).reshape(-1, SIG_WORDS + 1)

    def _every_table(self, what: str, mine: np.ndarray) -> np.ndarray:
        """Every rank's ``mine`` ((rows, cols) int64, C-contiguous, the same shape on every
        rank), (size, rows, cols), through :meth:`_equal_tables` (whether they agree is the
        caller's to judge)."""
        inbox = np.zeros((self.size, mine.nbytes), np.uint8)
        inbox[self.rank] = mine.view(np.uint8).ravel()
        self._equal_tables(what, inbox, mine.nbytes)
        return inbox.view(np.int64).reshape(self.size, *mine.shape)
