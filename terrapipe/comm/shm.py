"""The shared-memory transport: a segment per node, the board its ranks synchronise on, and the
collectives that move data through it (across nodes, each part of an allreduce goes over the
cross-node MPI transport: a hierarchical allreduce).

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

NOTE [shared arrays]
    1. ``ShmTransport.alloc_shared`` (``Group.shared_array``, collective) maps one segment per
       node with a row of the requested size per local rank and gives each rank its own row.
       Memory allocated there (DistributedGradients' bucket buffers) is reduced in place with
       nothing copied in or out: every rank takes one part of the message, reduces it over all
       rows and stores the result into every row, its peers' included. Per rank that moves
       about 2 n bytes (reads n, writes n); the chunked segment path moves about 5.5 n (copy in,
       reduce, copy out) and the MPI ring about as much.
    2. An allreduce takes this path when its one source is its destination, lies within this
       rank's row of such a segment, and is not compressed on the wire (from
       ``SHARED_MIN_BYTES``: NOTE [transport selection] 6 in group.py). Its signature carries
       (segment, byte offset), so every rank must pass the same piece of its own row; a rank
       passing private memory where another passes shared memory gets CollectiveMismatchError
       rather than a hang.
    3. On one node, for native dtypes, a rank's part goes in one pass
       (``kernels.reduce.allreduce_rows``): tile by tile, reduced into its own row while the
       tile sits in L1, divided there for avg, stored from there into the other rows. Two
       barriers only: the agreement's first (every rank's data is final) and a last one (every
       row is final, so the caller may read and write its row once the call returns). Nothing
       in between: the parts' columns are disjoint, and during the call a rank reads and
       writes only its own part's columns, in every row. Against the three passes this path
       took before (reduce into its own row, divide, then per 4 MiB chunk a barrier and a copy
       of the others' parts from their rows: about 2.5-3.5 n bytes), interleaved at 2 ranks:
       16 MiB 2.2 vs 6.0 ms, 34 MiB 4.6 vs 12.4, 64 MiB 9.1 vs 22.3; in a training step
       (benchmarks.train's model, 21 interleaved rounds) the communication overhead fell from
       18.6 to 10.3 ms. ``benchmarks.allreduce -n 2``: 7.9-8.7 GB/s from 4 MiB, 1.7-2x the
       ring over MPI, 4.7-5x MPICH's Allreduce from 64 MiB. Across nodes a part must be allreduced
       between the nodes before it is stored into the other rows, and 16-bit floats are summed
       in float32 scratch (``reduce_many_16``), so those take the three passes, in chunks
       (``_SHARED_CHUNK_BYTES``): reduce my part of chunk k (and allreduce it across nodes),
       barrier, copy the others' parts of chunk k while their writes are still in the shared
       cache. One barrier per chunk suffices: after barrier k nobody writes chunk k's columns
       of any row again, and the next chunk's columns are disjoint.
    4. The segment's memory is reserved when it is made (``posix_fallocate``), so a full
       ``/dev/shm`` refuses at once, with OSError on every rank of the node, instead of killing
       a process with SIGBUS at its first touch of a missing page.

NOTE [staging gate]
    ``ShmTransport.allreduce`` takes a gate for sources and destinations that are host copies of
    device memory (comm/staging.py, NOTE [staging streams]). Every transport calls
    ``gate.ready(upto)`` before reading a source element below fused index ``upto`` and
    ``gate.wrote(upto)`` once every result below ``upto`` is final; the chunked shared-memory
    path does both per chunk, so downloads, reduction and uploads overlap. The gate owns those
    host arrays: nothing else writes them during the call.
"""

from __future__ import annotations

import glob
import mmap
import os
import time

import numba
import numpy as np

from .. import settings, timeline
from ..kernels import oneshot
from ..kernels import reduce as kreduce
from ..kernels.sync import CAN_SLEEP, publish_step, release_step, rows_equal, sleep_until, spin_until
from . import cma, hugepages
from .errors import CollectiveTimeoutError
from .ring import segments
from .transport import NO_GATE, Fused, Transport, divide

