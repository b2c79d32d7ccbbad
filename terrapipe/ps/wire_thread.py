"""The one thread per process that moves the parameter server's bytes between nodes: it serves
the requests that other nodes' ranks send for this rank's shards, and it issues this rank's
requests to theirs, for every open ShardedTensor, over TCP connections of its own (NOTE [shard
wire protocol] in wire.py).

NOTE [one thread on the wire]
    1. The parameter server's traffic between nodes never goes through MPI. Under MPICH's UCX
       netmod over TCP, MPI calls from a second thread of a process between nodes stall (a
       request issued on one thread and served on another never completes; a thread serving
       requests beside one running collectives stops now and then), and a rank busy training
       does not progress MPI's one-sided windows. With sockets of its own, the wire thread
       runs beside any collective the trainer runs, over any MPI.
    2. Every socket is non-blocking and one ``selectors`` loop drives them all: each round the
       thread runs the actions handed to it (a tensor registered, a request issued, a tensor
       closing), then moves whatever bytes each connection can move without waiting (sending
       what is queued, reading answers straight into the caller's ``out``, reading requests
       and applying them chunk by chunk, NOTE [shard wire protocol] 2), then checks the
       requests in flight (their peer dead, or the timeout passed). No call blocks, so while it
       serves one request the others progress too, and no two ranks can wait on each other.
    3. A request that fails fails every request of its tensor still in flight with the same
       error, and the tensor's request connections are closed before any waiter is told: no
       answer arriving later can write into the caller's ``out``, and the tensor is unusable
       from then on.
    4. With nothing to move, the thread sleeps in ``select`` until a socket is ready or an
       action arrives (a byte on its wake-up socket pair), at most ``_PAUSE`` seconds while a
       request or a close is pending (to look at the deadlines and at dead peers).
    5. The thread ends once no tensor is open and nothing is in flight, so none outlives the
       tensors; the next tensor starts a new one.
"""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time

from ..comm import CollectiveTimeoutError, CommError
from .connections import Conn, ConnectionLost, Endpoint, Request, ToServer

__all__ = ["WireThread", "wire_thread"]

_PAUSE = 0.01  # seconds: the longest sleep while a request or a close is pending (NOTE 4)
_IDLE = 0.5  # seconds: the longest sleep with only tensors open


class _Closing:
    """A tensor closing (NOTE [shard wire protocol] 4): done once its CLOSEs left and every
    client's arrived; ``failure`` holds the error otherwise."""

    def __init__(self, ep: Endpoint, deadline: float) -> None:
        self.ep, self.deadline = ep, deadline
        self.done = threading.Event()
        self.failure: list[Exception] = []


