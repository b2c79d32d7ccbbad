"""Messages between a client and the server of a shard on another node, and how a lost peer is
named.

NOTE [shard wire protocol]
    1. Every sharded tensor has its own TCP connections (terrapipe.comm.connect_ranks, NOTE
       [connecting ranks] in comm/sockets.py): one from each rank to each rank of another node
       whose shard it uses, that rank's requests going one way and the answers the other. A
       request never shares a connection with the requests of the rank it is answered by, so
       a server that stops reading while its answers wait to leave (2) never waits on a client
       that does the same.
    2. A request is ``REQUEST`` (rule, whether the client wants the result back, element
       count, scale as float64, the client's sequence number), followed, for ADD and COPY, by
       the elements themselves; the server applies them chunk by chunk as they arrive. The
       answer is ``REPLY`` (sequence number, element count: the shard's length when the
       client wants the result, else 0) followed by that many elements; without the result it
       is sent once every chunk is applied, so its arrival acknowledges the push. A server
       holds at most ``OUT_BUFFERS`` answer chunks not yet sent per connection and reads no
       more of a request until one has left: memory per client is bounded whatever the shard's
       size.
    3. Every rank's client issues one request at a time per shard, so a connection carries at
       most one request at a time and answers need no matching beyond the sequence number,
       which is checked.
    4. Closing a tensor sends ``REQUEST`` with rule ``CLOSE`` on each of the rank's request
       connections once its own requests are answered, and waits for every client's
       ``CLOSE``: after it no request for this rank's shard can arrive. A connection that ends
       before its ``CLOSE`` names its rank: it died, or the link between the nodes failed.
"""

from __future__ import annotations

import os
import struct

from ..comm import CollectiveTimeoutError, alive

__all__ = ["REQUEST", "REPLY", "CLOSE", "OUT_BUFFERS", "Peer"]

REQUEST = struct.Struct("<qqqdq")  # rule, want, elements, scale, sequence number
REPLY = struct.Struct("<qq")  # sequence number, elements that follow
CLOSE = -1  # the rule of the request that closes a connection (NOTE [shard wire protocol] 4)
OUT_BUFFERS = 2  # answer chunks a server holds per connection (NOTE [shard wire protocol] 2)


class Peer:
    """How to name a rank in errors and tell whether it still lives: its group rank, host, pid."""

    def __init__(self, rank: int, host: str, pid: int) -> None:
        self.rank, self.host, self.pid = rank, host, pid

    def dead(self) -> bool:
        return self.host == os.uname().nodename and not alive(self.pid)

    def lost(self, what: str, timed_out: bool, timeout: float) -> Exception | None:
        """The error for a wait on this rank (``what``) when it died, or when ``timed_out``
        after ``timeout`` seconds; None while it may still answer."""
        if self.dead():
            return CollectiveTimeoutError(f"{what}: rank {self.rank} (pid {self.pid}) died", [self.rank])
        if timed_out:
            return CollectiveTimeoutError(
                f"{what}: timed out after {timeout:g}s waiting for rank {self.rank}", [self.rank])
        return None

    def disconnected(self, what: str, reason: str) -> Exception:
        """The error for this rank's connection ending (``reason``: how)."""
        died = self.lost(what, False, 0.0)
        if died is not None:
            return died
        return CollectiveTimeoutError(
            f"{what}: lost the connection to rank {self.rank} on {self.host} (pid {self.pid}): "
            f"{reason}; it died or the link between the nodes failed", [self.rank])
