"""The TCP transport: a ring of byte streams among a few ranks on different machines, for the
exchange between machines of a group with shared memory on each that has no MPI (a torchrun job
or an elastic generation across machines: NOTE [machines over Gloo] in comm/group.py).

NOTE [a ring over TCP]
    1. Each rank connects to the next rank (its right) and accepts the previous one (its left),
       verified as NOTE [connecting ranks] in comm/sockets.py says: a stream to the right that
       this rank only writes, one from the left that it only reads, so each stream has one
       writer and one reader.
    2. Transfers are requests as MPI's are (:meth:`TcpRing.Isend`, :meth:`TcpRing.Irecv`),
       matched in the order they were posted: a stream keeps its bytes in order, so no tag is
       needed. Every wait drives every pending request of both streams (non-blocking sockets,
       a selector), so a rank waiting for its left neighbour keeps writing to its right one and
       no two ranks wait on each other's sends.
    3. So the ring of comm/algorithms/ring.py runs over it unchanged. Its done messages carry no
       bytes and complete at once, which is right here: a send is complete once the kernel holds
       its bytes, and the kernel delivers them without this process (NOTE [MPI progress] is
       MPI's alone).
    4. Below ``ring_bytes`` an allreduce is an allgather of the whole buffer around the ring and
       one reduction of the rows in rank order, 16-bit floats in float32 rounded once: one
       transfer per step where the ring takes two, and every rank adds in the same order, so
       every rank holds the same bits (DDP's replicas must stay identical). Between two
       machines both ways carry the same bytes; among four the allgather carries twice the
       ring's. Over 1gbit at 4 nodes x 1 (Intel Xeon, 2026-11-27,
       ``link_latency_4x1_1gbit_2026-11-27.json``) the allgather took 404 us at 4 KiB where the
       ring took 1026, and 1641 us at 64 KiB where the ring took 1043: hence 32 KiB.
    5. A wait sleeps in the selector (``select`` with the time left), not on the core. One that
       passes the timeout raises CollectiveTimeoutError naming the peer it waits for (its left
       neighbour for a receive, its right one for a send), after telling ``on_lost`` (NOTE [a
       peer lost across nodes] in transports/board.py); a stream the peer closed (its process
       died, its machine went away) raises at once, naming that peer. The transport is then
       unusable, as the group is.
    6. Why not Gloo, which such a group also has: between two machines of the emulated cluster
       over 1gbit (Intel Xeon, 2026-11-27, ``link_latency_2x1_1gbit_2026-11-27.json``) a 4 KiB
       ping-pong over these streams took 28 us, this ring's allreduce of 4 KiB 25 us, and Gloo's
       between the same two ranks 1.9 ms; at 256 KiB 2.19 ms both ways, Gloo's 3.26 (NOTE
       [machines over Gloo] 7 in comm/group.py has what that made of a whole allreduce).
    7. A wait for a receive asks the kernel to wake it only once 256 KiB more of the awaited
       transfer (or the rest of it) has arrived (``SO_RCVLOWAT``; the kernel caps it at half
       the receive buffer, and a stream the peer closed wakes it at once), not at every
       segment that lands: each wake costs a few tens of microseconds of Python. At 4 nodes x
       1 over 1gbit (Intel Xeon, 2 cores, 2026-11-28), a 16 MiB allreduce took 37 ms of CPU
       per rank waking at every arrival and 24.5 with 256 KiB a wake, at the same wall time
       (211-214 ms, the links' bound). A whole chunk (1 MiB) a wake took 19 ms of CPU but
       2-5% more wall time at 4 and 8 MiB, where a segment is one chunk: the copy out of the
       kernel then waits for the chunk's last byte instead of following its arrival.
       Where the kernel does not cap it (before Linux 4.19) a receive larger than the buffer
       would wake only at the wait's nap (``_NAP_S``): slow, never stuck.

Why one module: the two streams (:class:`TcpRing`: requests, progress, the wake threshold) and
the transport over them (:class:`TcpTransport`: waits with their timeout and blame, the
collectives, the background thread, abort and close) are one state machine on the same two
sockets; NOTE [a ring over TCP]'s clauses cite both, and split, a reader would follow every
wait across two files.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ... import settings
from ...kernels import reduce as kreduce
from ..errors import CollectiveTimeoutError, CommError
from ..message import NO_GATE, Fused, divide, reduce_flat
from ..sockets import connect_ranks
from ..wait import wait_until

__all__ = ["TcpTransport", "TcpRing"]

_NAP_S = 0.05  # the longest one select() sleeps before the wait's failure check runs again
# The most bytes a wait for a receive asks the kernel to gather before it wakes (SO_RCVLOWAT,
# NOTE [a ring over TCP] 7): a quarter of the ring's chunk.
_LOWAT_BYTES = 256 << 10


class _Closed(Exception):
    def __init__(self, peer: int, why: str) -> None:
        super().__init__(why)
        self.peer, self.why = peer, why


class _Request:
    """One transfer on a stream: ``view`` (bytes), how far it has got. MPI's ``Test`` name."""

    __slots__ = ("view", "done_bytes")

    def __init__(self, arr: np.ndarray) -> None:
        if not arr.flags.c_contiguous:
            raise CommError(f"tcp ring: a transfer needs a C-contiguous array, got strides {arr.strides}")
        self.view = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else None
        self.done_bytes = 0

    @property
    def done(self) -> bool:
        return self.view is None or self.done_bytes == self.view.nbytes

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name: comm/algorithms/ring.py polls it)
        return self.done


