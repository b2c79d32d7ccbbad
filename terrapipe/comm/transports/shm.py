"""The shared-memory transport: a segment per node, the board its ranks synchronise on, each
rank's row of it, the shared arrays it maps (NOTE [shared arrays] in comm/algorithms/shared.py)
and the peers' addresses for single-copy reads (comm/transports/cma.py). The algorithms that
move data through it are comm/algorithms/oneshot.py, segment.py, shared.py and single_copy.py.

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

NOTE [row halves]
    Each local rank owns a row of the segment, split in two halves used by alternate chunks (a
    counter that runs on across calls). A rank writes half h for chunk k + 2 only after the
    barrier of chunk k + 1, which every rank publishes after finishing its reads of chunk k: so
    one barrier per chunk suffices for copies, two for reductions (data in, reduced parts ready).

NOTE [a peer lost across nodes]
    A rank that moves data between nodes (a node's leader in the hierarchical allreduce, or
    every local rank in the per-local-rank exchange) can time out on a peer of another node,
    unreachable or stopped, while its node's ranks wait on the board for it.
    1. While its wait on peers of other nodes takes long, its board column ``lost`` holds -1
       (MpiTransport.on_waiting -> Board.mark_waiting), 0 again once done.
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

NOTE [shared segment reservation]
    A shared array's segment (:meth:`ShmTransport.alloc_shared`) is reserved when it is made
    (``posix_fallocate``), so a full ``/dev/shm`` refuses at once, with OSError on every rank of
    the node, instead of killing a process with SIGBUS at its first touch of a missing page.
"""

from __future__ import annotations

import glob
import mmap
import os
from collections.abc import Callable

import numpy as np

from ... import settings
from ...kernels import oneshot
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from ...launch_env import alive
from ..errors import CollectiveTimeoutError
from ..wait import wait_until
from . import cma, hugepages
from .base import Transport

__all__ = ["Segment", "Board", "ShmTransport", "remove_stale", "alive", "PREFIX", "row_bytes", "wait_mode",
           "SIG_WORDS"]

PREFIX = "terrapipe_"
_SHM_DIR = "/dev/shm"
_SLOT = 64  # int64 words per rank on the board: one cache line for the counter, then the rest
SIG_WORDS = 24
_SIG_COLS = (8, 32)  # the two signature slots (by step parity); column 0 is the counter
# Polls of the step counters before a waiting rank first yields its core (a few microseconds:
# the usual wait when every rank has a core), then per round between yields.
_FIRST_SPINS = 2000
_ROUND_SPINS = 64
# A wait that has yielded this long sleeps on the late counter instead (NOTE [sleeping on a
# counter] in kernels/sync.py), at most _NAP_SECONDS at a time: between naps it looks at the
# clock and its peers' liveness and drives MPI's progress (NOTE [waiting for a peer] in
# comm/wait.py).
_SLEEP_AFTER_SECONDS = 50e-6
_NAP_SECONDS = 1e-3
# Each rank's row of the segment holds two halves (NOTE [row halves]), each one one-shot
# message: p x row = 8 MiB per node whatever p, and at least 1 MiB a row.
_SEGMENT_BYTES = 8 << 20
_MIN_ROW_BYTES = 1 << 20


def wait_mode() -> str:
    """How a rank waits for late peers on the board (``TERRAPIPE_WAIT``, read when a group is
    made): ``sleep`` (default; NOTE [sleeping on a counter] in kernels/sync.py) or ``spin``
    (poll and yield the core, never sleep: for ranks that each own an otherwise idle core)."""
    return settings.get("TERRAPIPE_WAIT")


