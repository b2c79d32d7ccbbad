"""The board of a node's shared segment: per local rank a step counter, the signature of the
collective it is in, its pid and what it lost across nodes. Every wait of a rank for its node's
peers is a wait on this board (comm/transports/shm.py makes the segment it lives in).

NOTE [board protocol]
    The board holds, per local rank, a monotonically increasing step counter, the signature of
    the collective it is in, and its pid. Signatures alternate between two slots by step parity:
    a fast rank may publish the next collective's signature while a slow one still compares the
    current one, but it cannot get two signature steps ahead (that needs the slow rank's step).
    A rank publishes data (copies into its row), then stores
    its counter with release ordering and peers poll it with acquire loads (kernels/sync.py), so a
    peer that sees the counter also sees the data and the signature.
    ``wait`` returns once every counter reaches the step, or raises CollectiveTimeoutError naming
    the ranks that did not (immediately if their pid is gone).

NOTE [a peer lost across nodes]
    A rank that moves data between nodes (a node's leader in the hierarchical allreduce, or
    every local rank in the per-local-rank exchange) can time out on a peer of another node,
    unreachable or stopped, while its node's ranks wait on the board for it.
    1. While its wait on peers of other nodes takes long, its board column ``lost`` holds -1
       (MpiTransport.on_waiting, TcpTransport.afar around each of its waits ->
       Board.mark_waiting), 0 again once done.
    2. Before raising, it writes that peer's group rank + 1 there (MpiTransport.on_lost ->
       Board.mark_lost).
    3. A rank waiting on the board for it reads that column at each failure check: a peer lost
       (> 0) makes it raise at once, naming the far rank and its host, not the local rank it
       was waiting for; a local rank still waiting across nodes (-1) does not make it time out,
       for that rank's own timeout ends its wait, and a waiter timing out first would name the
       wrong rank (they start waiting together). Every surviving rank names the one it cannot
       reach, within the collective's timeout. A late rank that died is named at once as ever.
    4. The column is not cleared after a loss: the group takes no further collectives (NOTE
       [collective ordering] 5 in comm/execution.py).
    5. A rank of the node waiting in MPI itself (each local rank's own exchange across nodes)
       reads the column too (ShmTransport.late): it raises as soon as a node peer marks a far
       rank lost, not at its own timeout, which may come after the first rank's exit hook has
       ended the job (NOTE [collective ordering] 6 in comm/execution.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from ... import settings
from ...kernels import oneshot
from ...kernels import sync as ksync
from ...launch_env import alive
from ..errors import CollectiveTimeoutError
from ..wait import wait_until

__all__ = ["Board", "LOST", "SIG_WORDS", "TABLE_COLS", "ROUND_SPINS", "YIELDS", "wait_mode"]

LOST = "lost across nodes by a rank of this node"  # ShmTransport.late()'s why (clause 5)

_SLOT = 64  # int64 words per rank on the board: one cache line for the counter, then the rest
SIG_WORDS = 24
# A row of the tables the exchange across nodes carries (NOTE [agreement across nodes] 4 in
# comm/transports/shm.py): a rank's signature digest, then its group rank (-1: padding).
TABLE_COLS = 2
_SIG_COLS = (8, 32)  # the two signature slots (by step parity); column 0 is the counter
# Polls of the step counters before a waiting rank first yields its core (a few microseconds:
# the usual wait when every rank has a core), then per round between yields.
_FIRST_SPINS = 2000
ROUND_SPINS = 64
# Yields in compiled code before the wait goes on in Python (comm/wait.py), where it looks at
# the clock and its peers' liveness and drives MPI's progress between rounds.
YIELDS = 16
# A wait that has yielded this long sleeps on the late counter instead (NOTE [sleeping on a
# counter] in kernels/sync.py), at most _NAP_SECONDS at a time: between naps it looks at the
# clock and its peers' liveness and drives MPI's progress (NOTE [waiting for a peer] in
# comm/wait.py).
_SLEEP_AFTER_SECONDS = 50e-6
_NAP_SECONDS = 1e-3
def wait_mode() -> str:
    """How a rank waits for late peers on the board (``TERRAPIPE_WAIT``, read when a group is
    made): ``sleep`` (default; NOTE [sleeping on a counter] in kernels/sync.py) or ``spin``
    (poll and yield the core, never sleep: for ranks that each own an otherwise idle core)."""
    return settings.get("TERRAPIPE_WAIT")


class Board:
    """Per-node step counters, signatures and pids in a segment's first bytes."""

    def __init__(self, words: np.ndarray, nlocal: int, me: int, ranks: list[int],
                 describe: Callable[[int], str] = "rank {}".format) -> None:
        self.table = words[: nlocal * _SLOT].reshape(nlocal, _SLOT)
        self.steps = self.table[:, 0]
        self.sleepers = self.table[:, oneshot.SLEEPERS_COL]  # NOTE [sleeping on a counter] 2
        self.sleeps = ksync.CAN_SLEEP and wait_mode() == "sleep"
        self._nap = np.array([0, int(_NAP_SECONDS * 1e9)], np.int64)  # a struct timespec
        self._sig_slots = tuple(self.table[:, c : c + SIG_WORDS] for c in _SIG_COLS)
        self.pids = self.table[:, 60]
        # The group rank + 1 of a peer on another node this rank's transfer timed out on, -1
        # while it waits long on other nodes, else 0 (NOTE [a peer lost across nodes]).
        self.lost = self.table[:, 61]
        # 1 once the rank has reached its exit after a failed collective (NOTE [collective
        # ordering] 7 in comm/execution.py).
        self.exiting = self.table[:, 62]
        self.describe = describe
        # Each rank's source and destination addresses for a single-copy collective, written
        # before the agreement's release store (NOTE [single-copy allreduce] 2 in
        # comm/algorithms/single_copy.py).
        self.addrs = self.table[:, 1:3].view(np.uint64)
        self.me = me
        self.ranks = ranks  # world rank of each local rank, for messages
        self.step = 0
        self.pids[me] = os.getpid()
        # called between spin rounds (NOTE [MPI progress] 4 in comm/algorithms/ring.py)
        self.progress = lambda: None

    @staticmethod
    def nbytes(nlocal: int) -> int:
        return nlocal * _SLOT * 8

    def reserve(self) -> tuple[int, int]:
        """For a caller that publishes its signature itself (kernels/oneshot.py): the next step
        and the first column of its signature slot in ``table``. The caller must publish exactly
        that step (then :meth:`sigs` reads the slot back)."""
        self.step += 1
        return self.step, _SIG_COLS[self.step % 2]

    def publish(self, sig: np.ndarray | None = None) -> int:
        """Advance this rank's counter (after writing ``sig`` if given); returns the new step."""
        self.step += 1
        if sig is None:
            ksync.release_step(self.steps, self.sleepers, self.me, self.step)
        else:
            ksync.publish_step(self._sig_slots[self.step % 2], self.me, sig, self.steps, self.sleepers,
                               self.step)
        return self.step

    def wait(self, step: int, timeout: float, what: str) -> None:
        """Until every local rank's counter reaches ``step``: spin, then wait as every wait does
        (NOTE [waiting for a peer] in comm/wait.py), sleeping on the late counter (NOTE
        [sleeping on a counter] in kernels/sync.py); raises CollectiveTimeoutError naming the
        late ranks after ``timeout`` seconds, or at once when one of them died."""
        steps = self.steps
        if ksync.spin_until(steps, step, _FIRST_SPINS) or \
                ksync.yield_until(steps, step, ROUND_SPINS, YIELDS):
            return
        sleepers, nap = self.sleepers, self._nap
        wait_until(lambda: ksync.spin_until(steps, step, ROUND_SPINS), timeout,
                   lambda timed_out: self._failure(step, timed_out, timeout, what),
                   nap=(lambda: ksync.sleep_until(steps, sleepers, step, nap)) if self.sleeps else None,
                   progress=self.progress, sleep_after=_SLEEP_AFTER_SECONDS if self.sleeps else None)

    def _failure(self, step: int, timed_out: bool, timeout: float, what: str) -> Exception | None:
        """The error of a wait for ``step``: a late rank died, or ``timed_out``; else None."""
        late = [int(q) for q in np.nonzero(self.steps < step)[0]]
        dead = [q for q in late if not alive(int(self.pids[q]))]
        if dead:
            names = ", ".join(f"rank {self.ranks[q]} (pid {int(self.pids[q])})" for q in dead)
            return CollectiveTimeoutError(f"{what}: {names} died", [self.ranks[q] for q in dead])
        lost = [q for q in late if self.lost[q] > 0]
        if lost:  # NOTE [a peer lost across nodes] 3
            q = lost[0]
            far = int(self.lost[q]) - 1
            return CollectiveTimeoutError(
                f"{what}: rank {self.ranks[q]} of this node timed out waiting for {self.describe(far)}"
                f" across nodes (unreachable, or stopped)", [far])
        if timed_out and late and not all(self.lost[q] < 0 for q in late):
            names = ", ".join(f"rank {self.ranks[q]}" for q in late)
            return CollectiveTimeoutError(f"{what}: Timed out after {timeout:g}s waiting for {names}",
                                          [self.ranks[q] for q in late])
        return None

    def mark_waiting(self, waiting: bool) -> None:
        """Tell this node's ranks that this one waits long on other nodes, or no longer (NOTE [a
        peer lost across nodes] 1); a peer marked lost stays marked."""
        if waiting:
            self.lost[self.me] = -1
        elif self.lost[self.me] < 0:
            self.lost[self.me] = 0

    def mark_lost(self, rank: int) -> None:
        """Tell this node's ranks that this one lost group rank ``rank`` on another node (NOTE
        [a peer lost across nodes])."""
        self.lost[self.me] = rank + 1

    def mark_exiting(self) -> None:
        """Tell this node's ranks that this one has reached its exit after a failure."""
        self.exiting[self.me] = 1

    def wait_exiting(self, seconds: float) -> list[int]:
        """Until every other local rank has reached its exit (:meth:`mark_exiting`) or died, at
        most ``seconds``; returns the world ranks still running then."""
        deadline = time.monotonic() + seconds
        while True:
            running = [self.ranks[q] for q in range(len(self.ranks))
                       if q != self.me and not self.exiting[q] and alive(int(self.pids[q]))]
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(0.01)

    def sigs(self, step: int) -> np.ndarray:
        """(nlocal, SIG_WORDS): every rank's signature published at ``step``."""
        return self._sig_slots[step % 2]

    def barrier(self, timeout: float, what: str, sig: np.ndarray | None = None) -> int:
        s = self.publish(sig)
        self.wait(s, timeout, what)
        return s
