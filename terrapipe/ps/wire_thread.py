"""The one thread per process that moves the parameter server's bytes between nodes: it serves
the requests that other nodes' ranks send for this rank's shards, and it issues this rank's
requests to theirs, for every open ShardedTensor.

NOTE [one thread on the wire]
    1. The parameter server calls MPI from this thread only. Under MPICH's UCX netmod over TCP,
       a request/reply loop whose requests are issued on one thread and served on another
       never completes its first request between two nodes, with or without a lock making the
       two threads' calls take turns; on one node it runs, and so does the same loop with every
       call on one thread (47 us a request at 2 nodes x 1 over 1gbit). So a client hands its
       requests for shards on other nodes to this thread (:meth:`WireThread.submit`) and waits
       for them (:meth:`Request.wait`). Not solved by it: this thread beside another that runs
       collectives at the same moment still stalls there now and then (even with every MPI call
       of both under one lock), so a job that mixes the two across nodes needs MPICH's OFI
       netmod (docs/cluster.md).
    2. Each round the thread runs the actions handed to it (a tensor registered, a request
       issued: the replies' receives posted, then the header and the data sent, NOTE [shard
       wire protocol] in wire.py), then looks at every tensor's posted header receive (a
       request from another node, served to its end before the next look) and at every request
       in flight (complete; or failed: its peer dead, or the timeout passed). Every call is
       non-blocking, so while it serves one request the others progress too, and no two ranks
       can end up waiting on each other.
    3. A request that fails fails every request of its tensor still in flight with the same
       error, their receives cancelled before any waiter is told: a reply arriving later must
       not write into the caller's ``out``, and the tensor is unusable from then on.
    4. Idle, the thread sleeps on a condition for growing pauses (at most 1 ms), cut short by
       the next action; busy, it yields the core between rounds.
    5. Closing a tensor is collective: an MPI barrier on its communicator, polled while the
       thread goes on serving (other ranks may still be finishing requests to this one), then
       its header receive is cancelled and its communicator freed. The thread ends once no
       tensor is open and nothing is in flight, so none outlives the tensors; the next tensor
       starts a new one.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from ..comm import CollectiveTimeoutError, CommError
from ..kernels import shard as kshard
from .layout import Layout
from .node_shards import NodeShards
from .wire import ACK, DATA, HEADER, HEADER_WORDS, REPLY, Peer, header, wait_requests

__all__ = ["Endpoint", "Request", "WireThread", "wire_thread"]

_MAX_PAUSE = 1e-3  # seconds: the longest idle sleep (NOTE [one thread on the wire] 4)
_DEATH_CHECK = 0.01  # seconds between looks at whether a peer of a request in flight died


class Endpoint:
    """One ShardedTensor on the wire: its own duplicate ``comm`` of the group's communicator,
    this process's group ``rank``, the node's ``shards`` of that tensor, its ``layout``,
    ``dtype``, one :class:`~terrapipe.ps.wire.Peer` per group rank, the ``timeout`` (seconds)
    and a ``name`` for errors. ``error``: the first failure serving another rank (a client
    that died mid-request), reported by the tensor; ``served``: requests served."""

    def __init__(self, comm, rank: int, shards: NodeShards, layout: Layout, dtype: np.dtype,
                 peers: list[Peer], timeout: float, name: str) -> None:
        self.comm, self.rank, self.shards, self.layout = comm, rank, shards, layout
        self.dtype, self.peers, self.timeout, self.name = np.dtype(dtype), peers, timeout, name
        self.error: str | None = None
        self.served = 0
        self._chunk_in = np.empty(layout.chunk, self.dtype)
        self._chunk_out = [np.empty(layout.chunk, self.dtype) for _ in range(2)]
        self._hdr = np.empty(HEADER_WORDS, np.int64)
        self._hdr_req = None  # the posted receive of the next request's header


class Request:
    """A request of this rank for rank ``r``'s shard of endpoint ``ep``'s tensor: apply
    ``rule`` (kernels.shard code) with ``scale`` and ``src`` (the whole tensor's flat source,
    or None), and read the result into ``dst`` (the whole tensor's flat destination, or None:
    acknowledged instead). ``seq``: the client's sequence number; ``what`` names it in errors.
    ``src`` and ``dst`` are the caller's and must stay untouched until :meth:`wait` returns."""

    def __init__(self, ep: Endpoint, r: int, rule: int, scale, src: np.ndarray | None,
                 dst: np.ndarray | None, seq: int, what: str) -> None:
        self.ep, self.r, self.rule, self.scale = ep, r, rule, scale
        self.src, self.dst, self.seq, self.what = src, dst, seq, what
        self.error: Exception | None = None
        self._done = threading.Event()
        self._reqs: list = []
        self._ack: np.ndarray | None = None
        self._deadline = 0.0
        self._checked = 0.0

    def wait(self) -> None:
        """Until the shard's owner answered; raises the error that ended the request instead.
        Bounded: the wire thread ends every request within its tensor's timeout."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def _issue(self, MPI) -> None:
        """NOTE [shard wire protocol] 2: the replies' receives first, then the request."""
        ep, r = self.ep, self.r
        self._deadline = time.monotonic() + ep.timeout
        comm, base, n = ep.comm, ep.layout.shard(r)[0], ep.layout.shard_len(r)
        if self.dst is not None:
            for _, lo, hi in ep.layout.chunks(r):
                self._reqs.append(comm.Irecv(self.dst[base + lo:base + hi], source=r, tag=REPLY))
        else:
            self._ack = np.zeros(1, np.int64)
            self._reqs.append(comm.Irecv(self._ack, source=r, tag=ACK))
        self._reqs.append(comm.Isend(header(self.rule, self.dst is not None, 0, n, float(self.scale),
                                            self.seq), dest=r, tag=HEADER))
        if self.rule in (kshard.ADD, kshard.COPY):
            for _, lo, hi in ep.layout.chunks(r):
                self._reqs.append(comm.Isend(self.src[base + lo:base + hi], dest=r, tag=DATA))

    def _poll(self, MPI, now: float) -> Exception | None | bool:
        """True once complete, an exception once failed, else None."""
        if MPI.Request.Testall(self._reqs):
            if self._ack is not None and int(self._ack[0]) != self.seq:
                return CommError(f"{self.what}: rank {self.r} acknowledged request {int(self._ack[0])}, "
                                 f"expected {self.seq}")
            return True
        timed_out = now > self._deadline
        if not timed_out and now - self._checked < _DEATH_CHECK:
            return None
        self._checked = now
        return self.ep.peers[self.r].lost(self.what, timed_out, self.ep.timeout)

    def _cancel(self, MPI) -> None:
        for req in self._reqs:
            if not req.Test():
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass


