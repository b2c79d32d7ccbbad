"""TCP connections between ranks, for layers that move their own bytes between nodes beside the
collectives (the parameter server's wire): this host's addresses, and a verified set of
connections among a group's ranks made in one collective call.

NOTE [connecting ranks]
    1. Every rank listens on a port of its own (any address) and the group exchanges, once,
       each rank's host name, port, addresses (interface, port) and a random 64-bit nonce. A rank
       connects to each peer it was asked to reach, trying the peer's addresses in order:
       loopback first when both run on the same host, then the peer's interfaces
       (``TERRAPIPE_SOCKET_IFNAME`` restricts a rank to one interface, as ``GLOO_SOCKET_IFNAME``
       and ``NCCL_SOCKET_IFNAME`` do).
    2. An address can reach the wrong process: hosts share addresses that are not routed
       between them (a container bridge's ``172.17.0.1``), and a port free on the peer's host
       may be another program's here. So the connecting rank sends a hello (a magic word, its
       rank, the peer's nonce) and the listening rank answers one byte only when the nonce is
       its own and the rank is one it expects; anything else is closed, and the connecting
       rank goes on with the peer's next address. An attempt that gets no answer within
       ``ATTEMPT_S`` moves on too, but keeps waiting for that answer beside the next tries:
       the peer may only be slow. The first answer wins: the connecting rank sends one more
       byte on that connection ("chosen") and closes its others, and the listening rank counts
       a connection only once it reads that byte, so both sides keep the same one.
    3. Every rank connects and accepts at the same time in one non-blocking loop, so no rank
       waits for a peer that is itself waiting to be accepted; the call returns once each of
       this rank's connections is verified from its side, and fails naming the ranks not
       reached (and the addresses tried) after the timeout.
    4. The returned sockets are non-blocking, with ``TCP_NODELAY``:
       their owner multiplexes them with ``selectors``. Closing them is the owner's.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import secrets
import selectors
import socket
import struct
import time

from .. import settings
from .errors import CommError

__all__ = ["interface_addresses", "connect_ranks", "ATTEMPT_S"]

ATTEMPT_S = 3.0  # seconds one address is given to answer (NOTE [connecting ranks] 2)
_HELLO = struct.Struct("<4sqQ")  # magic, the connecting rank, the listening rank's nonce
_MAGIC = b"TPw1"
_OK = b"\x01"
_CHOSEN = b"\x02"
_SIOCGIFADDR = 0x8915
_RETRY_S = 0.2  # seconds between rounds over a peer's addresses


def interface_addresses(ifname: str | None = None) -> list[str]:
    """This host's IPv4 addresses, one per interface that has one, loopback left out;
    ``ifname`` (default: ``TERRAPIPE_SOCKET_IFNAME``, when set): only that interface's
    (loopback too, when named), and a CommError naming it when it has none."""
    ifname = ifname or settings.get("TERRAPIPE_SOCKET_IFNAME") or None
    names = [ifname] if ifname else [name for _, name in socket.if_nameindex()]
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue  # down, or no IPv4 address
            if ifname or not ipaddress.ip_address(addr).is_loopback:
                found.append(addr)
    if ifname and not found:
        raise CommError(f"interface {ifname!r} (TERRAPIPE_SOCKET_IFNAME) has no IPv4 address here")
    return found


class _Attempt:
    """Reaching one peer: its addresses in order, the socket of the current try, and the
    earlier tries that sent their hello and still wait for an answer (``asked``)."""

    def __init__(self, rank: int, addresses: list[tuple[str, int]], nonce: int) -> None:
        self.rank, self.addresses, self.nonce = rank, addresses, nonce
        self.index = -1
        self.sock: socket.socket | None = None
        self.asked: list[socket.socket] = []
        self.deadline = 0.0
        self.sent = False
        self.tried: list[str] = []

    def expire(self, sel: selectors.BaseSelector) -> None:
        """The current try had its ``ATTEMPT_S``: keep waiting for its answer if it asked, and
        start the next one."""
        if self.sock is not None and self.sent:
            self.asked.append(self.sock)
            self.sock = None
        self.next(sel)

    def forget(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        """An earlier try answered wrong or closed: drop it."""
        self.asked.remove(sock)
        sel.unregister(sock)
        sock.close()

    def next(self, sel: selectors.BaseSelector) -> None:
        """Start the try at the next address; after the last one, wait ``_RETRY_S`` and start
        over (a peer's host may not route to it yet)."""
        self.drop(sel)
        self.index += 1
        if self.index >= len(self.addresses):
            self.index = -1
            self.deadline = time.monotonic() + _RETRY_S
            return
        addr = self.addresses[self.index]
        self.tried.append(f"{addr[0]}:{addr[1]}")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.deadline = time.monotonic() + ATTEMPT_S
        self.sent = False
        code = self.sock.connect_ex(addr)
        if code not in (0, errno.EINPROGRESS):
            self.next(sel)
            return
        sel.register(self.sock, selectors.EVENT_WRITE, ("out", self))

    def drop(self, sel: selectors.BaseSelector) -> None:
        """Close the current try."""
        if self.sock is not None:
            sel.unregister(self.sock)
            self.sock.close()
            self.sock = None

    def drop_all(self, sel: selectors.BaseSelector) -> None:
        self.drop(sel)
        for sock in list(self.asked):
            self.forget(sel, sock)

    def keep(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        """``sock`` (the current try or an earlier one) won: take it out, close the others."""
        if sock is self.sock:
            self.sock = None
        else:
            self.asked.remove(sock)
        sel.unregister(sock)
        self.drop_all(sel)


def connect_ranks(comm, rank: int, reach: list[int], expect: list[int], timeout: float,
                  what: str) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """NOTE [connecting ranks]. Collective over ``comm`` (an mpi4py communicator; ``rank`` is
    this process's rank in it): connect to every rank in ``reach`` and accept a connection from
    every rank in ``expect`` (whoever reaches this rank must be expected by it). Returns
    ``(reached, accepted)``: one non-blocking TCP socket per rank, the caller's to close.
    Raises CommError naming ``what`` and the ranks not reached within ``timeout`` seconds."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(max(16, len(expect) + 4))
    listener.setblocking(False)
    nonce = secrets.randbits(63)
    host = os.uname().nodename
    port = listener.getsockname()[1]
    try:
        mine = [(addr, port) for addr in interface_addresses()]
        everyone = comm.allgather((host, port, mine, nonce))
        reached, accepted = _connect(listener, rank, nonce, host, everyone, reach, expect, timeout, what)
    finally:
        listener.close()
    for sock in (*reached.values(), *accepted.values()):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reached, accepted


def _connect(listener, rank, nonce, host, everyone, reach, expect, timeout, what):
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    attempts = {}
    for r in reach:
        peer_host, peer_port, addrs, peer_nonce = everyone[r]
        order = [("127.0.0.1", peer_port)] if peer_host == host else []
        order += [tuple(a) for a in addrs]
        if not order:
            raise CommError(f"{what}: rank {r} on {peer_host} has no IPv4 address but loopback, "
                            "and runs on another host")
        attempts[r] = _Attempt(r, order, peer_nonce)
        attempts[r].next(sel)
    reached: dict[int, socket.socket] = {}
    accepted: dict[int, socket.socket] = {}
    hellos: dict[socket.socket, bytearray] = {}
    answered: dict[socket.socket, int] = {}  # verified hellos, waiting for "chosen"
    waiting = set(expect)
    deadline = time.monotonic() + timeout
    try:
        while attempts or waiting:
            now = time.monotonic()
            if now > deadline:
                missing = [f"rank {r} (tried {', '.join(dict.fromkeys(a.tried))})"
                           for r, a in attempts.items()]
                missing += [f"rank {r} never connected" for r in sorted(waiting)]
                raise CommError(f"{what}: no TCP connection within {timeout:g}s: " + "; ".join(missing))
            for key, _ in sel.select(0.05):
                kind, att = key.data
                if kind == "out" and (attempts.get(att.rank) is not att
                                      or (key.fileobj is not att.sock and key.fileobj not in att.asked)):
                    continue  # closed earlier in this round (its attempt succeeded or moved on)
                if kind == "listen":
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    hellos[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ, ("hello", None))
                elif kind == "hello":
                    conn = key.fileobj
                    peer = _read_hello(conn, hellos, sel, nonce, waiting)
                    if peer is not None:
                        answered[conn] = peer
                        sel.register(conn, selectors.EVENT_READ, ("chosen", None))
                elif kind == "chosen":
                    conn = key.fileobj
                    mark = _recv_byte(conn)
                    if mark is None:
                        continue
                    sel.unregister(conn)
                    peer = answered.pop(conn)
                    if mark == _CHOSEN and peer in waiting:
                        waiting.discard(peer)
                        accepted[peer] = conn
                    else:  # a try the connecting rank did not choose
                        conn.close()
                elif kind == "out" and key.fileobj is att.sock and not att.sent:
                    if att.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        att.next(sel)
                        continue
                    if not _send(att.sock, _HELLO.pack(_MAGIC, rank, att.nonce)):
                        att.next(sel)
                        continue
                    att.sent = True
                    sel.modify(att.sock, selectors.EVENT_READ, ("out", att))
                elif kind == "out":
                    sock = key.fileobj
                    answer = _recv_byte(sock)
                    if answer is None:
                        continue
                    # The first answer wins: tell the listening rank this is the one kept.
                    if answer == _OK and _send(sock, _CHOSEN):
                        att.keep(sel, sock)
                        reached[att.rank] = sock
                        del attempts[att.rank]
                    elif sock is att.sock:  # the wrong process, or gone: the next address
                        att.next(sel)
                    else:
                        att.forget(sel, sock)
            now = time.monotonic()
            for att in list(attempts.values()):
                if now > att.deadline:
                    att.expire(sel)
    except BaseException:
        for sock in (*reached.values(), *accepted.values()):
            sock.close()
        for att in attempts.values():
            att.drop_all(sel)
        raise
    finally:
        for conn in (*hellos, *answered):  # connections never verified or never chosen
            conn.close()
        sel.close()
    return reached, accepted


def _send(sock: socket.socket, data: bytes) -> bool:
    """Send a few bytes of the handshake, waiting at most ``ATTEMPT_S``; False if the
    connection failed. The socket is non-blocking again afterwards."""
    try:
        sock.setblocking(True)
        sock.settimeout(ATTEMPT_S)
        sock.sendall(data)
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(False)


def _recv_byte(sock: socket.socket) -> bytes | None:
    """One byte of an answer; None while nothing has arrived, b"" when the connection ended."""
    try:
        return sock.recv(1)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _read_hello(conn, hellos, sel, nonce, waiting) -> int | None:
    """The rank of a verified hello on ``conn`` (answered and unregistered), else None (more to
    read, or closed: not for this rank)."""
    buf = hellos[conn]
    try:
        data = conn.recv(_HELLO.size - len(buf))
    except BlockingIOError:
        return None
    except OSError:
        data = b""
    buf += data
    if data and len(buf) < _HELLO.size:
        return None
    sel.unregister(conn)
    del hellos[conn]
    if data:
        magic, peer, their_nonce = _HELLO.unpack(bytes(buf))
        if magic == _MAGIC and their_nonce == nonce and peer in waiting and _send(conn, _OK):
            return peer
    conn.close()
    return None
