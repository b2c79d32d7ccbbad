"""Shared-memory segments and the per-node board that ranks synchronise on.

NOTE [shm segment lifetime]
    The node's first rank creates ``/dev/shm/terrapipe_<uid>_<pid>_<n>``, every rank of the node
    maps it, and once all have (an MPI barrier) the creator unlinks the name. The mapping lives on
    until each process unmaps or exits, so a rank killed with ``kill -9`` leaves no file behind.
    Only a crash inside the create-to-unlink window can leave one; ``remove_stale`` deletes those
    whose creator pid is gone, at the next init.

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
"""

from __future__ import annotations

import glob
import mmap
import os
import time

import numpy as np

from ..kernels.sync import publish_step, release_step, spin_until
from .errors import CollectiveTimeoutError

__all__ = ["Segment", "Board", "remove_stale", "PREFIX"]

PREFIX = "terrapipe_"
_SHM_DIR = "/dev/shm"
_SLOT = 64  # int64 words per rank on the board: one cache line for the counter, then the rest
SIG_WORDS = 24
_SIG_COLS = (8, 32)  # the two signature slots (by step parity); column 0 is the counter
# Polls of the step counters before a waiting rank first yields its core (a few microseconds:
# the usual wait when every rank has a core), then per round between yields.
_FIRST_SPINS = 2000
_ROUND_SPINS = 64


def remove_stale() -> list[str]:
    """Unlink terrapipe segments whose creating process no longer exists; returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(_SHM_DIR, f"{PREFIX}{os.getuid()}_*")):
        try:
            pid = int(os.path.basename(path).split("_")[2])
        except (IndexError, ValueError):
            continue
        if not _alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """A shared mapping of ``nbytes`` among the ranks of one node (see NOTE [shm segment lifetime]).

    ``node_comm`` is an mpi4py communicator of the node's ranks.
    """

    _count = 0

    def __init__(self, node_comm, nbytes: int) -> None:
        nbytes = max(int(nbytes), mmap.PAGESIZE)
        name = None
        if node_comm.rank == 0:
            Segment._count += 1
            name = os.path.join(_SHM_DIR, f"{PREFIX}{os.getuid()}_{os.getpid()}_{Segment._count}")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        name = node_comm.bcast(name, root=0)
        fd = os.open(name, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        node_comm.Barrier()
        if node_comm.rank == 0:
            os.unlink(name)
        self.nbytes = nbytes
        self.buf = np.frombuffer(self._map, np.uint8)

    def close(self) -> None:
        self.buf = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


class Board:
    """Per-node step counters, signatures and pids in a segment's first bytes."""

    def __init__(self, words: np.ndarray, nlocal: int, me: int, ranks: list[int]) -> None:
        self.table = words[: nlocal * _SLOT].reshape(nlocal, _SLOT)
        self.steps = self.table[:, 0]
        self._sig_slots = tuple(self.table[:, c : c + SIG_WORDS] for c in _SIG_COLS)
        self.pids = self.table[:, 60]
        self.me = me
        self.ranks = ranks  # world rank of each local rank, for messages
        self.step = 0
        self.pids[me] = os.getpid()
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
            release_step(self.steps, self.me, self.step)
        else:
            publish_step(self._sig_slots[self.step % 2], self.me, sig, self.steps, self.step)
        return self.step

    def wait(self, step: int, timeout: float, what: str) -> None:
        steps = self.steps
        if spin_until(steps, step, _FIRST_SPINS):
            return
        start = time.monotonic()
        rounds = 0
        while not spin_until(steps, step, _ROUND_SPINS):
            # Past the first spin, yield the core between short rounds: ranks may outnumber cores.
            os.sched_yield()
            self.progress()
            rounds += 1
            if rounds % 256:
                continue
            late = [int(q) for q in np.nonzero(steps < step)[0]]
            if not late:
                return
            dead = [q for q in late if not _alive(int(self.pids[q]))]
            if dead:
                names = ", ".join(f"rank {self.ranks[q]} (pid {int(self.pids[q])})" for q in dead)
                raise CollectiveTimeoutError(f"{what}: {names} died", [self.ranks[q] for q in dead])
            if time.monotonic() - start > timeout:
                names = ", ".join(f"rank {self.ranks[q]}" for q in late)
                raise CollectiveTimeoutError(
                    f"{what}: timed out after {timeout:g}s waiting for {names}",
                    [self.ranks[q] for q in late])

    def sigs(self, step: int) -> np.ndarray:
        """(nlocal, SIG_WORDS): every rank's signature published at ``step``."""
        return self._sig_slots[step % 2]

    def barrier(self, timeout: float, what: str, sig: np.ndarray | None = None) -> int:
        s = self.publish(sig)
        self.wait(s, timeout, what)
        return s