def row_bytes(local_size: int) -> int:
    """Bytes of each rank's row for a node of ``local_size`` ranks (TERRAPIPE_SHM_ROW_BYTES
    overrides)."""
    forced = settings.get("TERRAPIPE_SHM_ROW_BYTES")
    row = forced or max(_MIN_ROW_BYTES, _SEGMENT_BYTES // max(local_size, 1))
    return row // 64 * 64


def remove_stale() -> list[str]:
    """Unlink terrapipe segments whose creating process no longer exists; returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(_SHM_DIR, f"{PREFIX}{os.getuid()}_*")):
        try:
            pid = int(os.path.basename(path).split("_")[2])
        except (IndexError, ValueError):
            continue
        if not alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


class Segment:
    """A shared mapping of ``nbytes`` among the ranks of one node (see NOTE [shm segment lifetime]).

    ``node_comm`` is an mpi4py communicator of the node's ranks.
    """

    _count = 0

    def __init__(self, node_comm, nbytes: int, reserve: bool = False) -> None:
        nbytes = max(int(nbytes), mmap.PAGESIZE)
        name = None
        if node_comm.rank == 0:
            Segment._count += 1
            name = os.path.join(_SHM_DIR, f"{PREFIX}{os.getuid()}_{os.getpid()}_{Segment._count}")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                if reserve:  # NOTE [shared segment reservation]: refuse now, not SIGBUS later
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.unlink(name)
                name = [e.errno, f"{e.strerror}: {nbytes} bytes in {_SHM_DIR}"]
            finally:
                os.close(fd)
        name = node_comm.bcast(name, root=0)
        if isinstance(name, list):  # every rank of the node raises alike
            raise OSError(*name)
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
        if ksync.spin_until(steps, step, _FIRST_SPINS):
            return
        sleepers, nap = self.sleepers, self._nap
        wait_until(lambda: ksync.spin_until(steps, step, _ROUND_SPINS), timeout,
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
        peer lost across nodes] 1)."""
        self.lost[self.me] = -1 if waiting else 0

    def mark_lost(self, rank: int) -> None:
        """Tell this node's ranks that this one lost group rank ``rank`` on another node (NOTE
        [a peer lost across nodes])."""
        self.lost[self.me] = rank + 1

    def sigs(self, step: int) -> np.ndarray:
        """(nlocal, SIG_WORDS): every rank's signature published at ``step``."""
        return self._sig_slots[step % 2]

    def barrier(self, timeout: float, what: str, sig: np.ndarray | None = None) -> int:
        s = self.publish(sig)
        self.wait(s, timeout, what)
        return s


class ShmTransport(Transport):
    """The shared segment of this rank's node: the board (``board``), each local rank's row
    (:meth:`rows`), shared arrays (:meth:`alloc_shared`) and the peers' memory (``peers``, NOTE
    [single-copy allreduce] 4 in comm/algorithms/single_copy.py). ``cross``: an MpiTransport
    over the ranks of the same local rank on every node, or None on one node; the agreement
    runs over it too.

    ``node_comm``: mpi4py communicator of this node's ranks (for creating the segment);
    ``rank``/``size``: in the whole group; ``node_ranks``: group rank of each local rank."""

    name = "shm"

    def __init__(self, node_comm, rank: int, size: int, node_ranks: list[int], timeout: float,
                 cross=None) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = node_comm.Get_rank(), node_comm.Get_size()
        self.timeout = timeout
        self.cross = cross
        p = self.local_size
        row = self.row_bytes = row_bytes(p)
        board_bytes = Board.nbytes(p)
        self.segment = Segment(node_comm, board_bytes + p * row)
        self.board = Board(self.segment.buf[:board_bytes].view(np.int64), p, self.local_rank, node_ranks,
                           cross.describe if cross is not None else "rank {}".format)
        self._rows_u8 = self.segment.buf[board_bytes:board_bytes + p * row].reshape(p, row)
        self._private_u8 = np.empty(row, np.uint8)
        self.acc = np.empty(kreduce.TILE, np.float32)  # float32 scratch of the 16-bit kernels
        self.plans: dict[tuple, object] = {}  # the one-shot's, per signature (algorithms/oneshot.py)
        self._half = 0
        self._node_comm = node_comm  # for the segments of alloc_shared
        self._shared: dict[int, tuple[int, int, np.ndarray, Segment]] = {}  # id: (addr, bytes, rows, segment)
        self._shared_made = 0
        # NOTE [single-copy allreduce] 4 (algorithms/single_copy.py): None where the node cannot
        self.peers = self._probe_single_copy() if cross is None and p > 1 and cma.enabled() else None
        self._staging = np.empty(0, np.uint8)  # contiguous copies of fused messages (single copy)
        if cross is not None:  # agree()'s table: signature and group rank per row; rank -1 pads
            from mpi4py import MPI

            rows = cross.comm.allreduce(p, op=MPI.MAX)
            self._node_table = np.full((rows, SIG_WORDS + 1), -1, np.int64)
        self.hugepages = hugepages.Advisor()  # NOTE [huge pages for reused buffers] in hugepages.py

    def late(self) -> tuple[list[int], str] | None:
        """Group ranks of this node that died or have not reached this rank's step, or None."""
        board = self.board
        if board is None:
            return None
        dead = [board.ranks[q] for q in range(self.local_size) if not alive(int(board.pids[q]))]
        if dead:
            return dead, "died"
        behind = [board.ranks[q] for q in range(self.local_size) if board.steps[q] < board.step]
        if behind:
            return behind, "not arrived at this collective"
        return None

    # -- agreement -----------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        step = self.board.barrier(self.timeout, coll, sig)
        sigs = self.board.sigs(step)
        if self.cross is None:
            if ksync.rows_equal(sigs) >= 0:
                check(sigs, self.board.ranks)
            return
        # Across nodes every rank checks every rank's signature: a rank raising on its node's
        # mismatch before the exchange would leave the other nodes' ranks one agreement behind.
        # The node's table (padded to the largest node of the exchange) travels whole.
        table = self._node_table
        p, words = self.local_size, sigs.shape[1]
        table[:p, :words] = sigs
        table[:p, words] = self.board.ranks
        self.cross.agree_tables(coll, table, check)

    def barrier(self) -> None:
        self.board.barrier(self.timeout, "barrier")

    # -- the rows --------------------------------------------------------------------------------
    def rows(self, dtype) -> np.ndarray:
        """(local_size, row) of ``dtype``: every local rank's row of the segment (NOTE [row
        halves]). The whole C-contiguous array: kernels get it with an offset rather than a
        column slice, whose runtime strides would keep their loops from vectorizing (3x slower)."""
        return self._rows_u8.view(dtype)

    def private_row(self, dtype) -> np.ndarray:
        """A private row's worth of ``dtype`` (the one-shot's scratch)."""
        return self._private_u8.view(dtype)

    def next_half(self) -> int:
        """The row half (0 or 1) the next chunk uses (NOTE [row halves]: alternate, across calls)."""
        h = self._half
        self._half ^= 1
        return h

    # -- shared arrays (NOTE [shared arrays] in comm/algorithms/shared.py) ---------------------------
    def alloc_shared(self, nbytes: int) -> np.ndarray:
        """This rank's row of a new node segment with a row of ``nbytes`` (uint8, 64-byte
        aligned) per local rank. Collective over the node, in the group's order; OSError on
        every rank of the node when /dev/shm cannot hold it (NOTE [shared segment reservation])."""
        stride = -(-max(int(nbytes), 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        segment = Segment(self._node_comm, self.local_size * stride, reserve=True)
        rows = segment.buf.reshape(self.local_size, stride)
        mine = rows[self.local_rank, :nbytes]
        self._shared_made += 1
        self._shared[self._shared_made] = (rows[self.local_rank].ctypes.data, stride, rows, segment)
        return mine

    def release_shared(self, arr: np.ndarray) -> bool:
        """Stop treating the segment holding ``arr`` as shared (its memory goes once the last
        view of it does; each peer's mapping lives on with its own views). Local."""
        found = self.locate(arr)
        if found is None:
            return False
        ident = found[0]
        self._shared.pop(ident)[3].close()
        return True

    def shared_rows(self, ident: int) -> np.ndarray:
        """(local_size, stride) uint8: every local rank's row of shared segment ``ident``."""
        return self._shared[ident][2]

    def locate(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(segment id, byte offset in this rank's row) when ``arr``'s memory lies within a row
        of :meth:`alloc_shared`, else None."""
        if not self._shared or arr.size == 0:
            return None
        addr = arr.__array_interface__["data"][0]
        end = addr + arr.nbytes
        for ident, (base, stride, _rows, _seg) in self._shared.items():
            if base <= addr and end <= base + stride:
                return ident, addr - base
        return None

    # -- single copy (NOTE [single-copy allreduce] in comm/algorithms/single_copy.py) -------------
    def _probe_single_copy(self) -> cma.Peers | None:
        """Whether every rank of the node can read every other's memory (NOTE [single-copy
        allreduce] 4), agreed on the board: the Peers to do it with, or None on every rank."""
        board, me = self.board, self.local_rank
        mark = np.array([os.getpid()], np.int64)  # what a peer must read at this address
        board.addrs[me, 0] = mark.ctypes.data
        board.barrier(self.timeout, "start-up")
        ok = all(q == me or cma.read_value(int(board.pids[q]), int(board.addrs[q, 0])) == board.pids[q]
                 for q in range(self.local_size))
        step = board.barrier(self.timeout, "start-up", np.array([1 if ok else 2], np.int64))
        if (board.sigs(step)[:, 0] != 1).any():
            return None
        return cma.Peers(board.pids.copy(), list(board.ranks))

    def post_single_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Publish this rank's source and destination for the single-copy collective whose
        agreement comes next (its release store makes them visible); buffers posted again and
        again get huge pages (NOTE [huge pages for reused buffers] in hugepages.py)."""
        self.hugepages.saw(src.ctypes.data, src.nbytes)
        if dst.ctypes.data != src.ctypes.data:
            self.hugepages.saw(dst.ctypes.data, dst.nbytes)
        self.board.addrs[self.local_rank] = (src.ctypes.data, dst.ctypes.data)

    def staging(self, nbytes: int) -> np.ndarray:
        """A private contiguous uint8 buffer of ``nbytes`` for a fused message's single copy
        (kept and grown: a fresh one would pay a page fault per 4 KiB on every call)."""
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        return self._staging[:nbytes]

    def close(self, healthy: bool = True) -> None:
        """Unmap the segments; ``healthy``: also free the node communicator (an MPI call every
        rank of the node makes; skipped after a failure)."""
        for *_, segment in self._shared.values():
            segment.close()
        self._shared.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.board = None
        free = getattr(self._node_comm, "Free", None)
        if healthy and free is not None:
            free()
        self._node_comm = None