class WireThread:
    """NOTE [one thread on the wire]. One per process (:func:`wire_thread`); its thread starts
    with the first action handed to it and ends when nothing is left to do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: list = []  # actions (callables) to run on the thread, in order
        self._thread: threading.Thread | None = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._endpoints: list[Endpoint] = []
        self._active: list[Request] = []
        self._closing: list[_Closing] = []
        self._looked = 0.0

    # -- what other threads call ------------------------------------------------------------------
    def register(self, ep: Endpoint) -> None:
        """Start serving ``ep`` and issuing its requests."""
        self._post(lambda: self._endpoints.append(ep))

    def submit(self, req: Request) -> Request:
        """Issue ``req`` on the thread; the caller waits with ``req.wait()``."""
        def action() -> None:
            conn = req.ep.to_server[req.r]
            if conn.gone is not None or conn.req is not None:
                req.error = conn.gone or CommError(f"{req.what}: a request to rank {req.r} is in flight")
                req._done.set()
                return
            req._deadline = time.monotonic() + req.ep.timeout
            conn.start(req)
            self._active.append(req)

        self._post(action)
        return req

    def abandon(self, ep: Endpoint, error: Exception) -> None:
        """Fail every request of ``ep`` in flight with ``error``, its request connections
        closed (NOTE [one thread on the wire] 3); returns once done."""
        self._run(lambda: self._fail(ep, error))

    def drop(self, ep: Endpoint, error: Exception) -> None:
        """Stop serving ``ep`` without waiting for the other ranks (its tensor failed: some rank
        may be gone): its requests in flight fail with ``error`` and every connection of it is
        closed; returns once done."""
        def action() -> None:
            self._fail(ep, error)
            self._retire(ep)

        self._run(action)

    def close(self, ep: Endpoint) -> None:
        """Collective (NOTE [shard wire protocol] 4): returns once every client of this rank's
        shard closed ``ep`` and this rank's CLOSEs left; CollectiveTimeoutError naming the
        ranks that did not come within the tensor's timeout, or whose connection ended."""
        closing = _Closing(ep, time.monotonic() + ep.timeout)

        def action() -> None:
            for conn in ep.to_server.values():
                if conn.gone is None:
                    conn.send_close()
            self._closing.append(closing)

        self._post(action)
        closing.done.wait()
        if closing.failure:
            raise closing.failure[0]

    # -- the thread ------------------------------------------------------------------------------
    def _run(self, fn) -> None:
        done = threading.Event()

        def action() -> None:
            fn()
            done.set()

        self._post(action)
        done.wait()

    def _post(self, action) -> None:
        with self._lock:
            self._inbox.append(action)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="terrapipe-ps-wire", daemon=True)
                self._thread.start()
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # already full of wake-ups

    def _loop(self) -> None:
        try:
            self._rounds()
        except BaseException as e:  # a bug here must not leave a waiter waiting forever
            error = CommError(f"the parameter server's wire thread failed: {e!r}")
            with self._lock:
                for req in self._active:
                    req.error = error
                    req._done.set()
                for closing in self._closing:
                    closing.failure.append(error)
                    closing.done.set()
                for ep in list(self._endpoints):  # _retire removes each from the list
                    ep.error = ep.error or str(error)
                    self._retire(ep)
                self._active, self._closing, self._endpoints = [], [], []
                self._thread = None
            raise

    def _rounds(self) -> None:
        while True:
            with self._lock:
                actions, self._inbox = self._inbox, []
                if not (actions or self._endpoints or self._active or self._closing):
                    self._thread = None  # under the lock: the next _post starts another
                    return
            for action in actions:
                action()
            busy = bool(actions)
            for ep in list(self._endpoints):
                for conn in ep.conns():
                    if conn.gone is None:
                        busy |= self._pump(conn)
            now = time.monotonic()
            busy |= self._look(now)
            for closing in list(self._closing):
                busy |= self._close_step(closing, now)
            self._watch()
            if not busy:
                pending = self._active or self._closing or any(
                    c.busy() for ep in self._endpoints for c in ep.from_client.values())
                for key, _ in self._sel.select(_PAUSE if pending else _IDLE):
                    if key.data is None:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except BlockingIOError:
                            pass

    def _pump(self, conn: Conn) -> bool:
        ep = conn.ep
        try:
            return conn.pump()
        except ConnectionLost as lost:
            if isinstance(conn, ToServer):
                if conn.req is None and conn.close_sent:
                    self._end(conn, CommError(f"{ep.name}: closed"))  # the server's close: expected
                else:
                    what = conn.req.what if conn.req is not None else f"{ep.name} (shard of rank {conn.r})"
                    self._fail(ep, ep.peers[conn.r].disconnected(what, str(lost)))
            elif conn.closed_by_peer and not conn.busy():
                self._end(conn, CommError(f"{ep.name}: closed"))  # after its CLOSE: expected
            else:
                error = ep.peers[conn.r].disconnected(f"{ep.name}: client rank {conn.r}", str(lost))
                self._serving_failed(conn, error)
        except Exception as e:  # noqa: BLE001 - applying a request failed (a dead lock holder)
            if isinstance(conn, ToServer):
                self._fail(ep, CommError(f"{ep.name} (shard of rank {conn.r}): {e!r}"))
            else:
                self._serving_failed(conn, e)
        return True

    def _serving_failed(self, conn: Conn, error: Exception) -> None:
        ep = conn.ep
        if ep.error is None:
            ep.error = f"server of rank {ep.rank}'s shard: {error}"
        print(f"terrapipe.ps {ep.name}: {ep.error}", file=sys.stderr, flush=True)
        self._end(conn, error)

    def _end(self, conn: Conn, error: Exception) -> None:
        if conn.gone is None:
            conn.gone = error
            if conn.events:
                self._sel.unregister(conn.sock)
                conn.events = 0
            conn.close()

    def _look(self, now: float) -> bool:
        """Requests answered leave the list; one overdue, or whose peer died, fails its tensor.
        Dead peers are looked for every ``_PAUSE`` seconds."""
        busy = False
        for req in list(self._active):
            if req._done.is_set():
                self._active.remove(req)
                busy = True
            elif now > req._deadline:
                self._fail(req.ep, req.ep.peers[req.r].lost(req.what, True, req.ep.timeout))
                busy = True
        if now - self._looked < _PAUSE:
            return busy
        self._looked = now
        for req in list(self._active):
            error = req.ep.peers[req.r].lost(req.what, False, req.ep.timeout)
            if error is not None:
                self._fail(req.ep, error)
                busy = True
        for ep in self._endpoints:
            for conn in ep.from_client.values():
                if conn.gone is None and (error := conn.overdue(now)) is not None:
                    self._serving_failed(conn, error)
                    busy = True
        return busy

    def _watch(self) -> None:
        """Watch each connection for what it waits for now."""
        for ep in self._endpoints:
            for conn in ep.conns():
                if conn.gone is not None:
                    continue
                want = conn.wants()
                if want == conn.events:
                    continue
                if not conn.events:
                    self._sel.register(conn.sock, want, conn)
                elif not want:
                    self._sel.unregister(conn.sock)
                else:
                    self._sel.modify(conn.sock, want, conn)
                conn.events = want

    def _fail(self, ep: Endpoint, error: Exception) -> None:
        """NOTE [one thread on the wire] 3."""
        for conn in ep.to_server.values():
            self._end(conn, error)
        mine = [req for req in self._active if req.ep is ep]
        for req in mine:
            self._active.remove(req)
        failed = [req for req in mine if not req._done.is_set()]  # answered ones stay answered
        for req in failed:
            req.error = error
            req._done.set()

    def _close_step(self, closing: _Closing, now: float) -> bool:
        ep = closing.ep
        lost = [c for c in ep.to_server.values() if c.gone is not None and not c.close_sent]
        lost += [c for c in ep.from_client.values() if c.gone is not None and not c.closed_by_peer]
        waiting = [c.r for c in ep.from_client.values() if c.gone is None and not c.closed_by_peer]
        sending = [c for c in ep.to_server.values() if c.gone is None and not c.close_sent]
        if lost:
            closing.failure.append(lost[0].gone)
        elif waiting or sending:
            if now < closing.deadline:
                return False
            ranks = sorted(set(waiting) | {c.r for c in sending})
            closing.failure.append(CollectiveTimeoutError(
                f"{ep.name}: close: timed out after {ep.timeout:g}s waiting for rank(s) "
                f"{', '.join(map(str, ranks))} to close it", ranks))
        self._closing.remove(closing)
        self._retire(ep)
        closing.done.set()
        return True

    def _retire(self, ep: Endpoint) -> None:
        """Close every connection of ``ep`` and stop serving it."""
        for conn in ep.conns():
            self._end(conn, CommError(f"{ep.name}: closed"))
        if ep in self._endpoints:
            self._endpoints.remove(ep)


_the_wire: WireThread | None = None
_made = threading.Lock()


def wire_thread() -> WireThread:
    """This process's :class:`WireThread` (made on first use)."""
    global _the_wire
    with _made:
        if _the_wire is None:
            _the_wire = WireThread()
        return _the_wire
