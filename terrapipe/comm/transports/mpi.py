"""The MPI transport: point-to-point and MPI's own collectives over one mpi4py communicator.

Used between nodes (one communicator per local rank across nodes, for the hierarchical
allreduce), for every collective when MPI is forced or nodes differ in rank count, and on one
node for messages where MPI beats the shared segment (comm/select.py). It carries two
algorithms: MPI's own collectives (comm/algorithms/native.py; for 16-bit formats an allgather
reduced with float32 accumulation) and our chunked ring (comm/algorithms/ring.py), which runs
on a duplicate communicator of its own (``ring_comm``) with the settings the autotuner tunes.

Every request is polled, never waited on blindly: a wait that outlasts the timeout raises
CollectiveTimeoutError naming the ranks it waits for. NOTE [MPI progress] in
comm/algorithms/ring.py says why a rank keeps MPI's progress engine turning while it waits
elsewhere, and why the transport ends with a barrier in which every rank progresses.

Why one module: everything here moves bytes over one communicator and answers for it alike
(its waits, its timeouts naming ranks, its failures): the ring's steps, MPI's own collectives,
the agreement's exchange and the measurement that chooses how that exchange goes (NOTE [MPI
from compiled code] 9 in comm/transports/mpi_native.py) share its requests, duplicates and
polls; split, each would reach into the others' state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import settings, timeline
from ...kernels import reduce as kreduce
from .. import ops
from ..errors import CollectiveTimeoutError, CommError
from ..message import NO_GATE, Fused, divide, reduce_flat, segments
from ..wait import wait_until
from .base import NodeTables, OwnCollectives
from .board import LOST
from .mpi_native import C_HALVING, DONE, PENDING, bind

__all__ = ["MpiTransport", "RING_BYTES", "CHUNK_BYTES"]

# At or above this many bytes an allreduce over MPI runs as our chunked ring (NOTE [ring
# schedule] in comm/algorithms/ring.py); below it MPI's own allreduce (NOTE [algorithm
# selection] 8 in comm/select.py). Measured by benchmarks.allreduce --algorithms.
RING_BYTES = settings.SETTINGS["TERRAPIPE_RING_BYTES"].default  # without the setting or tune()
# Per-message cost (MPICH's rendezvous handshake) outweighs cache fit: at 2 ranks here 512 KiB
# chunks ran 10-13% faster than 256 KiB from 1 to 64 MiB, and larger ones lose the overlap of
# receiving and reducing at 16 MiB and up (benchmarks.allreduce).
CHUNK_BYTES = 512 << 10
# The agreement's messages between nodes (NOTE [agreement across nodes] in comm/transports/shm.py),
# on a duplicate communicator of their own.
AGREE_TAG = 7203
# Yields an exchange in compiled code makes before Python asks whether a peer died or the time
# is up (NOTE [MPI from compiled code] 4). A 4 KiB exchange across emulated nodes sharing two
# cores took under two yields on average.
NATIVE_SPINS = 64
class MpiTransport(OwnCollectives, NodeTables):
    """Transfers over ``comm`` (mpi4py). ``members[i]``: the group rank of rank i of ``comm``;
    ``timeout``: seconds a request may take; ``late_hint()``: (group ranks, why) known to be
    late from elsewhere (the node's board), or None, to name in a timeout; ``hosts``: each
    group rank's host name, to name a rank on another node by its host. Settable:
    ``on_waiting(True/False)`` is told when a wait for peers begins to take long and when it
    ends, ``on_lost(rank)`` the peer a transfer timed out on, before the error is raised (the
    node's board passes both on to the ranks waiting for this one, NOTE [a peer lost across
    nodes] in comm/transports/board.py). The ring's state
    (``ring_comm``, ``done_sends``, ``ring_scratch``, ``ring_bytes``, ``chunk_bytes``) lives
    here, one per communicator."""

    name = "mpi"

    def __init__(self, comm, members: list[int], timeout: float,
                 late_hint: Callable[[], tuple[list[int], str] | None] = lambda: None,
                 hosts: list[str] | None = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.ring_comm = comm.Dup()  # ring traffic never meets MPI's own or the user's messages
        self.agree_comm = comm.Dup()  # nor does the agreement's (exchange())
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._others = [q for q in range(self.size) if q != self.rank]
        self._statuses = [MPI.Status() for _ in range(2 * self.size)]  # exchange()'s
        self.members = members
        self.timeout = timeout
        self._late_hint = late_hint
        self._hosts = hosts
        self.on_lost: Callable[[int], None] = lambda rank: None
        self.on_waiting: Callable[[bool], None] = lambda waiting: None
        self.done_sends: list = []  # the ring's done messages not known complete (NOTE [MPI progress] 3)
        self.ring_bytes = settings.get("TERRAPIPE_RING_BYTES")  # this large or larger: the ring (tune())
        self.chunk_bytes = CHUNK_BYTES  # the ring's message size (tune())
        self.ring_scratch = np.empty(2 * CHUNK_BYTES, np.uint8)  # the ring's receive buffers
        self._acc = np.empty(kreduce.TILE, np.float32)
        native = settings.get("TERRAPIPE_MPI_NATIVE")
        self.native = bind(self.agree_comm, AGREE_TAG, self.doubling) if native else None

    @property
    def halving_bytes(self) -> int:
        """The smallest payload the compiled exchange reduce-scatters and allgathers among these
        nodes (NOTE [MPI from compiled code] 8-9); 0: none (fewer than four nodes, not a power
        of two, or the mpi4py exchange, which never does)."""
        return int(self.native.cfg[C_HALVING]) if self.native is not None else 0

    @property
    def can_halve(self) -> bool:
        """Whether exchanges here may reduce-scatter (NOTE [MPI from compiled code] 8): the
        compiled exchange by recursive doubling."""
        return self.native is not None and self.doubling

    def set_halving_bytes(self, nbytes: int) -> None:
        self.native.cfg[C_HALVING] = nbytes

    def _probe_exchange(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray,
                        reduction: tuple) -> None:
        self._exchange_native(what, inbox, head, nbytes, pair, reduction)

    # -- waiting ------------------------------------------------------------------------------
    def wait(self, req, what: str, peer: int | None = None, polls: int = 1) -> None:
        """Poll ``req`` until done, or raise CollectiveTimeoutError after the timeout naming the
        ranks it waits for (``peer``: the one rank of ``comm`` it depends on, if one).
        ``polls``: tests between yields of the core (:meth:`wait_all`)."""
        if not req.Test():
            self.wait_all([req], what, peer, polls=polls)

    def wait_all(self, reqs: list, what: str, peer: int | None = None, statuses: list | None = None,
                 late: Callable[[], list[int]] | None = None, polls: int = 1) -> None:
        """Poll ``reqs`` until all are done (NOTE [waiting for a peer] in comm/wait.py: never
        asleep, for this rank's own polls drive MPI's progress), or raise CollectiveTimeoutError
        naming the ranks waited for, after the timeout or at once when the node's board says
        one died; the requests are then cancelled where MPI can. ``statuses``: filled as
        ``Testall`` does; ``late()``: the ranks of ``comm`` not yet heard from, asked only once
        the wait fails (else ``peer``, the one rank waited for, if one). ``polls``: tests
        between yields of the core, for a wait on one large transfer (``RING_POLLS``)."""
        Testall = self._MPI.Request.Testall
        if Testall(reqs, statuses):
            return
        done = lambda: Testall(reqs, statuses)  # noqa: E731
        if polls > 1 and len(reqs) == 1 and statuses is None:
            test = reqs[0].Test

            def done() -> bool:
                for _ in range(polls):
                    if test():
                        return True
                return False
        # No spinning before the first yield: where ranks outnumber cores (emulated nodes, a
        # busy machine), a rank spinning on Test keeps its peer, whose progress it waits for,
        # off the core: a 4 KiB Iallreduce polled without yielding took 8.3 ms at 2x2 on two
        # cores, 0.22 ms yielding; on a core of its own a yield costs a system call. A ring
        # step's transfer of half a MiB tests several times a yield (NOTE [ring schedule] 4).
        self.on_waiting(True)
        try:
            wait_until(done, self.timeout,
                       lambda timed_out: self._failure(reqs, timed_out, what, peer, late), sleep_after=None)
        finally:
            self.on_waiting(False)  # a peer marked lost stays marked

    def _failure(self, reqs: list, timed_out: bool, what: str, peer: int | None,
                 late: Callable[[], list[int]] | None = None) -> Exception | None:
        hint = self._late_hint()
        lost = hint is not None and hint[1] == LOST
        died = hint is not None and hint[1] == "died" or lost  # no use waiting out the timeout
        if not (died or timed_out):
            return None
        missing = late() if late is not None else []
        if missing:
            peer = missing[0] if len(missing) == 1 else None
        for req in reqs:
            try:
                req.Cancel()
            except self._MPI.Exception:
                pass  # a collective's request cannot be cancelled; it is abandoned
        if died:
            late, why = hint
        elif len(missing) > 1 and hint is None:
            late, why = [self.members[q] for q in missing], "one of these never arrived"
        else:
            late, why = self._late_ranks(peer)
        me = self.members[self.rank]
        if not died and len(late) == 1 and self._hosts is not None \
                and self._hosts[late[0]] != self._hosts[me]:
            self.on_lost(late[0])  # one peer, on another node
        names = ", ".join(self.describe(r) for r in late)
        cause = ("a rank of this node lost a peer" if lost else "a peer died" if died
                 else f"Timed out after {self.timeout:g}s")
        return CollectiveTimeoutError(f"{what}: {cause} in MPI waiting for {names} ({why})", late)

    def describe(self, rank: int) -> str:
        """Group rank ``rank`` for a message: "rank 2", or "rank 2 on node1" where the ranks
        span hosts."""
        if self._hosts is None or len(set(self._hosts)) < 2:
            return f"rank {rank}"
        return f"rank {rank} on {self._hosts[rank]}"

    def _late_ranks(self, peer: int | None) -> tuple[list[int], str]:
        hint = self._late_hint()
        if hint is not None:
            return hint
        if peer is not None:
            return [self.members[peer]], "its peer in this transfer"
        me = self.members[self.rank]
        others = [r for r in self.members if r != me]
        return others, ("the one other rank of this communicator" if len(others) == 1
                        else "one of these never arrived")

    def progress(self) -> None:
        """One turn of MPI's progress engine (NOTE [MPI progress] 4 in comm/algorithms/ring.py)."""
        self.ring_comm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG)

    # -- collectives ---------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        sigs = np.empty((self.size, sig.shape[0]), np.int64)
        self.wait(self.comm.Iallgather(sig, sigs), coll)
        check(sigs, self.members)

    @property
    def doubling(self) -> bool:
        """Whether exchanges go by recursive doubling (NOTE [agreement across nodes] 3 in
        comm/transports/shm.py): among a power of two of at least four ranks."""
        return self.size >= 4 and self.size & (self.size - 1) == 0

    def _tables_only(self, coll, inbox: np.ndarray, head: int, nbytes: int, pair, reduction, user=None):
        if self.native is not None:
            return self._exchange_native(coll, inbox, head, nbytes, pair, reduction, user)
        if self.doubling:
            return self.exchange_doubling(coll, inbox, head, nbytes, pair, reduction)
        return self.exchange(coll, inbox, nbytes)

    def _equal_tables(self, what: str, inbox: np.ndarray, head: int) -> None:
        pair = np.zeros((2, self.size // 2 * head), np.uint8) if self.doubling else None
        self._tables_only(what, inbox, head, head, pair, None)

    def largest_node(self, local_size: int) -> int:
        return int(self.comm.allreduce(local_size, op=self._MPI.MAX))

    def raise_native_error(self, what: str, state: int) -> None:
        """Raise minus ``state``, an MPI error code from the compiled exchange, with MPI's text,
        after cancelling what it had posted."""
        self.native.abandon()
        text = self._MPI.Get_error_string(-state)
        raise CommError(f"{what}: MPI failed in the exchange between nodes: {text}")

    def _exchange_native(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair, reduction,
                         user=None):
        """The exchange in compiled code (NOTE [MPI from compiled code] 4-6): None once every
        table agrees, else each rank's message length (a mismatch for the caller to describe)."""
        native = self.native
        state = native.start(inbox, head, nbytes, pair, reduction, NATIVE_SPINS, user)
        if state == PENDING:
            self.on_waiting(True)
            try:
                wait_until(lambda: native.resume() != PENDING, self.timeout,
                           lambda timed_out: self._native_failure(timed_out, what), sleep_after=None,
                           check_every=1)
            finally:
                self.on_waiting(False)
            state = native.state
        if state == DONE:
            return None
        if state < 0:
            self.raise_native_error(what, state)
        return [int(c) for c in native.counts]

    def _native_failure(self, timed_out: bool, what: str) -> Exception | None:
        native = self.native
        error = self._failure([], timed_out, what, None, native.late)
        if error is not None:
            native.abandon()
        return error

    def exchange(self, what: str, inbox: np.ndarray, nbytes: int) -> list[int]:
        """Send ``inbox[rank, :nbytes]`` to every other rank of ``comm`` and receive each one's
        message into its row of ``inbox`` ((size, width) uint8; every message of an exchange
        fits a row). Lengths may differ between ranks (NOTE [agreement across nodes] in
        comm/transports/shm.py): returns each rank's message length, in rank order. The
        receives are posted before the sends and polled together, one MPI call a poll. Raises
        CollectiveTimeoutError naming the ranks not heard from within the timeout."""
        comm, others = self.agree_comm, self._others
        recvs = [comm.Irecv(inbox[q], source=q, tag=AGREE_TAG) for q in others]
        reqs = recvs + [comm.Isend(inbox[self.rank, :nbytes], dest=q, tag=AGREE_TAG) for q in others]
        statuses = self._statuses[: len(reqs)]
        self.wait_all(reqs, what, statuses=statuses, late=lambda: [
            q for q, r in zip(others, recvs, strict=True) if not r.Test()])
        counts = [nbytes] * self.size
        byte = self._MPI.BYTE
        for q, st in zip(others, statuses[: len(others)], strict=True):
            counts[q] = st.Get_count(byte)
        return counts

    def exchange_doubling(self, what: str, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray,
                          reduction: tuple | None) -> list[int]:
        """:meth:`exchange` in log2(size) rounds (NOTE [agreement across nodes] 3 in
        comm/transports/shm.py): in round k this rank and rank ``rank ^ 2**k`` swap the tables
        of their halves so far and their payloads, each received into its sender's rows of
        ``inbox`` (tables) and of ``pair`` ((2, width) uint8 scratch, width at least size / 2
        tables and a payload: row 0 the lower half's message, its tables first, row 1 the
        upper's, its tables last). After each round the two payloads are reduced lower row
        first into this rank's, at ``inbox[rank, head:nbytes]`` (``reduction``: (partial, op,
        kind, scratch, acc), ``partial`` that payload as its dtype), so the payload carries
        its half's reduction into the next round, and the last round leaves the whole group's
        there; with ``reduction`` None payloads are not sent. Returns each round's received
        length per rank of the peer's half, rank order, as :meth:`exchange` does: ``head`` +
        payload where all agree."""
        comm, me, MPI = self.agree_comm, self.rank, self._MPI
        payload = nbytes - head if reduction is not None else 0
        mine = inbox[me, head:head + payload]
        counts = [nbytes] * self.size
        statuses = self._statuses[:2]
        k = 1
        while k < self.size:
            peer = me ^ k
            base, peer_base = me & ~(k - 1), peer & ~(k - 1)
            slot, tables = int(me > peer), k * head  # this half's row of pair; bytes of tables
            out = pair[slot]
            # this half's tables and the payload so far, the tables first from the lower rank,
            # last from the upper (NOTE [MPI from compiled code] 10 in mpi_native.py)
            at, pay = (payload, 0) if slot else (0, tables)  # where the tables and the payload go
            for i in range(k):
                out[at + i * head:at + (i + 1) * head] = inbox[base + i, :head]
            out[pay:pay + payload] = mine
            recv = comm.Irecv(pair[1 - slot], source=peer, tag=AGREE_TAG)
            send = comm.Isend(out[:tables + payload], dest=peer, tag=AGREE_TAG)
            # On a failure: the peer's half, for the peer may be waiting on a rank of it (a rank
            # lost there is the peer's to name, and a peer one round behind is waiting for it).
            self.wait_all([recv, send], what, statuses=statuses,
                          late=lambda first=peer_base, k=k: list(range(first, first + k)))
            got = statuses[0].Get_count(MPI.BYTE)
            theirs = pair[1 - slot]
            toff = 0 if slot else max(got - tables, 0)  # the upper rank's tables end its message
            for i in range(k):
                inbox[peer_base + i, :head] = theirs[toff + i * head:toff + (i + 1) * head]
            if got != tables + payload:  # another call's message: its tables tell which
                for i in range(k):
                    counts[peer_base + i] = head + max(got - tables, 0)
            elif reduction is not None:  # the halves' partials, lower first
                partial, op, kind, _, _ = reduction
                n, t = partial.shape[0], tables // partial.itemsize
                rows = pair.view(partial.dtype)
                kreduce.reduce_pair(partial, rows[0, t:t + n], rows[1, :n], op, kind)
            k <<= 1
        return counts

    def allreduce(self, srcs: Fused, dsts: Fused, op, dtype, kind, ckind=0, root=-1, gate=NO_GATE) -> None:
        gate.ready(srcs.n)

        def reduce(buf: np.ndarray) -> None:
            self.allreduce_array(buf, op, kind, "allreduce")
            if op == kreduce.AVG:
                divide(buf, self.size, kind)

        reduce_flat(srcs, dsts, dtype, ckind, root < 0 or root == self.members[self.rank], reduce)
        gate.wrote(srcs.n)

    def allreduce_array(self, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """MPI's own allreduce, in place on ``buf`` (1-D, C-contiguous; uint16 bits for
        ``kind``: an allgather reduced with float32 accumulation); ``avg`` sums (the caller
        divides, by the size of the whole group when this is its cross-node part)."""
        if kind:
            gathered = np.empty((self.size, buf.shape[0]), buf.dtype)
            self.wait(self.comm.Iallgather(buf, gathered), what)
            kreduce.reduce_many_16(buf, gathered, op, 0, buf.shape[0], kind, self._acc)
        else:
            MPI = self._MPI
            mop = getattr(MPI, ops.by_code(op).mpi)
            with timeline.span("comm", "MPI allreduce"):
                self.wait(self.comm.Iallreduce(MPI.IN_PLACE, buf, mop), what)

    def tune(self, ring_bytes: int | None, chunk_bytes: int | None) -> None:
        """Set the ring's threshold and chunk (bytes) for the collectives that follow; every
        rank must set the same values at the same point of its collective sequence."""
        if ring_bytes is not None:
            self.ring_bytes = int(ring_bytes)
        if chunk_bytes is not None:
            self.chunk_bytes = int(chunk_bytes)
            if self.ring_scratch.shape[0] < 2 * self.chunk_bytes:
                self.ring_scratch = np.empty(2 * self.chunk_bytes, np.uint8)

    def broadcast(self, flat, root) -> None:
        self.wait(self.comm.Ibcast(flat, root=self.members.index(root)), "broadcast")

    def allgather(self, flat, out, root=-1) -> None:
        if root >= 0:
            local_root = self.members.index(root)
            recv = out if self.rank == local_root else None
            self.wait(self.comm.Igather(flat, recv, root=local_root), "gather")
        else:
            self.wait(self.comm.Iallgather(flat, out), "allgather")

    def scatter(self, full, out, root) -> None:
        local_root = self.members.index(root)
        self.wait(self.comm.Iscatter(full if self.rank == local_root else None, out, root=local_root),
                  "scatter")

    def reduce_scatter(self, flat, out, op, kind) -> None:
        # Through a full allreduce: simple, and correct for every dtype and topology.
        tmp = flat.copy()
        self.allreduce_array(tmp, op, kind, "reduce_scatter")
        lo, hi = segments(flat.shape[0], self.size)[self.rank]
        out[...] = tmp[lo:hi]
        if op == kreduce.AVG:
            divide(out, self.size, kind)

    def barrier(self) -> None:
        self.wait(self.comm.Ibarrier(), "barrier")

    def send(self, flat, dest, tag) -> None:
        self.wait(self.comm.Isend(flat, dest=self.members.index(dest), tag=tag), f"send to rank {dest}",
                  self.members.index(dest))

    def recv(self, flat, source, tag) -> None:
        self.wait(self.comm.Irecv(flat, source=self.members.index(source), tag=tag),
                  f"recv from rank {source}", self.members.index(source))

    def close(self) -> None:
        """Every rank progresses MPI until every rank got here (NOTE [MPI progress] 3): the done
        messages and MPI's own sends still waiting on a peer complete before MPI goes."""
        reqs, self.done_sends = self.done_sends, []
        try:
            self.wait_all(reqs + [self.comm.Ibarrier()], "closing the group")
        except CollectiveTimeoutError:
            pass  # a peer died or never closed: nothing is left to protect, and exit must go on