__all__ = ["Segment", "Board", "ShmTransport", "remove_stale", "alive", "PREFIX", "row_bytes",
           "oneshot_bytes", "wait_mode"]

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
# clock and its peers' liveness and drives MPI's progress (NOTE [MPI progress] 4 in ring.py).
_SLEEP_AFTER_SECONDS = 50e-6
_NAP_SECONDS = 1e-3
# The one-shot allreduce (one barrier: data and signature published together, every rank reduces
# the whole message) has each rank read p x n bytes; it beats MPICH's Allreduce and our other
# paths while that stays within ONESHOT_READ_BYTES (measured here: at 2 ranks up to 2 MiB,
# 279 vs 337 us, not at 4 MiB; at 4 ranks up to 1 MiB, 404 vs 619 us, not at 2 MiB).
ONESHOT_READ_BYTES = 4 << 20
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


def oneshot_bytes(local_size: int, row: int) -> int:
    """The largest allreduce (bytes as exchanged) the one-shot takes on such a node."""
    return min(row // 2, ONESHOT_READ_BYTES // max(local_size, 1))
# NOTE [shared arrays] 3: across nodes a message goes in chunks of this size (each rank reduces
# its part of a chunk, then copies the others' parts of it, still in the shared cache). 1 and 4
# MiB ran alike here, 16 MiB and whole messages slower at 2 ranks.
_SHARED_CHUNK_BYTES = 4 << 20
# An allreduce over a shared array pays two barriers (the agreement's and the last) where the
# one-shot pays one, but reads n bytes instead of p x n and copies nothing in or out. Measured
# (interleaved, float32 avg, each operand written right before its call, as gradients are): at
# 2 ranks the one-shot wins up to 448 KiB (256 KiB: 76 vs 96 us), ties at 512, loses beyond
# (1 MiB 384 vs 180 us, 2 MiB 825 vs 289); at 4 ranks on 2 cores it wins at 256 KiB (305 vs
# 341), loses from 512 (399 vs 359). On operands reduced again without a write between, the
# shared path already wins from 128 KiB. NOTE [transport selection] 6 in group.py.
SHARED_MIN_BYTES = 512 << 10
# Polls before a one-shot allreduce leaves its compiled call to wait while yielding the core.
_ONESHOT_SPINS = 2000


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


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this node)."""
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

    def __init__(self, node_comm, nbytes: int, reserve: bool = False) -> None:
        nbytes = max(int(nbytes), mmap.PAGESIZE)
        name = None
        if node_comm.rank == 0:
            Segment._count += 1
            name = os.path.join(_SHM_DIR, f"{PREFIX}{os.getuid()}_{os.getpid()}_{Segment._count}")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                if reserve:  # NOTE [shared arrays] 4: refuse now rather than SIGBUS at first touch
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

    def __init__(self, words: np.ndarray, nlocal: int, me: int, ranks: list[int]) -> None:
        self.table = words[: nlocal * _SLOT].reshape(nlocal, _SLOT)
        self.steps = self.table[:, 0]
        self.sleepers = self.table[:, oneshot.SLEEPERS_COL]  # NOTE [sleeping on a counter] 2
        self.sleeps = CAN_SLEEP and wait_mode() == "sleep"
        self._nap = np.array([0, int(_NAP_SECONDS * 1e9)], np.int64)  # a struct timespec
        self._sig_slots = tuple(self.table[:, c : c + SIG_WORDS] for c in _SIG_COLS)
        self.pids = self.table[:, 60]
        # Each rank's source and destination addresses for a single-copy collective, written
        # before the agreement's release store (NOTE [single-copy allreduce] 2 in cma.py).
        self.addrs = self.table[:, 1:3].view(np.uint64)
        self.me = me
        self.ranks = ranks  # world rank of each local rank, for messages
        self.step = 0
        self.pids[me] = os.getpid()
        self.progress = lambda: None  # called between spin rounds (NOTE [MPI progress] 4 in ring.py)

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
            release_step(self.steps, self.sleepers, self.me, self.step)
        else:
            publish_step(self._sig_slots[self.step % 2], self.me, sig, self.steps, self.sleepers, self.step)
        return self.step

    def wait(self, step: int, timeout: float, what: str) -> None:
        """Until every local rank's counter reaches ``step``: spin, then yield the core between
        short rounds (ranks may outnumber cores), then sleep on the late counter (NOTE
        [sleeping on a counter] in kernels/sync.py); raises CollectiveTimeoutError naming the
        late ranks after ``timeout`` seconds, or at once when one of them died."""
        steps = self.steps
        if spin_until(steps, step, _FIRST_SPINS):
            return
        start = time.monotonic()
        rounds = 0
        while not spin_until(steps, step, _ROUND_SPINS):
            slept = self.sleeps and time.monotonic() - start > _SLEEP_AFTER_SECONDS
            if not slept:
                os.sched_yield()
            elif sleep_until(steps, self.sleepers, step, self._nap):
                return
            self.progress()
            rounds += 1
            if rounds % 256 and not slept:
                continue
            late = [int(q) for q in np.nonzero(steps < step)[0]]
            if not late:
                return
            dead = [q for q in late if not alive(int(self.pids[q]))]
            if dead:
                names = ", ".join(f"rank {self.ranks[q]} (pid {int(self.pids[q])})" for q in dead)
                raise CollectiveTimeoutError(f"{what}: {names} died", [self.ranks[q] for q in dead])
            if time.monotonic() - start > timeout:
                names = ", ".join(f"rank {self.ranks[q]}" for q in late)
                raise CollectiveTimeoutError(
                    f"{what}: Timed out after {timeout:g}s waiting for {names}",
                    [self.ranks[q] for q in late])

    def sigs(self, step: int) -> np.ndarray:
        """(nlocal, SIG_WORDS): every rank's signature published at ``step``."""
        return self._sig_slots[step % 2]

    def barrier(self, timeout: float, what: str, sig: np.ndarray | None = None) -> int:
        s = self.publish(sig)
        self.wait(s, timeout, what)
        return s


