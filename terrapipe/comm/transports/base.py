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

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from ... import settings
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from ..errors import CommError
from ..message import NO_GATE, Fused
from .board import SIG_WORDS, TABLE_COLS

__all__ = ["Transport", "OwnCollectives", "NodeTables", "halving_threshold"]

# The payloads the exchange between nodes is timed at, each way, to choose between recursive
# doubling and reduce-scatter with allgather (NodeTables.choose_halving; NOTE [MPI from compiled
# code] 9 in comm/transports/mpi_native.py): loops of _PROBE_CALLS exchanges back to back, each
# after exchanges that send _PROBE_SPEND_BYTES (a shaped link's burst allowance, or a switch's
# buffers, spent: what is timed is the steady state of a training loop), the median of
# _PROBE_ROUNDS kept. Up to 64 KiB: the one-shot across nodes sends up to 1 MiB among four
# nodes, 2 MiB on nodes of one rank (ONESHOT_DOUBLING_BYTES in comm/algorithms/oneshot_nodes.py),
# but past the crossover halving's lead grows with the bytes it saves (1.5 x n per link against
# log2(nodes) x n), so a lead at 64 KiB holds beyond it.
_PROBE_PAYLOADS = (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10)
_PROBE_SPEND_BYTES, _PROBE_CALLS, _PROBE_ROUNDS = 384 << 10, 12, 3


def halving_threshold(payloads, doubling, halving) -> int:
    """The smallest payload from which reduce-scatter and allgather beat recursive doubling,
    from each one's time per exchange (seconds) at each of ``payloads`` (bytes, ascending):
    where halving leads from some measured payload on, the crossover by linear interpolation
    of the lead between that payload and the one below it (extrapolated below the smallest
    from the two smallest, down to 64 bytes), rounded up to 64 bytes; 0 (never) where it does
    not lead at the largest (NOTE [MPI from compiled code] 9 in comm/transports/mpi_native.py)."""
    lead = [d - h for d, h in zip(doubling, halving, strict=True)]  # > 0: halving's lead
    i = len(lead)
    while i > 0 and lead[i - 1] > 0:
        i -= 1
    if i == len(lead):
        return 0
    j = max(i - 1, 0)  # the sign changes between payloads j and j + 1 (or below the smallest)
    x0, x1, y0, y1 = payloads[j], payloads[j + 1], lead[j], lead[j + 1]
    crossover = x0 - y0 * (x1 - x0) / (y1 - y0) if y1 != y0 else 64  # (equal: a lead all the way down)
    crossover = min(max(crossover, 64), payloads[i])
    return math.ceil(crossover / 64) * 64  # up, from the real value (not from its floor)


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
    can_halve = False  # whether exchanges may reduce-scatter and allgather (choose_halving)
    halving_bytes = 0  # the smallest payload that does; 0: none

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

    # -- recursive doubling or reduce-scatter and allgather --------------------------------------
    def set_halving_bytes(self, nbytes: int) -> None:
        """Make :attr:`halving_bytes` ``nbytes`` (the same on every rank: :meth:`choose_halving`)."""
        raise NotImplementedError(f"{type(self).__name__}: its exchanges never reduce-scatter")

    def _probe_exchange(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray,
                        reduction: tuple) -> None:
        """One exchange of :meth:`agree_tables` for :meth:`choose_halving`'s timing: every table
        of ``head`` bytes agrees (all zero but for the transport's own rows, which it writes)."""
        raise NotImplementedError(f"{type(self).__name__}: its exchanges never reduce-scatter")

    def choose_halving(self) -> None:
        """Choose :attr:`halving_bytes` for the exchanges that carry payloads between nodes
        (NOTE [MPI from compiled code] 9 in comm/transports/mpi_native.py):
        ``TERRAPIPE_HALVING_BYTES``, else measured now on these links. Collective: every rank
        gets the same answer (the largest setting, where ranks were given different ones), as
        it must: a rank halving where its peer doubles would meet it with messages of other
        lengths. Where exchanges cannot reduce-scatter (:attr:`can_halve`), nothing to choose."""
        if not self.can_halve:
            return
        fixed = settings.get("TERRAPIPE_HALVING_BYTES")
        if fixed is not None:
            chosen = int(self._slowest(np.array([float(fixed)]))[0])
        else:
            times = self._slowest(self._probe_halving()).reshape(-1, 2)
            chosen = halving_threshold(_PROBE_PAYLOADS, times[:, 0], times[:, 1])
        self.set_halving_bytes(chosen)

    def _probe_halving(self) -> np.ndarray:
        """This rank's seconds per exchange at each of _PROBE_PAYLOADS, by recursive doubling
        then by reduce-scatter and allgather, (payloads x 2) flattened: the median of
        _PROBE_ROUNDS loops each, in the steady state (NOTE [MPI from compiled code] 9)."""
        # one table row per rank, all zero (every table agrees), then the transport's own rows
        head = 8 * TABLE_COLS * (1 + self.frame_rows)
        width = -(-(head * self.size + _PROBE_PAYLOADS[-1]) // 64) * 64
        inbox, pair = np.zeros((self.size, width), np.uint8), np.zeros((2, width), np.uint8)
        scratch, acc = np.zeros(width // 4, np.float32), np.zeros(kreduce.TILE, np.float32)
        rounds = self.size.bit_length() - 1

        def loop(payload: int, halving: bool) -> float:
            self.set_halving_bytes(payload if halving else 0)
            reduction = (inbox[self.rank, head:head + payload].view(np.float32), kreduce.SUM, 0, scratch, acc)
            sent = payload * (2 * (self.size - 1) / self.size if halving else rounds)  # per exchange
            spend = -(-_PROBE_SPEND_BYTES // int(sent))  # untimed: a link's burst allowance spent
            for i in range(spend + _PROBE_CALLS):
                if i == spend:
                    t = time.perf_counter()
                self._probe_exchange("measuring the links between nodes", inbox, head, head + payload, pair,
                                     reduction)
            return (time.perf_counter() - t) / _PROBE_CALLS

        samples = np.zeros((_PROBE_ROUNDS, len(_PROBE_PAYLOADS), 2))
        for r in range(_PROBE_ROUNDS):
            for i, payload in enumerate(_PROBE_PAYLOADS):
                for halving in (False, True) if r % 2 else (True, False):
                    samples[r, i, int(halving)] = loop(payload, halving)
        self.set_halving_bytes(0)
        return np.median(samples, axis=0).ravel()

    def _slowest(self, values: np.ndarray) -> np.ndarray:
        """The largest of every rank's ``values`` (float64), on every rank: each rank's travel
        in its table, one per row after an agreeing first row (all zero), in rows the tables'
        check skips (their last word -1)."""
        table = np.zeros((1 + values.size, TABLE_COLS), np.int64)
        table[1:, 0] = values.astype(np.float64).view(np.int64)
        table[1:, -1] = -1
        every = self._every_table("agreeing on the links' measurement", table)[:, 1:, 0].copy()
        return every.view(np.float64).max(axis=0)

    def _every_table(self, what: str, mine: np.ndarray) -> np.ndarray:
        """Every rank's ``mine`` ((rows, cols) int64, C-contiguous, the same shape on every
        rank), (size, rows, cols), through :meth:`_equal_tables` (whether they agree is the
        caller's to judge)."""
        inbox = np.zeros((self.size, mine.nbytes), np.uint8)
        inbox[self.rank] = mine.view(np.uint8).ravel()
        self._equal_tables(what, inbox, mine.nbytes)
        return inbox.view(np.int64).reshape(self.size, *mine.shape)
