"""The TCP transport: a ring of byte streams among a few ranks on different machines, for the
exchange between machines of a group with shared memory on each that has no MPI (a torchrun job
or an elastic generation across machines: NOTE [machines over Gloo] in comm/group.py).

NOTE [a ring over TCP]
    1. Each rank connects to the next rank (its right) and accepts the previous one (its left),
       verified as NOTE [connecting ranks] in comm/sockets.py says: a stream to the right that
       this rank only writes, one from the left that it only reads, so each stream has one
       writer and one reader.
    2. Transfers are schedules, not requests: the sends in the order they go down the stream
       to the right, the receives in the order they come up from the left (a stream keeps its
       bytes in order, so no tag is needed), run by one compiled call that writes the one and
       reads the other as each allows (NOTE [a ring's schedule in compiled code] in
       transports/tcp_native.py), so a rank waiting for its left neighbour keeps writing to its
       right one and no two ranks wait on each other's sends.
    3. The ring allreduce is NOTE [ring schedule] of comm/algorithms/ring.py, chunk for chunk,
       as such a schedule (``tcp_native.ring_schedule``). It needs no done messages: a send is
       complete once the kernel holds its bytes, and the kernel delivers them without this
       process (NOTE [MPI progress] is MPI's alone).
    4. Below ``ring_bytes`` an allreduce is an allgather of the whole buffer around the ring and
       one reduction of the rows in rank order, 16-bit floats in float32 rounded once: one
       transfer per step where the ring takes two, and every rank adds in the same order, so
       every rank holds the same bits (DDP's replicas must stay identical). Between two
       machines both ways carry the same bytes; among four the allgather carries twice the
       ring's. Over 1gbit at 4 nodes x 1 (Intel Xeon, 2026-11-27,
       ``link_latency_4x1_1gbit_2026-11-27.json``) the allgather took 404 us at 4 KiB where the
       ring took 1026, and 1641 us at 64 KiB where the ring took 1043: hence 32 KiB.
    5. A wait sleeps in ``poll``, not on the core. One that passes the timeout raises
       CollectiveTimeoutError naming the peer it waits for (its left neighbour while a receive
       is due, else its right one), after telling ``on_lost`` (NOTE [a peer lost across nodes]
       in transports/board.py); a stream the peer closed (its process died, its machine went
       away) raises at once, naming that peer. The transport is then unusable, as the group is.
    6. Why not Gloo, which such a group also has: between two machines of the emulated cluster
       over 1gbit (Intel Xeon, 2026-11-27, ``link_latency_2x1_1gbit_2026-11-27.json``) a 4 KiB
       ping-pong over these streams took 28 us, this ring's allreduce of 4 KiB 25 us, and Gloo's
       between the same two ranks 1.9 ms; at 256 KiB 2.19 ms both ways, Gloo's 3.26 (NOTE
       [machines over Gloo] 7 in comm/group.py has what that made of a whole allreduce).
    7. A wait for a receive asks the kernel to wake it only once 256 KiB more of the awaited
       transfer (or the rest of it) has arrived (``SO_RCVLOWAT``; the kernel caps it at half
       the receive buffer, and a stream the peer closed wakes it at once), not at every
       segment that lands: each wake cost a few tens of microseconds of Python. At 4 nodes x
       1 over 1gbit (Intel Xeon, 2 cores, 2026-11-28), a 16 MiB allreduce took 37 ms of CPU
       per rank waking at every arrival and 24.5 with 256 KiB a wake, at the same wall time
       (211-214 ms, the links' bound). A whole chunk (1 MiB) a wake took 19 ms of CPU but
       2-5% more wall time at 4 and 8 MiB, where a segment is one chunk: the copy out of the
       kernel then waits for the chunk's last byte instead of following its arrival.
       Where the kernel does not cap it (before Linux 4.19) a receive larger than the buffer
       would wake only at the wait's nap (``_NAP_NS``): slow, never stuck.
    8. Between machines of several ranks the ring carries NOTE [agreement across nodes] (in
       comm/transports/shm.py) too: each rank's message, its machine's table and any payload
       (the one-shot across nodes' part, comm/algorithms/oneshot_nodes.py), around the ring as
       an allgather (:meth:`TcpTransport._tables_only`). Ranks that called different
       collectives, or one with different sizes, send messages of different lengths, and a
       stream has no message boundaries: so each message says its length, in a row of its
       table of its own (``frame_rows``: the length, then -1, a row the tables' check skips),
       and is received in two parts, the head of a known size and then the rest, as long as
       the head says (NOTE [a ring's schedule in compiled code] 7 in tcp_native.py). Every
       rank then holds every message whole, the streams stay in step, and a mismatch is
       raised on every rank alike; a length no row can hold means the stream lost its place:
       the ring is ended at once (its peers fail naming this rank) and is unusable after.
    9. Among a power of two of four or more machines the exchange goes by recursive doubling
       instead, as over MPI (NOTE [agreement across nodes] 3 in comm/transports/shm.py): each
       rank also connects a stream both ways to rank ``rank ^ 2**k`` for each round k (the
       transport made with ``exchange``), and every exchange runs its rounds over those
       (NOTE [a ring's schedule in compiled code] 9 in tcp_native.py), its payload reduced on
       the way, whatever the collective, so ranks in different calls still meet round by
       round. Around the ring a message reached the farthest rank after nodes - 1 hops, each
       link carrying nodes - 1 messages one after another; by rounds, log2(nodes) of each.
       From a payload measured when the group is made (:meth:`choose_halving`, kept in the
       ring's ``st``) the rounds reduce-scatter and allgather by halves instead (NOTE [a
       ring's schedule in compiled code] 10).

Why one module: the two streams (:class:`TcpRing`: the sockets and the state of the schedule
they run) and the transport over them (:class:`TcpTransport`: schedules with their timeout and
blame, the collectives, the background thread, abort and close) are one state machine on the
same two sockets; NOTE [a ring over TCP]'s clauses cite both. The compiled loop is
transports/tcp_native.py's.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ... import settings, timeline
from ...kernels import entry_point
from ...kernels import reduce as kreduce
from ..errors import CollectiveTimeoutError, CommError
from ..message import NO_GATE, Fused, divide, reduce_flat
from ..sockets import connect_ranks
from . import tcp_native
from .base import NodeTables
from .board import TABLE_COLS, wait_mode

__all__ = ["TcpTransport", "TcpRing"]

_NAP_NS = 50_000_000  # the longest a compiled wait sleeps before its failure check runs again
# The most bytes a wait for a receive asks the kernel to gather before it wakes (SO_RCVLOWAT,
# NOTE [a ring over TCP] 7): a quarter of the ring's chunk.
_LOWAT_BYTES = 256 << 10


class TcpRing:
    """The two streams of NOTE [a ring over TCP] 1 (``right``, ``left``: connected sockets,
    made non-blocking here) and the state of the schedule they run (NOTE [a ring's schedule in
    compiled code] in comm/transports/tcp_native.py); :meth:`run` drives one schedule, from
    Python only between compiled calls."""

    def __init__(self, rank: int, size: int, right: socket.socket, left: socket.socket,
                 partners: list[socket.socket] | None = None) -> None:
        self.rank, self.size = rank, size
        self.right, self.left = right, left
        # recursive doubling's streams, round k's to rank ^ 2**k (NOTE [a ring over TCP] 9)
        self.partners = list(partners or [])
        for sock in (right, left, *self.partners):
            sock.setblocking(False)
        self.fds = np.array([sock.fileno() for sock in self.partners], np.int64)
        self.round_sends, self.round_recvs = tcp_native.new_round_tables()
        # an exchange's waits poll a while before they sleep, or never sleep (TERRAPIPE_WAIT=spin:
        # until each nap, when Python looks at the timeout): NOTE [a ring's schedule in compiled
        # code] 11
        spin = tcp_native.EXCHANGE_SPIN_NS if wait_mode() == "sleep" else _NAP_NS
        self.st, self.cells, self.clock = tcp_native.new_state(spin)
        # Compiled (or loaded from Numba's cache) now, with the streams, not inside the first
        # collective's wait, where its seconds would count against the peers' timeout.
        self.run(tcp_native.allgather_schedule(0, size, rank), np.empty(0, np.uint8), np.empty(0, np.uint8),
                 time.monotonic_ns)

    def run(self, schedule, base: np.ndarray, spare: np.ndarray, until_ns, reduce=None, resume=False,
            exchange: bool = False) -> int:
        """Run ``schedule`` ((sends, recvs, first) from tcp_native) over ``base`` (the message,
        C-contiguous; offsets in its bytes) with ``spare`` (uint8, the reduce-scatter's
        receives) until it is done (DONE) or fails (CLOSED_LEFT, CLOSED_RIGHT, STALLED,
        BAD_FRAME, the errno in ``st``). ``until_ns()``: the time (CLOCK_MONOTONIC ns) of the
        next look from Python, or None when the wait has run out (then PENDING). ``reduce(i)``:
        reduces receive i from ``spare`` into ``base`` (REDUCE). ``resume``: go on with the
        schedule a compiled caller started (NOTE [a ring's schedule in compiled code] 8).
        ``exchange``: a transfer of a few round trips, whose waits poll ``st[S_SPIN_NS]``
        before they sleep (clause 11 there); else they sleep at once."""
        sends, recvs, first = schedule
        st = self.st
        if not resume:
            tcp_native.start(st, first)
        right, left = self.right.fileno(), self.left.fileno()
        at, spare_at = base.ctypes.data, spare.ctypes.data
        spin = int(st[tcp_native.S_SPIN_NS]) if exchange else 0
        while True:
            until = until_ns()
            if until is None:
                return tcp_native.PENDING
            code = tcp_native.advance(st, sends, recvs, right, left, at, spare_at, _LOWAT_BYTES, spin,
                                      until, self.cells, self.clock)
            if code == tcp_native.REDUCE:
                reduce(int(st[tcp_native.S_RECEIVED]))
            elif code != tcp_native.PENDING:
                return code

    def waiting_on_left(self, recvs: np.ndarray) -> bool:
        """Whether the schedule just run still waits for a receive (else only for sends)."""
        return int(self.st[tcp_native.S_RECEIVED]) < recvs.shape[0]

    def shutdown(self) -> None:
        """End every stream now (a wait on them wakes and fails); another thread may be waiting."""
        for s in (self.right, self.left, *self.partners):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in (self.right, self.left, *self.partners):
            with contextlib.suppress(OSError):
                s.close()


class TcpTransport(NodeTables):
    """Allreduce and allgather among ``comm``'s ranks (a :class:`~terrapipe.comm.store.StoreComm`
    or mpi4py communicator over which the streams are set up; collective) over a ring of TCP
    streams (NOTE [a ring over TCP]). ``members[i]``: the group rank of rank i, for errors;
    ``hosts``: each rank's machine, for errors. What the machines' tier of a Gloo group needs
    of its ``cross`` transport (NOTE [machines over Gloo] in comm/group.py): ``allreduce_array``,
    ``allgather``, ``afar``, ``on_lost``, ``on_waiting``, and the agreement's exchange
    (:class:`~terrapipe.comm.transports.base.NodeTables`, clause 8; ``exchange``: one that
    carries it, whose ranks, a power of two of four or more, also connect the streams of
    recursive doubling, clause 9)."""

    name = "tcp"
    frame_rows = 1  # NOTE [a ring over TCP] 8

    def __init__(self, comm, timeout: float, members: list[int] | None = None,
                 hosts: list[str] | None = None, exchange: bool = False) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.doubling = exchange and self.size >= 4 and self.size & (self.size - 1) == 0
        self._doubling_types: set[np.dtype] = set()  # the exchange compiled for these (_doubling)
        self.timeout = float(timeout)
        self.members = list(members) if members is not None else list(range(self.size))
        self.hosts = hosts
        self.on_lost: Callable[[int], None] = lambda rank: None
        self.on_waiting: Callable[[bool], None] = lambda waiting: None
        self.ring_bytes = settings.get("TERRAPIPE_TCP_RING_BYTES")
        self.chunk_bytes = 1 << 20
        self.ring_scratch = np.empty(self.chunk_bytes, np.uint8)  # a reduce-scatter's chunk as it arrives
        self._rows = np.empty(0, np.uint8)  # the small allreduce's gathered rows, grown on demand
        self._acc = np.empty(kreduce.TILE, np.float32)
        self.failed: str | None = None
        self._aborted: str | None = None
        self._jobs: queue.SimpleQueue | None = None  # the background thread's, once it runs
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()  # a forked child shares the streams: only their owner ends them
        self._afar, self._afar_lock = 0, threading.Lock()  # nested waits on other machines (afar)
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        if self.size > 1:
            reached, accepted = connect_ranks(comm, self.rank, [right], [left], self.timeout,
                                              "the TCP ring between machines")
            partners = []
            if self.doubling:  # clause 9: a stream both ways to rank ^ 2**k, round by round
                peers = [self.rank ^ (1 << k) for k in range(self.size.bit_length() - 1)]
                up, down = connect_ranks(comm, self.rank, [q for q in peers if q > self.rank],
                                         [q for q in peers if q < self.rank], self.timeout,
                                         "the TCP streams of recursive doubling between machines")
                partners = [up[q] if q > self.rank else down[q] for q in peers]
            self.ring_comm = TcpRing(self.rank, self.size, reached[right], accepted[left], partners)
        else:
            self.ring_comm = None

    def describe(self, rank: int) -> str:
        """Group rank ``rank`` for a message: "rank 2 on node1" where it is on this ring and its
        machine is known, else "rank 2"."""
        if self.hosts is None or rank not in self.members:
            return f"rank {rank}"
        return f"rank {rank} on {self.hosts[self.members.index(rank)]}"

    # -- running a schedule -------------------------------------------------------------------
    def _run(self, schedule, base: np.ndarray, what: str, reduce=None, resume=False,
             exchange: bool = False) -> None:
        """Run ``schedule`` over ``base`` (NOTE [a ring's schedule in compiled code] in
        comm/transports/tcp_native.py), marked waiting afar while it lasts; raise
        CollectiveTimeoutError naming the peer waited for (its left neighbour while a receive is
        due, else its right one: NOTE [a ring over TCP] 5) after the timeout or at once when a
        stream closed, CommError where this rank ended the streams. ``exchange``: as for
        :meth:`TcpRing.run`."""
        ring = self.ring_comm

        def peers() -> tuple[int, int, int]:
            left, right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
            return (left if ring.waiting_on_left(schedule[1]) else right), left, right

        def go(until_ns) -> int:
            return ring.run(schedule, base, self.ring_scratch, until_ns, reduce, resume, exchange)

        self._drive(what, go, peers)

    def _drive(self, what: str, go, peers) -> None:
        """``go(until_ns)`` (a compiled transfer's driver, :meth:`TcpRing.run`'s contract:
        ``until_ns()`` is the next look's time, or None once the timeout passed) marked waiting
        afar; then raise what it ended with but DONE, naming the peers ``peers()`` gives: (the
        one waited for when it timed out, the one read from, the one written to)."""
        if self.failed is not None:
            raise CommError(f"{what}: the TCP ring is unusable after an earlier failure ({self.failed})")
        deadline = time.monotonic_ns() + int(self.timeout * 1e9)

        def until_ns():
            now = time.monotonic_ns()
            return None if now >= deadline else min(deadline, now + _NAP_NS)

        with self.afar():  # as MpiTransport.wait_all marks itself, whoever called it
            code = go(until_ns)
        if code == tcp_native.DONE:
            return
        late, left, right = peers()
        if code == tcp_native.PENDING:
            raise self._fail(what, late, f"Timed out after {self.timeout:g}s")
        self._raise_failed(what, code, left, right)

    def _raise_failed(self, what: str, code: int, left: int, right: int) -> None:
        """Raise what a schedule that failed with ``code`` (not DONE, not PENDING) means, naming
        ``left`` (the peer read from) or ``right`` (written to)."""
        ring = self.ring_comm
        if self._aborted is not None:  # this rank ended the streams: no peer is to blame
            raise CommError(f"{what}: ended on this rank ({self._aborted})")
        if code == tcp_native.STALLED:
            self.failed = f"{what}: a schedule that waits on nothing"
            raise CommError(self.failed)
        if code == tcp_native.BAD_FRAME:  # NOTE [a ring over TCP] 8: the stream lost its place
            self.failed = (f"{what}: a message from {self.describe(self.members[left])} says a length no "
                           f"row holds; the ring is ended")
            ring.shutdown()
            raise CommError(self.failed)
        errno = int(ring.st[tcp_native.S_ERRNO])
        why = os.strerror(errno) if errno else "the connection closed"
        if code == tcp_native.CLOSED_LEFT:
            raise self._fail(what, left, f"a connection closed (receiving: {why})")
        raise self._fail(what, right, f"a connection closed (sending: {why})")

    def _fail(self, what: str, peer: int, cause: str) -> CollectiveTimeoutError:
        late = self.members[peer]
        self.failed = f"{what}: {cause}"
        self.on_lost(late)
        return CollectiveTimeoutError(f"{what}: {cause} waiting for {self.describe(late)} (tcp; its peer in "
                                      f"this transfer)", [late])

    @contextlib.contextmanager
    def afar(self):
        """Around a call that waits on other machines: this rank marked waiting, not late, for
        its machine's ranks meanwhile (NOTE [a peer lost across nodes] 1 in transports/board.py).
        Every wait of the transport is inside one; they nest, across threads too (the caller
        waiting for a part while the transport's thread waits on the ring), and the mark goes
        only when the outermost ends."""
        with self._afar_lock:
            self._afar += 1
            if self._afar == 1:
                self.on_waiting(True)
        try:
            yield
        finally:
            with self._afar_lock:
                self._afar -= 1
                if self._afar == 0:
                    self.on_waiting(False)  # a peer marked lost stays marked

    # -- collectives ------------------------------------------------------------------------------
    def allgather(self, flat: np.ndarray, out: np.ndarray) -> None:
        """``out[q]`` = rank q's ``flat`` (``out``: (size, n) C-contiguous, the same dtype),
        around the ring: at step s this rank forwards row (rank - s) and receives row
        (rank - s - 1). Rows below ``ring_bytes`` are an exchange, whose waits poll before they
        sleep (NOTE [a ring's schedule in compiled code] 11)."""
        p, r = self.size, self.rank
        out[r] = flat
        if p == 1:
            return
        self._run(tcp_native.allgather_schedule(out[0].nbytes, p, r), out, "allgather between machines",
                  exchange=out[0].nbytes < self.ring_bytes)

    def allreduce_array(self, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """In place on ``buf`` (1-D, C-contiguous; uint16 bits for ``kind``): op over every rank's
        ``buf`` (``avg`` sums; the caller divides). From ``ring_bytes`` the ring (NOTE [ring
        schedule] in comm/algorithms/ring.py, run by tcp_native), below it NOTE [a ring over
        TCP] 4."""
        if self.size == 1 or buf.size == 0:
            return
        if buf.nbytes >= self.ring_bytes:
            self._ring_allreduce(buf, op, kind, what)
            return
        if self._rows.nbytes < self.size * buf.nbytes:
            self._rows = np.empty(self.size * buf.nbytes, np.uint8)
        rows = self._rows[:self.size * buf.nbytes].view(buf.dtype).reshape(self.size, -1)
        self.allgather(buf, rows)
        rop = kreduce.SUM if op == kreduce.AVG else op
        if kind:
            kreduce.reduce_many_16(buf, rows, rop, 0, buf.shape[0], kind, self._acc)
        else:
            kreduce.reduce_rows_into(buf, rows, rop, 0, buf.shape[0])

    def _ring_allreduce(self, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """The ring over the streams: the reduce-scatter's chunks reduced as they arrive (in the
        order the left neighbour's partial and this rank's copy stand in the ring), the
        all-gather's received in place."""
        isz = buf.itemsize
        schedule = tcp_native.ring_schedule(buf.shape[0], isz, self.size, self.rank,
                                            max(1, self.chunk_bytes // isz))
        recvs = schedule[1]
        spare = self.ring_scratch.view(buf.dtype)

        def reduce(i: int) -> None:
            a, m = int(recvs[i, tcp_native.R_OFFSET]) // isz, int(recvs[i, tcp_native.R_BYTES]) // isz
            if kind:
                kreduce.reduce_16(buf[a:a + m], spare, op, 0, m, kind)
            else:
                kreduce.reduce_native(buf[a:a + m], spare, op, 0, m)

        with timeline.span("comm", "ring allreduce"):
            self._run(schedule, buf, f"{what}: ring allreduce between machines", reduce)

    # -- the agreement across machines (NOTE [a ring over TCP] 8) --------------------------------
    def largest_node(self, local_size: int) -> int:
        x = np.array([local_size], np.int64)
        with self.afar():
            self.allreduce_array(x, kreduce.MAX, 0, "finding the largest machine")
        return int(x[0])

    def _tables_only(self, coll, inbox: np.ndarray, head: int, nbytes: int, pair, reduction, user=None):
        """Every rank's message around the ring, framed (clause 8): this rank's ``nbytes`` into
        its frame row (the table's last), every rank's into its row of ``inbox``; each rank's
        length, in ring order."""
        frame = self.frame_word(head)
        words = inbox.view(np.int64)
        words[self.rank, frame] = nbytes
        if self.doubling:
            self._doubling(coll, inbox, head, nbytes, pair, reduction)
        elif self.size > 1:
            schedule = tcp_native.framed_schedule(inbox.shape[1], head, frame * 8, self.size, self.rank)
            # the one-shot across nodes' compiled call may have started it (tcp_native clause 8)
            self._run(schedule, inbox, coll, resume=tcp_native.under_way(self.ring_comm.st),
                      exchange=True)
        return words[:, frame].tolist()

    def _doubling(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray,
                  reduction) -> None:
        """The exchange by recursive doubling (clause 9; ``tcp_native.doubling``), gone on with
        where a compiled caller left it; waits and raises as :meth:`_run`'s do (:meth:`_drive`),
        naming the round's peer."""
        ring = self.ring_comm
        partial, op, kind = (reduction[0], reduction[1], reduction[2]) if reduction is not None else (
            np.empty(0, np.float32), 0, 0)
        pair_t = pair.view(partial.dtype)
        st = ring.st
        frame = self.frame_word(head)

        def args(until: int, resume: bool) -> tuple:
            return (st, ring.fds, ring.round_sends, ring.round_recvs, inbox, head, frame, nbytes, pair,
                    pair_t, partial, op, kind, self.rank, _LOWAT_BYTES, until, ring.cells, ring.clock, resume)

        if partial.dtype not in self._doubling_types:
            # A dtype's first exchange: compiled (or loaded from the cache) by one process of the
            # machine at a time (NOTE [one compiler per kernel] in kernels/entry.py), where each
            # rank would compile it at once, inside the collective's wait.
            entry_point(tcp_native.doubling, args(0, False))
            self._doubling_types.add(partial.dtype)

        def go(until_ns) -> int:
            resume = bool(st[tcp_native.S_ROUND])  # a compiled caller's, under way (tcp_native clause 8)
            while (until := until_ns()) is not None:
                code = tcp_native.doubling(*args(until, resume))
                if code != tcp_native.PENDING:
                    return code
                resume = True
            return tcp_native.PENDING

        def peers() -> tuple[int, int, int]:
            peer = self.rank ^ int(st[tcp_native.S_ROUND])
            return peer, peer, peer

        self._drive(what, go, peers)

    # -- recursive doubling by halves (NOTE [a ring's schedule in compiled code] 10) -------------
    @property
    def can_halve(self) -> bool:
        """Whether exchanges here may reduce-scatter and allgather: by recursive doubling."""
        return self.doubling

    @property
    def halving_bytes(self) -> int:
        """The smallest payload the exchange reduce-scatters and allgathers (chosen by
        :meth:`choose_halving` when the group is made); 0: none."""
        return int(self.ring_comm.st[tcp_native.S_HALVING]) if self.doubling else 0

    def set_halving_bytes(self, nbytes: int) -> None:
        self.ring_comm.st[tcp_native.S_HALVING] = nbytes

    def _probe_exchange(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray,
                        reduction: tuple) -> None:
        words = inbox.view(np.int64)
        frame = self.frame_word(head)
        words[:, frame + TABLE_COLS - 1] = -1  # the frame row, which the tables' check skips (clause 8)
        words[self.rank, frame] = nbytes
        self._doubling(what, inbox, head, nbytes, pair, reduction)

    def frame_word(self, head: int) -> int:
        """The int64 word of a message whose ``head`` bytes begin with its table that holds the
        message's length (clause 8: the first of the table's last row)."""
        return head // 8 - TABLE_COLS * self.frame_rows

    def counts(self, inbox: np.ndarray, head: int) -> list[int]:
        """Each rank's message length in the exchange just run over ``inbox`` (clause 8)."""
        return inbox.view(np.int64)[:, self.frame_word(head)].tolist()

    def compiled_exchange(self, inbox: np.ndarray, head: int) -> tuple:
        """What a compiled caller needs to run the exchange over ``inbox`` itself (NOTE [one-shot
        across nodes] 13 in comm/algorithms/oneshot_nodes.py): (st, the ring's framed schedule's
        sends and recvs, recursive doubling's streams and round tables (clause 9), cells, clock,
        right, left, the inbox's address, lowat, first, the frame's word), the ring's arrays by
        reference. The caller writes the frame, runs the ring's schedule (``tcp_native.start``,
        ``advance``) or, where :attr:`doubling`, ``tcp_native.doubling``, and leaves one that does
        not end DONE to :meth:`agree_tables`, which goes on with it."""
        ring, frame = self.ring_comm, self.frame_word(head)
        width = inbox.shape[1]
        sends, recvs, first = tcp_native.framed_schedule(width, head, frame * 8, self.size, self.rank)
        return (ring.st, sends, recvs, ring.fds, ring.round_sends, ring.round_recvs, ring.cells, ring.clock,
                ring.right.fileno(), ring.left.fileno(), inbox.ctypes.data, _LOWAT_BYTES, first, frame)

    def _equal_tables(self, what: str, inbox: np.ndarray, head: int) -> None:
        with self.afar():
            self.allgather(inbox[self.rank], inbox)

    def allreduce(self, srcs: Fused, dsts: Fused, op: int, dtype, kind: int, ckind: int = 0, root: int = -1,
                  gate=NO_GATE) -> None:
        """``dsts`` = op over every rank's ``srcs`` (``root`` >= 0: written on that rank only),
        the whole message around the ring (the ``tcp`` algorithm; the agreement has run)."""
        gate.ready(srcs.n)

        def reduce(buf: np.ndarray) -> None:
            with self.afar():
                self.allreduce_array(buf, op, kind, "allreduce" if root < 0 else "reduce")
            if op == kreduce.AVG:
                divide(buf, self.size, kind)

        reduce_flat(srcs, dsts, dtype, ckind, root < 0 or root == self.rank, reduce)
        gate.wrote(srcs.n)

    # -- in the background (NOTE [overlap across nodes] in comm/algorithms/segment.py) ----------
    def start_allreduce(self, buf: np.ndarray, op: int, kind: int, what: str) -> Future:
        """:meth:`allreduce_array` of ``buf`` on this transport's own thread, after the ones
        started before; a future of None (or of the error). The caller leaves ``buf`` alone and
        calls nothing else of the transport until the future is done."""
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="terrapipe-tcp", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((future, buf, op, kind, what))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, buf, op, kind, what = job
            try:
                self.allreduce_array(buf, op, kind, what)
            except BaseException as e:  # noqa: BLE001 (the waiting caller raises it)
                future.set_exception(e)
            else:
                future.set_result(None)

    def abort(self, why: str) -> None:
        """End the transfers under way and queued (their futures raise CommError naming ``why``,
        no peer blamed); the transport is unusable after."""
        self._aborted = why
        self.failed = self.failed or f"ended on this rank ({why})"
        if self.ring_comm is not None and os.getpid() == self._pid:
            self.ring_comm.shutdown()

    def close(self) -> None:
        """Close the streams and end the background thread (waiting for it: an allreduce under
        way ends at once, its streams shut). In a forked child, only the child's copies of the
        sockets close: the streams stay the parent's."""
        if self._thread is not None and os.getpid() == self._pid:
            self.abort("the transport closed")
            self._jobs.put(None)
            self._thread.join()
        self._thread = None
        if self.ring_comm is not None:
            self.ring_comm.close()
            self.ring_comm = None