def _entry_point(kernel, args: tuple):
    """The compiled entry point of ``kernel`` for the types of ``args``, compiled (or loaded
    from Numba's cache) now, without running it.

    NOTE [symmetric completion]: a rank must not do first-call work after a collective's
    meeting point that its peers skip. In the one-shot, only a rank that arrived early and
    waited calls :func:`~terrapipe.kernels.oneshot.finish`; compiled lazily there (hundreds of
    milliseconds on a cold cache, milliseconds to load from a warm one), it left the collective
    that much later than the rank that arrived last, so a rank's next step started late and
    Horovod's barrier test, which times a barrier from the previous collective's return on
    each rank, measured a barrier shorter than the peer's sleep. So a plan compiles every kernel
    it may run after the meeting before its rank publishes."""
    key = tuple(numba.typeof(a) for a in args)
    kernel.compile(key)
    return kernel.overloads[key].entry_point


class ShmTransport(Transport):
    """Collectives through the shared segment of this rank's node; with ``cross`` (an
    MpiTransport over the ranks of the same local rank on every node) hierarchical: each part of
    an allreduce is reduced on the node, allreduced across nodes, and gathered back.

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
        self.small_bytes = oneshot_bytes(p, row)  # the one-shot's limit (NOTE [transport selection])
        board_bytes = Board.nbytes(p)
        self.segment = Segment(node_comm, board_bytes + p * row)
        self.board = Board(self.segment.buf[:board_bytes].view(np.int64), p, self.local_rank, node_ranks)
        self._rows_u8 = self.segment.buf[board_bytes:board_bytes + p * row].reshape(p, row)
        self._private_u8 = np.empty(row, np.uint8)
        self._acc = np.empty(kreduce.TILE, np.float32)
        self._plans: dict[tuple, object] = {}  # oneshot's plans
        self._half = 0
        self._node_comm = node_comm  # for the segments of alloc_shared
        self._shared: dict[int, tuple[int, int, np.ndarray, Segment]] = {}  # id: (addr, bytes, rows, segment)
        self._shared_made = 0
        # NOTE [single-copy allreduce] 4 in cma.py: None where the node cannot (or across nodes)
        self.peers = self._probe_single_copy() if cross is None and p > 1 and cma.enabled() else None
        self._staging = np.empty(0, np.uint8)  # contiguous copies of fused messages (single copy)
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
        if rows_equal(sigs) >= 0:
            check(sigs, self.board.ranks)
        if self.cross is not None:
            self.cross.agree(coll, sig, check)

    # -- the rows --------------------------------------------------------------------------------
    def _rows(self, dtype) -> np.ndarray:
        # The whole C-contiguous (p, row) array: kernels get it with an offset rather than a
        # column slice, whose runtime strides would keep their loops from vectorizing (3x slower).
        return self._rows_u8.view(dtype)

    def _reduce_rows(self, rows: np.ndarray, op: int, offset: int, length: int, kind: int) -> None:
        """My row's ``[offset:offset+length]`` = op over all rows of those columns (only columns
        no other rank reads at this point)."""
        mine = rows[self.local_rank]
        if kind:
            kreduce.reduce_many_16(mine, rows, op, offset, length, kind, self._acc)
        else:
            kreduce.reduce_many_native(mine, rows, op, offset, length)

    def _reduce_part(self, rows: np.ndarray, op: int, start: int, length: int, kind: int,
                     label: str, rec: bool, t: int) -> int:
        """This rank's part of a message, columns ``[start, start + length)``: reduced over the
        node's rows into its own row, allreduced across nodes, divided for ``avg``. ``rec``:
        record ``label`` (and the cross-node phase) on the timeline from ``t``; returns the
        clock for the next phase."""
        if length <= 0:
            return t
        self._reduce_rows(rows, op, start, length, kind)
        mine = rows[self.local_rank, start:start + length]
        if rec:
            t = timeline.phase("comm", label, t, {"bytes": length * rows.itemsize})
        if self.cross is not None:
            self.cross.allreduce_array(mine, op, kind, "allreduce across nodes")
            if rec:
                t = timeline.phase("comm", "allreduce across nodes", t)
        if op == kreduce.AVG:
            divide(mine, self.size, kind)
        return t

    def _chunk_ranges(self, n: int, itemsize: int):
        half = (self.row_bytes // itemsize) // 2
        for c0 in range(0, n, half):
            h = self._half * half
            self._half ^= 1
            yield c0, min(half, n - c0), h

    # -- shared arrays (NOTE [shared arrays]) -------------------------------------------------------
    def alloc_shared(self, nbytes: int) -> np.ndarray:
        """This rank's row of a new node segment with a row of ``nbytes`` (uint8, 64-byte
        aligned) per local rank. Collective over the node, in the group's order; OSError on
        every rank of the node when /dev/shm cannot hold it (NOTE [shared arrays] 4)."""
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

    def allreduce_shared(self, ident: int, offset: int, n: int, op: int, dtype, kind: int) -> None:
        """Allreduce, in place, the ``n`` elements of ``dtype`` at byte ``offset`` of every local
        rank's row of shared segment ``ident`` (NOTE [shared arrays]); the agreement's barrier
        has run. Across nodes each part is allreduced over the cross-node transport."""
        rows = self._shared[ident][2].view(dtype)
        p, me = self.local_size, self.local_rank
        item = np.dtype(dtype).itemsize
        base = offset // item
        rec = timeline.enabled()
        t = timeline.now() if rec else 0
        if self.cross is None and not kind:  # NOTE [shared arrays] 3: one pass
            lo, hi = segments(n, p)[me]
            divisor = self.size if op == kreduce.AVG else 1
            kreduce.allreduce_rows(rows, me, op, base + lo, hi - lo, divisor)
            if rec:
                t = timeline.phase("comm", "reduce (shared)", t, {"bytes": (hi - lo) * item})
        else:  # across nodes, or 16-bit floats: three passes per chunk
            step = max(_SHARED_CHUNK_BYTES // item, p)
            for c0 in range(0, n, step):
                length = min(step, n - c0)
                parts = segments(length, p)
                lo, hi = parts[me]
                at = base + c0
                t = self._reduce_part(rows, op, at + lo, hi - lo, kind, "reduce (shared)", rec, t)
                self.board.barrier(self.timeout, "allreduce")
                if rec:
                    t = timeline.phase("comm", "wait for peers", t)
                # The peers' parts of this chunk, while their writes are still in the shared cache.
                # Nobody writes these columns of this row again in this call: a peer's next chunk
                # is beyond them (NOTE [shared arrays] 3).
                for q, (a, b) in enumerate(parts):
                    if q != me and b > a:
                        rows[me, at + a:at + b] = rows[q, at + a:at + b]
                if rec:
                    t = timeline.phase("comm", "copy parts (shared)", t, {"bytes": (length - hi + lo) * item})
        self.board.barrier(self.timeout, "allreduce")  # NOTE [shared arrays] 3
        if rec:
            timeline.phase("comm", "wait for peers", t)

    # -- single copy (NOTE [single-copy allreduce] in cma.py) --------------------------------------
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

    def _reduce_from_peers(self, dst: np.ndarray, shift: int, src: np.ndarray, lo: int, hi: int,
                           op: int, coll: str) -> None:
        """Phase one (NOTE [single-copy allreduce] 2): ``dst[lo - shift:hi - shift]`` = op over
        every local rank's posted source ``[lo, hi)`` (``src`` is mine), divided for avg."""
        peers, addrs = self.peers, self.board.addrs
        failed = cma.reduce_part(dst, shift, src, peers.pids, np.ascontiguousarray(addrs[:, 0]),
                                 self.local_rank, op, lo, hi, self.size if op == kreduce.AVG else 1,
                                 src.dtype.kind in "iu", peers.tile(src.dtype), peers.iov)
        if failed >= 0:
            raise peers.failed(failed, coll, int(addrs[failed, 0]))

    def allreduce_single_copy(self, src: np.ndarray, dst: np.ndarray, op: int) -> None:
        """Allreduce ``src`` (1-D, native dtype, this rank's private memory) into ``dst`` (same
        shape and dtype; may be ``src``) by reading the peers' memory (NOTE [single-copy
        allreduce] in cma.py); :meth:`post_single_copy` and the agreement have run. One node."""
        board, peers = self.board, self.peers
        me = self.local_rank
        n = src.shape[0]
        parts = segments(n, self.local_size)
        lo, hi = parts[me]
        rec = timeline.enabled()
        t = timeline.now() if rec else 0
        self._reduce_from_peers(dst, 0, src, lo, hi, op, "allreduce")
        if rec:
            t = timeline.phase("comm", "reduce (single copy)", t, {"bytes": (hi - lo) * src.itemsize})
        board.barrier(self.timeout, "allreduce")
        if rec:
            t = timeline.phase("comm", "wait for peers", t)
        bounds = np.array([a for a, _ in parts] + [n], np.int64)
        failed = cma.gather_parts(dst, peers.pids, np.ascontiguousarray(board.addrs[:, 1]), bounds, me,
                                  peers.iov)
        if failed >= 0:
            raise peers.failed(failed, "allreduce", int(board.addrs[failed, 1]))
        if rec:
            t = timeline.phase("comm", "copy parts (single copy)", t, {"bytes": (n - hi + lo) * src.itemsize})
        board.barrier(self.timeout, "allreduce")  # nobody reads my destination any more
        if rec:
            timeline.phase("comm", "wait for peers", t)

    def _read_from(self, q: int, dst: np.ndarray, remote: int, what: str) -> None:
        """``dst`` (1-D, C-contiguous) = the bytes at ``remote`` of local rank ``q``."""
        peers = self.peers
        if not cma.read(int(peers.pids[q]), dst.ctypes.data, remote, dst.nbytes, peers.iov):
            raise peers.failed(q, what, remote)

    def allgather_single_copy(self, flat: np.ndarray, out: np.ndarray, root: int = -1) -> None:
        """``out[r]`` = rank r's ``flat`` for every rank (on ``root`` only when >= 0), read from
        each peer's memory (NOTE [single-copy allreduce] 6); posted and agreed. One node."""
        coll = "gather" if root >= 0 else "allgather"
        if root < 0 or root == self.rank:
            ranks, addrs = self.board.ranks, self.board.addrs
            for q in range(self.local_size):
                row = out[ranks[q]]
                if q == self.local_rank:
                    row[...] = flat
                elif row.flags.c_contiguous:
                    self._read_from(q, row, int(addrs[q, 0]), coll)
                else:
                    tmp = np.empty_like(flat)
                    self._read_from(q, tmp, int(addrs[q, 0]), coll)
                    row[...] = tmp
        self.board.barrier(self.timeout, coll)  # every source is read

    def reduce_scatter_single_copy(self, flat: np.ndarray, out: np.ndarray, op: int) -> None:
        """``out`` = this rank's part (``segments(n, size)``) of op over every rank's ``flat``
        (native dtypes), read from the peers' memory (NOTE [single-copy allreduce] 6); posted
        and agreed. One node."""
        lo, hi = segments(flat.shape[0], self.size)[self.rank]
        dst = out if out.flags.c_contiguous else np.empty(hi - lo, flat.dtype)
        self._reduce_from_peers(dst, lo, flat, lo, hi, op, "reduce_scatter")
        if dst is not out:
            out[...] = dst
        self.board.barrier(self.timeout, "reduce_scatter")  # every source is read

    # -- allreduce -------------------------------------------------------------------------------
    def oneshot(self, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, coll: str,
                sig: np.ndarray, check) -> None:
        """A small allreduce and its agreement in one compiled call (kernels/oneshot.py): data
        and signature are published together and every rank reduces the whole message into a
        private scratch row, never into its shared row, which the others are still reading.
        ``src``/``dst``: 1-D, ``dtype`` (the rows' dtype), or float32 over uint16 rows of 16-bit
        format ``kind`` (sent rounded). One node only; at most ``small_bytes`` exchanged."""
        self.oneshot_plan(dtype, op, kind, coll, sig, check)(src, dst)

    def oneshot_plan(self, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check):
        """:meth:`oneshot` with everything but the arrays fixed: a function ``(src, dst)``, one
        per signature (kept here for the general path and the latency path alike,
        Group.allreduce_small), which calls the compiled overload directly once it knows the
        argument types (skipping Numba's per-call type dispatch)."""
        key = (dtype, op, kind, coll, sig.tobytes())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 256:
                self._plans.clear()
            plan = self._plans[key] = self._build_plan(dtype, op, kind, coll, sig, check)
        return plan

    def _build_plan(self, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check):
        rows, scratch = self._rows_u8.view(dtype), self._private_u8.view(dtype)
        half = rows.shape[1] // 2
        board, me, acc = self.board, self.local_rank, self._acc
        table, timeout = board.table, self.timeout
        divisor = self.size if op == kreduce.AVG else 1
        compiled = {}

        def call(src: np.ndarray, dst: np.ndarray) -> None:
            h = self._half * half
            self._half ^= 1
            step, col = board.reserve()
            args = (src, dst, rows, h, me, table, col, sig, step, op, divisor, kind, scratch, acc,
                    _ONESHOT_SPINS)
            tail = (dst, rows, h, op, divisor, kind, scratch, acc)
            # What Numba's type of an array depends on: dtype, layout, writeability.
            types = (src.dtype, src.flags.c_contiguous, src.flags.writeable,
                     dst.dtype, dst.flags.c_contiguous)
            fns = compiled.get(types)
            if fns is None:
                fns = compiled[types] = (_entry_point(oneshot.oneshot_allreduce, args),
                                         _entry_point(oneshot.finish, tail))
            state = fns[0](*args)
            if state == oneshot.WAITING:
                board.wait(step, timeout, coll)
                state = rows_equal(board.sigs(step))
                if state < 0:
                    fns[1](*tail)
            if state >= 0:
                check(board.sigs(step), board.ranks)

        return call

    def allreduce(self, srcs: Fused, dsts: Fused, op, dtype, kind, ckind=0, root=-1, gate=NO_GATE) -> None:
        """Reduce-scatter within the node, allreduce across nodes per part, all-gather back, one
        row half at a time (NOTE [row halves]); ``kind``: 16-bit format of the rows; ``ckind``:
        rows hold compressed copies of float32 inputs; ``root`` >= 0: only that rank copies the
        result out (reduce)."""
        p, me = self.local_size, self.local_rank
        rows = self._rows(dtype)
        item = np.dtype(dtype).itemsize
        rec = timeline.enabled()  # the phases of each chunk, at one clock read each
        for c0, length, h in self._chunk_ranges(srcs.n, item):
            t = timeline.now() if rec else 0
            gate.ready(c0 + length)
            if rec and gate is not NO_GATE:
                t = timeline.phase("comm", "wait for device", t)
            srcs.read(c0, length, rows[me, h:h + length], ckind)
            if rec:
                t = timeline.phase("comm", "copy in", t, {"bytes": length * item})
            self.board.barrier(self.timeout, "allreduce")
            if rec:
                t = timeline.phase("comm", "wait for peers", t)
            parts = segments(length, p)
            lo, hi = parts[me]
            t = self._reduce_part(rows, op, h + lo, hi - lo, kind, "reduce", rec, t)
            self.board.barrier(self.timeout, "allreduce")
            if rec:
                t = timeline.phase("comm", "wait for peers", t)
            if root < 0 or root == self.rank:
                for q, (a, b) in enumerate(parts):
                    if b > a:
                        dsts.write(c0 + a, rows[q, h + a:h + b], ckind)
            gate.wrote(c0 + length)
            if rec:
                timeline.phase("comm", "copy out", t)

    # -- one node only (Group._route sends these over MPI across nodes) --------------------------
    def broadcast(self, flat, root) -> None:
        rows = self._rows(flat.dtype)
        lroot = self.board.ranks.index(root)
        for c0, length, h in self._chunk_ranges(flat.shape[0], flat.itemsize):
            if self.rank == root:
                rows[lroot, h:h + length] = flat[c0:c0 + length]
            self.board.barrier(self.timeout, "broadcast")
            if self.rank != root:
                flat[c0:c0 + length] = rows[lroot, h:h + length]

    def allgather(self, flat, out, root=-1) -> None:
        rows = self._rows(flat.dtype)
        me = self.local_rank
        coll = "gather" if root >= 0 else "allgather"
        for c0, length, h in self._chunk_ranges(flat.shape[0], flat.itemsize):
            rows[me, h:h + length] = flat[c0:c0 + length]
            self.board.barrier(self.timeout, coll)
            if root < 0 or root == self.rank:
                for q in range(self.local_size):
                    out[self.board.ranks[q], c0:c0 + length] = rows[q, h:h + length]

    def scatter(self, full, out, root) -> None:
        n = out.shape[0]
        rows = self._rows(out.dtype)
        me = self.local_rank
        for c0, length, h in self._chunk_ranges(n, out.itemsize):
            if self.rank == root:
                for q in range(self.local_size):
                    r = self.board.ranks[q]
                    rows[q, h:h + length] = full[r * n + c0:r * n + c0 + length]
            self.board.barrier(self.timeout, "scatter")
            out[c0:c0 + length] = rows[me, h:h + length]

    def reduce_scatter(self, flat, out, op, kind) -> None:
        if kind:  # 16-bit rows: through a full allreduce, whose kernels accumulate in float32
            tmp = flat.copy()
            fused = Fused([tmp])
            self.allreduce(fused, fused, op, tmp.dtype, kind)
            lo, hi = segments(flat.shape[0], self.size)[self.rank]
            out[...] = tmp[lo:hi]
            return
        n = flat.shape[0]
        rows = self._rows(flat.dtype)
        me = self.local_rank
        lo_me, hi_me = segments(n, self.size)[self.rank]
        for c0, length, h in self._chunk_ranges(n, flat.itemsize):
            rows[me, h:h + length] = flat[c0:c0 + length]
            self.board.barrier(self.timeout, "reduce_scatter")
            a, b = max(lo_me, c0), min(hi_me, c0 + length)
            if b > a:
                self._reduce_rows(rows, op, h + a - c0, b - a, 0)
                dst = out[a - lo_me:b - lo_me]
                dst[...] = rows[me, h + a - c0:h + b - c0]
                if op == kreduce.AVG:
                    divide(dst, self.size, 0)

    def barrier(self) -> None:
        if self.cross is not None:  # on one node the agreement was the barrier
            self.cross.barrier()

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
