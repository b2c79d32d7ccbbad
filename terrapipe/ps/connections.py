"""The parameter server's connections between nodes, one side each: a rank's requests to a
shard's owner (:class:`ToServer`) and a client's requests for this rank's shard
(:class:`FromClient`), as state machines the wire thread drives without blocking (NOTE [shard
wire protocol] in wire.py, NOTE [one thread on the wire] in wire_thread.py); the
:class:`Endpoint` of a tensor holding them, and the :class:`Request` a client waits on."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import deque

import numpy as np

from ..kernels import shard as kshard
from .layout import Layout
from .node_shards import NodeShards
from .wire import CLOSE, OUT_BUFFERS, REPLY, REQUEST, Peer

__all__ = ["ConnectionLost", "ToServer", "FromClient", "Endpoint", "Request"]

_CLOSE_MSG = REQUEST.pack(CLOSE, 0, 0, 0.0, 0)
_RULES = {*kshard.RULES.values(), kshard.NONE}


class ConnectionLost(Exception):
    """A connection ended or failed (``args[0]``: how)."""


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


class Conn:
    """One TCP connection of an endpoint to group rank ``r``: bytes queued to send, and the
    events the loop waits for on it."""

    def __init__(self, ep: Endpoint, r: int, sock: socket.socket) -> None:
        self.ep, self.r, self.sock = ep, r, sock
        self.tx: deque = deque()  # (memoryview, callback or None) in order
        self.events = 0  # what the selector watches now
        self.gone: Exception | None = None  # why it ended, once it did

    def send_queued(self) -> bool:
        moved = False
        while self.tx:
            view, then = self.tx[0]
            try:
                n = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise ConnectionLost(str(e)) from None
            moved = True
            if n < len(view):
                self.tx[0] = (view[n:], then)
                break
            self.tx.popleft()
            if then is not None:
                then()
        return moved

    def recv_into(self, view: memoryview) -> int:
        """Bytes read into ``view`` (not empty); 0 when none is ready."""
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            raise ConnectionLost(str(e)) from None
        if n == 0:
            raise ConnectionLost("the connection was closed")
        return n

    def close(self) -> None:
        self.sock.close()


class ToServer(Conn):
    """This rank's requests to rank ``r``'s shard, and their answers."""

    def __init__(self, ep: Endpoint, r: int, sock: socket.socket) -> None:
        super().__init__(ep, r, sock)
        self.req: Request | None = None
        self.close_sent = False
        self._hdr = bytearray(REPLY.size)
        self._got = 0
        self._body: memoryview | None = None

    def start(self, req: Request) -> None:
        ep, r = self.ep, self.r
        base, n = ep.layout.shard(r)[0], ep.layout.shard_len(r)
        self.req, self._got, self._body = req, 0, None
        self.tx.append((memoryview(REQUEST.pack(req.rule, int(req.dst is not None), n, float(req.scale),
                                                req.seq)), None))
        if req.rule in (kshard.ADD, kshard.COPY) and n:
            self.tx.append((_bytes(req.src[base:base + n]), None))

    def send_close(self) -> None:
        self.tx.append((memoryview(_CLOSE_MSG), self._closed))

    def _closed(self) -> None:
        self.close_sent = True

    def wants(self) -> int:
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if self.tx else 0)

    def pump(self) -> bool:
        moved = self.send_queued()
        while True:
            req = self.req
            if req is None:  # nothing is owed: only the end of the connection can come
                self._peek_end()
                return moved
            if self._got < REPLY.size:
                n = self.recv_into(memoryview(self._hdr)[self._got:])
                if not n:
                    return moved
                moved, self._got = True, self._got + n
                if self._got < REPLY.size:
                    continue
                seq, count = REPLY.unpack(self._hdr)
                expected = self.ep.layout.shard_len(self.r) if req.dst is not None else 0
                if seq != req.seq or count != expected:
                    raise ConnectionLost(f"protocol error: answer {seq} with {count} elements, "
                                         f"expected {req.seq} with {expected}")
                if count:
                    base = self.ep.layout.shard(self.r)[0]
                    self._body = _bytes(req.dst[base:base + count])
                    continue
            elif self._body is not None and len(self._body):
                n = self.recv_into(self._body)
                if not n:
                    return moved
                moved, self._body = True, self._body[n:]
                if len(self._body):
                    continue
            self.req, self._got, self._body = None, 0, None
            req._done.set()
            return True

    def _peek_end(self) -> None:
        """Raise ConnectionLost when the idle connection has ended; bytes where none are owed are a
        protocol error."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise ConnectionLost(str(e)) from None
        if not data:
            raise ConnectionLost("the connection was closed")
        raise ConnectionLost("protocol error: bytes arrived with no request in flight")