class TcpRing:
    """The two streams of NOTE [a ring over TCP] 1 and their pending requests, with mpi4py's
    names for what comm/algorithms/ring.py calls (``Get_rank``, ``Get_size``, ``Isend`` to the
    right neighbour, ``Irecv`` from the left one). ``right``, ``left``: connected sockets."""

    def __init__(self, rank: int, size: int, right: socket.socket, left: socket.socket) -> None:
        self.rank, self.size = rank, size
        self.right, self.left = right, left
        self._sends: deque[_Request] = deque()
        self._recvs: deque[_Request] = deque()
        self._sel = selectors.DefaultSelector()
        self.closed: _Closed | None = None
        self._events: dict[socket.socket, int] = {}
        self._lowat = 1  # the left stream's SO_RCVLOWAT as last set
        right.setblocking(False)
        left.setblocking(False)

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Isend(self, arr: np.ndarray, dest: int, tag: int = 0) -> _Request:  # noqa: N802
        """Queue ``arr`` (the caller keeps it unchanged until done) for the right neighbour."""
        if dest != (self.rank + 1) % self.size:
            raise CommError(f"tcp ring: rank {self.rank} sends only to its right neighbour, not {dest}")
        req = _Request(arr)
        if not req.done:
            self._sends.append(req)
            self.progress(0.0)
        return req

    def Irecv(self, arr: np.ndarray, source: int, tag: int = 0) -> _Request:  # noqa: N802
        """Queue ``arr`` (written by the waits until done) for the left neighbour's next bytes."""
        if source != (self.rank - 1) % self.size:
            raise CommError(f"tcp ring: rank {self.rank} receives only from its left neighbour, not {source}")
        req = _Request(arr)
        if not req.done:
            self._recvs.append(req)
            self.progress(0.0)
        return req

    def _want(self, s: socket.socket, events: int) -> None:
        had = self._events.get(s, 0)
        if events == had:
            return
        if not had:
            self._sel.register(s, events)
        elif not events:
            self._sel.unregister(s)
        else:
            self._sel.modify(s, events)
        self._events[s] = events

    def _send_some(self) -> None:
        while self._sends:
            req = self._sends[0]
            try:
                n = self.right.send(req.view[req.done_bytes:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _Closed((self.rank + 1) % self.size, f"sending: {e}") from e
            req.done_bytes += n
            if not req.done:
                return
            self._sends.popleft()

    def _recv_some(self) -> None:
        while self._recvs:
            req = self._recvs[0]
            try:
                n = self.left.recv_into(req.view[req.done_bytes:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise _Closed((self.rank - 1) % self.size, f"receiving: {e}") from e
            if n == 0:
                raise _Closed((self.rank - 1) % self.size, "receiving: the connection closed")
            req.done_bytes += n
            if not req.done:
                return
            self._recvs.popleft()

    def progress(self, wait_s: float) -> None:
        """Move what the streams take now; with ``wait_s`` > 0 first sleep up to that long in
        ``select`` for one of them to be ready (NOTE [a ring over TCP] 2, 5). A stream that
        failed is kept in ``closed`` (the peer, why) and nothing moves any more."""
        if self.closed is not None:
            return
        try:
            self._send_some()
            self._recv_some()
            if wait_s <= 0 or not (self._sends or self._recvs):
                return
            self._want(self.right, selectors.EVENT_WRITE if self._sends else 0)
            self._want(self.left, selectors.EVENT_READ if self._recvs else 0)
            if self._recvs:  # NOTE [a ring over TCP] 7
                head = self._recvs[0]
                lowat = max(1, min(head.view.nbytes - head.done_bytes, _LOWAT_BYTES))
                if lowat != self._lowat:
                    self.left.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                    self._lowat = lowat
            if self._sel.select(wait_s):
                self._send_some()
                self._recv_some()
        except _Closed as e:
            self.closed = e

    def shutdown(self) -> None:
        """End both streams now (a wait on them wakes and fails); another thread may be waiting."""
        for s in (self.right, self.left):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sel.close()
        for s in (self.right, self.left):
            with contextlib.suppress(OSError):
                s.close()


class TcpTransport:
    """Allreduce and allgather among ``comm``'s ranks (a :class:`~terrapipe.comm.store.StoreComm`
    or mpi4py communicator over which the streams are set up; collective) over a ring of TCP
    streams (NOTE [a ring over TCP]). ``members[i]``: the group rank of rank i, for errors;
    ``hosts``: each rank's machine, for errors. What the machines' tier of a Gloo group needs
    of its ``cross`` transport (NOTE [machines over Gloo] in comm/group.py): ``allreduce_array``,
    ``allgather``, ``afar``, ``on_lost``, ``on_waiting``."""

    name = "tcp"

    def __init__(self, comm, timeout: float, members: list[int] | None = None,
                 hosts: list[str] | None = None) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.members = list(members) if members is not None else list(range(self.size))
        self.hosts = hosts
        self.on_lost: Callable[[int], None] = lambda rank: None
        self.on_waiting: Callable[[bool], None] = lambda waiting: None
        self.ring_bytes = settings.get("TERRAPIPE_TCP_RING_BYTES")
        self.chunk_bytes = 1 << 20
        self.ring_scratch = np.empty(2 * self.chunk_bytes, np.uint8)
        self.done_sends: list = []
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
            self.ring_comm = TcpRing(self.rank, self.size, reached[right], accepted[left])
        else:
            self.ring_comm = None

    def describe(self, peer: int) -> str:
        """Rank ``peer`` of this ring as the group numbers it, with its machine where known."""
        where = f" on {self.hosts[peer]}" if self.hosts is not None else ""
        return f"rank {self.members[peer]}{where}"

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, req: _Request, what: str, peer: int) -> None:
        """Drive the streams until ``req`` is done (NOTE [a ring over TCP] 2, 5), or raise
        CollectiveTimeoutError naming ``peer`` (this ring's rank the request depends on)."""
        if self.failed is not None:
            raise CommError(f"{what}: the TCP ring is unusable after an earlier failure ({self.failed})")
        ring = self.ring_comm
        deadline = time.monotonic() + self.timeout

        def nap() -> bool:
            ring.progress(min(_NAP_S, max(0.0, deadline - time.monotonic())))
            return req.done or ring.closed is not None

        def failure(timed_out: bool) -> Exception | None:
            if not timed_out:
                return None
            return self._fail(what, peer, f"Timed out after {self.timeout:g}s")

        def done() -> bool:
            ring.progress(0.0)
            return req.done or ring.closed is not None

        if not done():
            with self.afar():  # as MpiTransport.wait_all marks itself, whoever called the wait
                wait_until(done, self.timeout, failure, nap=nap, sleep_after=0.0)
        if ring.closed is not None and not req.done:
            if self._aborted is not None:  # this rank ended the streams: no peer is to blame
                raise CommError(f"{what}: ended on this rank ({self._aborted})")
            raise self._fail(what, ring.closed.peer, f"a connection closed ({ring.closed.why})")

    def _fail(self, what: str, peer: int, cause: str) -> CollectiveTimeoutError:
        late = self.members[peer]
        self.failed = f"{what}: {cause}"
        self.on_lost(late)
        return CollectiveTimeoutError(f"{what}: {cause} waiting for {self.describe(peer)} (tcp; its peer in "
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
        (rank - s - 1)."""
        p, r = self.size, self.rank
        out[r] = flat
        if p == 1:
            return
        ring = self.ring_comm
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):
            send = ring.Isend(out[(r - s) % p], right)
            recv = ring.Irecv(out[(r - s - 1) % p], left)
            self.wait(recv, "allgather between machines (receiving)", left)
            self.wait(send, "allgather between machines (sending)", right)

    def allreduce_array(self, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """In place on ``buf`` (1-D, C-contiguous; uint16 bits for ``kind``): op over every rank's
        ``buf`` (``avg`` sums; the caller divides). From ``ring_bytes`` the ring of
        comm/algorithms/ring.py, below it NOTE [a ring over TCP] 4."""
        if self.size == 1 or buf.size == 0:
            return
        if buf.nbytes >= self.ring_bytes:
            from ..algorithms import ring

            ring.allreduce_array(self, buf, op, kind, what)
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

    def agree(self, coll: str, sig: np.ndarray, check) -> None:
        """The signature agreement of a group whose only ring this is (NOTE [machines over
        Gloo] 8 in comm/group.py): every rank's signature around the ring; a barrier too."""
        sigs = np.empty((self.size, sig.shape[0]), np.int64)
        with self.afar():
            self.allgather(np.ascontiguousarray(sig, np.int64), sigs)
        if not (sigs == sigs[0]).all():
            check(sigs, self.members)

    def barrier(self) -> None:
        pass  # the agreement (an allgather of signatures) was the barrier

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
