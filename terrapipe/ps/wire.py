"""Messages between a client and the server of a shard on another node, and how both wait.

NOTE [shard wire protocol]
    1. Every sharded tensor has its own duplicate of the group's communicator, so its tags meet
       nothing else. A request is a header (``HEADER``, int64[HEADER_WORDS]: rule, whether the
       client wants the result back, first element, element count, scale as float64 bits, the
       client's sequence number) followed, for ADD and COPY, by one DATA message per chunk.
    2. The server answers a request with one REPLY message per chunk when the client wants the
       result (a pull or push-pull), else with one ACK holding the sequence number. The client
       posts its receives before it sends the header, and every rank's client issues one request
       at a time per shard, so MPI's non-overtaking order pairs every message without matching
       sequence numbers (they are checked anyway).
    3. Both sides are one thread per process, the wire thread (NOTE [one thread on the wire] in
       wire_thread.py), which never blocks in MPI: requests are polled (``wait_requests``
       within a request it serves), which keeps MPI's progress engine turning for the peer
       (NOTE [MPI progress] in comm/algorithms/ring.py), and a request fails with
       CollectiveTimeoutError naming the peer when it died (same host: its pid is gone) or
       after the timeout.
    4. ``close`` is collective: every rank finishes its own requests, then an MPI barrier on the
       tensor's communicator, polled by the wire thread while it serves on; no request is in
       flight after it, and the posted header receive is cancelled.
"""

from __future__ import annotations

import os

import numpy as np

from ..comm import CollectiveTimeoutError, alive, wait_until

__all__ = ["HEADER", "DATA", "REPLY", "ACK", "HEADER_WORDS", "header", "wait_requests",
           "Peer"]

HEADER, DATA, REPLY, ACK = 11, 12, 13, 14
HEADER_WORDS = 6


def header(rule: int, want: bool, lo: int, n: int, scale: float, seq: int) -> np.ndarray:
    h = np.empty(HEADER_WORDS, np.int64)
    h[:] = (rule, int(want), lo, n, 0, seq)
    h[4:5].view(np.float64)[0] = float(scale)
    return h


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


def wait_requests(MPI, reqs: list, timeout: float, what: str, peer: Peer) -> None:
    """Poll ``reqs`` (mpi4py requests) until all complete (NOTE [shard wire protocol] 3), as
    every wait on a peer does (terrapipe.comm.wait_until): yield, then sleep between polls."""
    if not reqs or MPI.Request.Testall(reqs):
        return

    wait_until(lambda: MPI.Request.Testall(reqs), timeout,
               lambda timed_out: peer.lost(what, timed_out, timeout), check_every=64)