class FromClient(Conn):
    """Rank ``r``'s requests for this rank's shard: read, applied chunk by chunk, answered."""

    def __init__(self, ep: Endpoint, r: int, sock: socket.socket) -> None:
        super().__init__(ep, r, sock)
        self.closed_by_peer = False
        self._hdr = bytearray(REQUEST.size)
        self._got = 0
        self._state = "header"  # or "data" (reading a chunk) or "produce" (no data to read)
        self._rule = self._want = self._n = self._k = self._seq = 0
        self._scale = None
        self._deadline = 0.0
        chunk = ep.layout.chunk
        self._chunk_in = np.empty(chunk, ep.dtype)
        self._chunk_view: memoryview | None = None
        self._free = [np.empty(chunk, ep.dtype) for _ in range(OUT_BUFFERS)]

    def busy(self) -> bool:
        return self._state != "header"

    def wants(self) -> int:
        read = self._state == "header" or (self._state == "data" and (not self._want or self._free))
        return (selectors.EVENT_READ if read else 0) | (selectors.EVENT_WRITE if self.tx else 0)

    def pump(self) -> bool:
        moved = self.send_queued()
        while True:
            if self._state == "header":
                n = self.recv_into(memoryview(self._hdr)[self._got:])
                if not n:
                    return moved
                moved, self._got = True, self._got + n
                if self._got == REQUEST.size:
                    self._got = 0
                    self._begin(*REQUEST.unpack(self._hdr))
            elif self._want and not self._free:
                return moved  # NOTE [shard wire protocol] 2: an answer chunk must leave first
            elif self._state == "data":
                if self._chunk_view is None:
                    lo = self._k * self.ep.layout.chunk
                    m = min(lo + self.ep.layout.chunk, self._n) - lo
                    self._chunk_view = _bytes(self._chunk_in[:m])
                n = self.recv_into(self._chunk_view)
                if not n:
                    return moved
                moved, self._chunk_view = True, self._chunk_view[n:]
                if not len(self._chunk_view):
                    self._chunk_view = None
                    self._apply(True)
            else:
                self._apply(False)
                moved = True

    def _begin(self, rule: int, want: int, n: int, scale: float, seq: int) -> None:
        if rule == CLOSE:
            self.closed_by_peer = True
            return
        if self.closed_by_peer:
            raise ConnectionLost(f"protocol error: request {seq} after CLOSE")
        if rule not in _RULES:
            raise ConnectionLost(f"protocol error: request {seq} with rule {rule}")
        if n != self.ep.layout.shard_len(self.ep.rank):
            raise ConnectionLost(f"protocol error: request {seq} for {n} elements, the shard has "
                                 f"{self.ep.layout.shard_len(self.ep.rank)}")
        self._rule, self._want, self._n, self._seq, self._k = rule, bool(want), n, seq, 0
        self._scale = self.ep.dtype.type(scale)
        self._deadline = time.monotonic() + self.ep.timeout
        if self._want:
            self.tx.append((memoryview(REPLY.pack(seq, n)), None))
        self._state = "data" if rule in (kshard.ADD, kshard.COPY) else "produce"
        if n == 0:
            self._finish()

    def _apply(self, with_data: bool) -> None:
        ep, chunk = self.ep, self.ep.layout.chunk
        lo = self._k * chunk
        hi = min(lo + chunk, self._n)
        out = None
        if self._want:
            whole = self._free.pop()
            out = whole[:hi - lo]
        ep.shards.apply(ep.rank, lo, hi, self._k, self._rule, self._scale,
                        self._chunk_in[:hi - lo] if with_data else None, out,
                        f"{ep.name}: request {self._seq} from rank {self.r}")
        if self._want:
            self.tx.append((_bytes(out), lambda: self._free.append(whole)))
        self._k += 1
        if self._k * chunk >= self._n:
            self._finish()

    def _finish(self) -> None:
        if not self._want:  # its arrival acknowledges the push (NOTE [shard wire protocol] 2)
            self.tx.append((memoryview(REPLY.pack(self._seq, 0)), None))
        self._state = "header"
        self.ep.served += 1

    def overdue(self, now: float) -> Exception | None:
        """The error when the request being served waits on its client past the timeout."""
        if self._state == "header":
            return None
        what = f"{self.ep.name}: request {self._seq} from rank {self.r}"
        return self.ep.peers[self.r].lost(what, now > self._deadline, self.ep.timeout)


class Endpoint:
    """One ShardedTensor on the wire: this process's group ``rank``, the node's ``shards`` of
    that tensor, its ``layout``, ``dtype``, one :class:`~terrapipe.ps.wire.Peer` per group
    rank, the ``timeout`` (seconds), a ``name`` for errors, and the connected sockets
    (terrapipe.comm.connect_ranks): ``servers[r]`` carries this rank's requests to rank
    ``r``, ``clients[r]`` rank ``r``'s requests to this one. ``error``: the first failure
    serving another rank (a client that died mid-request), reported by the tensor; ``served``:
    requests served."""

    def __init__(self, rank: int, shards: NodeShards, layout: Layout, dtype: np.dtype,
                 peers: list[Peer], timeout: float, name: str, servers: dict[int, socket.socket],
                 clients: dict[int, socket.socket]) -> None:
        self.rank, self.shards, self.layout = rank, shards, layout
        self.dtype, self.peers, self.timeout, self.name = np.dtype(dtype), peers, timeout, name
        self.error: str | None = None
        self.served = 0
        self.to_server = {r: ToServer(self, r, s) for r, s in servers.items()}
        self.from_client = {r: FromClient(self, r, s) for r, s in clients.items()}

    def conns(self) -> list[Conn]:
        return [*self.to_server.values(), *self.from_client.values()]


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
        self._deadline = 0.0

    def wait(self) -> None:
        """Until the shard's owner answered; raises the error that ended the request instead.
        Bounded: the wire thread ends every request within its tensor's timeout."""
        self._done.wait()
        if self.error is not None:
            raise self.error