class WireThread:
    """NOTE [one thread on the wire]. One per process (:func:`wire_thread`); its thread starts
    with the first action handed to it and ends when nothing is left to do."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._cond = threading.Condition()
        self._inbox: list = []  # actions (callables) to run on the thread, in order
        self._thread: threading.Thread | None = None
        self._endpoints: list[Endpoint] = []
        self._active: list[Request] = []
        self._closing: list[tuple[Endpoint, object, float, threading.Event, list]] = []

    # -- what other threads call ------------------------------------------------------------------
    def register(self, ep: Endpoint) -> None:
        """Start serving ``ep`` (its tensor's set-up barrier has passed on every rank)."""
        def action() -> None:
            ep._hdr_req = ep.comm.Irecv(ep._hdr, source=self._MPI.ANY_SOURCE, tag=HEADER)
            self._endpoints.append(ep)

        self._post(action)

    def submit(self, req: Request) -> Request:
        """Issue ``req`` on the thread; the caller waits with ``req.wait()``."""
        def action() -> None:
            try:
                req._issue(self._MPI)
            except Exception as e:  # noqa: BLE001 - handed to the waiter
                req.error = e
                req._cancel(self._MPI)
                req._done.set()
                return
            self._active.append(req)

        self._post(action)
        return req

    def abandon(self, ep: Endpoint, error: Exception) -> None:
        """Fail every request of ``ep`` in flight with ``error``, their receives cancelled
        (NOTE [one thread on the wire] 3); returns once done."""
        done = threading.Event()

        def action() -> None:
            self._fail(ep, error)
            done.set()

        self._post(action)
        done.wait()

    def drop(self, ep: Endpoint, error: Exception) -> None:
        """Stop serving ``ep`` without the collective barrier (its tensor failed: some rank may
        be gone): its requests in flight fail with ``error``, its header receive is cancelled
        and its communicator freed; returns once done."""
        done = threading.Event()

        def action() -> None:
            self._fail(ep, error)
            if ep in self._endpoints:
                self._endpoints.remove(ep)
                self._retire(ep, free=True)
            done.set()

        self._post(action)
        done.wait()

    def close(self, ep: Endpoint) -> None:
        """Collective (NOTE [one thread on the wire] 5): returns once every rank closed ``ep``
        and it is no longer served; CollectiveTimeoutError when some rank did not come within
        the tensor's timeout."""
        done, failure = threading.Event(), []

        def action() -> None:
            deadline = time.monotonic() + ep.timeout
            barrier = ep.comm.Ibarrier()
            self._closing.append((ep, barrier, deadline, done, failure))

        self._post(action)
        done.wait()
        if failure:
            raise failure[0]

    # -- the thread ------------------------------------------------------------------------------
    def _post(self, action) -> None:
        with self._cond:
            self._inbox.append(action)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="terrapipe-ps-wire", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        try:
            self._rounds()
        except BaseException as e:  # a bug here must not leave a waiter waiting forever
            error = CommError(f"the parameter server's wire thread failed: {e!r}")
            with self._cond:
                for req in self._active:
                    req.error = error
                    req._done.set()
                for _, _, _, done, failure in self._closing:
                    failure.append(error)
                    done.set()
                for ep in self._endpoints:
                    ep.error = ep.error or str(error)
                self._active, self._closing, self._endpoints = [], [], []
                self._thread = None
            raise

    def _rounds(self) -> None:
        pause = 0.0
        while True:
            with self._cond:
                actions, self._inbox = self._inbox, []
                if not (actions or self._endpoints or self._active or self._closing):
                    self._thread = None  # under the lock: the next _post starts another
                    return
            for action in actions:
                action()
            busy = bool(actions)
            for ep in list(self._endpoints):
                busy |= self._serve_arrived(ep)
            now = time.monotonic()
            for req in list(self._active):
                outcome = req._poll(self._MPI, now)
                if outcome is True:
                    self._active.remove(req)
                    req._done.set()
                    busy = True
                elif outcome is not None:
                    self._fail(req.ep, outcome)
                    busy = True
            for entry in list(self._closing):
                busy |= self._close_step(entry, now)
            if busy:
                pause = 0.0
            elif self._active or self._closing:
                os.sched_yield()
            else:
                with self._cond:
                    if not self._inbox:
                        self._cond.wait(pause)
                pause = min(pause * 2 + 2e-5, _MAX_PAUSE)

    def _fail(self, ep: Endpoint, error: Exception) -> None:
        failed = [req for req in self._active if req.ep is ep]
        for req in failed:
            req._cancel(self._MPI)
            self._active.remove(req)
        for req in failed:
            req.error = error
            req._done.set()

    def _close_step(self, entry, now: float) -> bool:
        ep, barrier, deadline, done, failure = entry
        if not barrier.Test():
            if now < deadline:
                return False
            failure.append(CollectiveTimeoutError(
                f"{ep.name}: close: timed out after {ep.timeout:g}s waiting for every rank to close it",
                []))
        self._closing.remove(entry)
        self._endpoints.remove(ep)
        self._retire(ep, free=not failure)
        done.set()
        return True

    @staticmethod
    def _retire(ep: Endpoint, free: bool) -> None:
        """Cancel ``ep``'s header receive; ``free``: also free its communicator."""
        req = ep._hdr_req
        if req is not None and not req.Test():
            req.Cancel()
            req.Wait()  # a cancelled receive completes at once
        if free:
            ep.comm.Free()

    def _serve_arrived(self, ep: Endpoint) -> bool:
        status = self._MPI.Status()
        if not ep._hdr_req.Test(status):
            return False
        hdr = ep._hdr.copy()
        ep._hdr_req = ep.comm.Irecv(ep._hdr, source=self._MPI.ANY_SOURCE, tag=HEADER)
        client = status.Get_source()
        try:
            self._serve(ep, client, hdr)
            ep.served += 1
        except Exception as e:  # noqa: BLE001 - reported by the tensor; the thread serves on
            if ep.error is None:
                ep.error = f"server of rank {ep.rank}'s shard: {e}"
            print(f"terrapipe.ps {ep.name}: {ep.error}", file=sys.stderr, flush=True)
        return True

    def _serve(self, ep: Endpoint, client: int, hdr: np.ndarray) -> None:
        """Answer one request (NOTE [shard wire protocol] 2), chunk by chunk."""
        MPI = self._MPI
        rule, want, lo, n, seq = int(hdr[0]), bool(hdr[1]), int(hdr[2]), int(hdr[3]), int(hdr[5])
        scale = ep.dtype.type(hdr[4:5].view(np.float64)[0])
        peer = ep.peers[client]
        what = f"{ep.name}: request {seq} from rank {client}"
        sends: list = []
        chunk = ep.layout.chunk
        first = lo // chunk
        for i, start in enumerate(range(lo, lo + n, chunk)):
            stop = min(start + chunk, lo + n)
            m = stop - start
            src = None
            if rule in (kshard.ADD, kshard.COPY):
                src = ep._chunk_in[:m]
                req = ep.comm.Irecv(src, source=client, tag=DATA)
                wait_requests(MPI, [req], ep.timeout, what, peer)
            out = None
            if want:
                out = ep._chunk_out[i % 2][:m]
                if len(sends) == 2:  # the buffer's previous reply must have left
                    wait_requests(MPI, [sends.pop(0)], ep.timeout, what, peer)
            ep.shards.apply(ep.rank, start, stop, first + i, rule, scale, src, out, what)
            if want:
                sends.append(ep.comm.Isend(out, dest=client, tag=REPLY))
        if not want:
            sends.append(ep.comm.Isend(np.array([seq], np.int64), dest=client, tag=ACK))
        wait_requests(MPI, sends, ep.timeout, what, peer)


_the_wire: WireThread | None = None
_made = threading.Lock()


def wire_thread() -> WireThread:
    """This process's :class:`WireThread` (made on first use)."""
    global _the_wire
    with _made:
        if _the_wire is None:
            _the_wire = WireThread()
        return _the_wire
