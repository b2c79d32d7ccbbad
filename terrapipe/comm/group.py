"""Process groups and their collectives.

A :class:`Group` is a set of ranks (the world, or a ``split`` of it). Ranks on one node exchange
data through a shared segment (NOTE [shm segment lifetime], NOTE [board protocol] in shm.py) and
reduce it with the kernels' multi-source reduce; ranks on different nodes exchange through MPI.

NOTE [collective ordering]
    Every rank of a group issues its collectives in the same order, sync and async alike. Async
    calls run on the group's single worker thread in submission order; a sync call runs inline
    when nothing async is pending, else it queues behind them. Every collective starts with a
    signature barrier on the board: all ranks publish (collective, op, dtype, shape, root) and
    compare before any data moves, so a mismatch raises CollectiveMismatchError on every rank.

NOTE [row halves]
    Each local rank owns a row of the segment, split in two halves used by alternate chunks (a
    counter that runs on across calls). A rank writes half h for chunk k + 2 only after the
    barrier of chunk k + 1, which every rank publishes after finishing its reads of chunk k: so
    one barrier per chunk suffices for copies, two for reductions (data in, reduced parts ready).

NOTE [staging gate]
    ``allreduce_views`` takes an optional gate for sources and destinations that are host copies
    of device memory (comm/staging.py, NOTE [staging streams]). Every path calls
    ``gate.ready(upto)`` before reading a source element below fused index ``upto`` and
    ``gate.wrote(upto)`` once every result below ``upto`` is final; the chunked shared-memory
    path does both per chunk, so downloads, reduction and uploads overlap. The gate owns those
    host arrays: nothing else writes them during the call.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..kernels import oneshot
from ..kernels import reduce as kreduce
from ..kernels.floats import F16, compress, decompress
from ..kernels.sync import rows_equal
from .buffers import DTYPE_CODES, Buffer
from .errors import CollectiveMismatchError, CollectiveTimeoutError, CommError
from .ring import ring_allreduce, segments
from .shm import SIG_WORDS, Board, Segment, _alive

__all__ = ["Group", "Handle"]

_COLL = {"allreduce": 1, "broadcast": 2, "allgather": 3, "reduce_scatter": 4, "reduce": 5,
         "gather": 6, "scatter": 7, "barrier": 8, "jit_allreduce": 9,
         "nccl_allreduce": 10, "nccl_broadcast": 11, "nccl_allgather": 12}
_CODE_DTYPE = {v: k for k, v in DTYPE_CODES.items()}
_CODE_OP = {v: k for k, v in kreduce.OPS.items()}
_ROW_BYTES = int(os.environ.get("TERRAPIPE_SHM_ROW_BYTES", 1 << 20)) // 64 * 64
# At or below this many bytes an allreduce is one barrier: data and signature are published
# together and every rank reduces the whole message (latency over bandwidth).
_SMALL_BYTES = 64 << 10
# Polls before a one-shot allreduce leaves its compiled call to wait while yielding the core.
_ONESHOT_SPINS = 2000
# At or above this many bytes an MPI allreduce runs as our chunked ring (comm/ring.py).
_RING_BYTES = int(os.environ.get("TERRAPIPE_RING_BYTES", 1 << 20))


class _NoGate:
    """The gate of host-only calls (NOTE [staging gate]): nothing to wait for or copy back."""

    @staticmethod
    def ready(upto: int) -> None:
        pass

    @staticmethod
    def wrote(upto: int) -> None:
        pass


NO_GATE = _NoGate()


class Handle:
    """An outstanding async collective. ``wait()`` returns its result (or raises its error)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None):
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


class _Fused:
    """Several flat arrays seen as one: ``read``/``write`` copy a range of the concatenation."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self.views = views
        self.offsets = [0]
        for v in views:
            self.offsets.append(self.offsets[-1] + v.shape[0])
        self.n = self.offsets[-1]

    def _pieces(self, c0: int, length: int):
        if len(self.views) == 1:
            yield self.views[0], c0, c0 + length, 0
            return
        i = bisect.bisect_right(self.offsets, c0) - 1
        pos = c0
        end = c0 + length
        while pos < end:
            v0 = int(self.offsets[i])
            v1 = int(self.offsets[i + 1])
            a, b = pos - v0, min(end, v1) - v0
            if b > a:
                yield self.views[i], a, b, pos - c0
            pos = max(pos, min(end, v1))
            i += 1

    def read(self, c0: int, length: int, out: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            out[:length] = self.views[0][c0:c0 + length]
            return
        for v, a, b, o in self._pieces(c0, length):
            if ckind:
                compress(v[a:b], out[o:o + b - a], ckind)
            else:
                out[o:o + b - a] = v[a:b]

    def write(self, c0: int, src: np.ndarray, ckind: int = 0) -> None:
        if len(self.views) == 1 and not ckind:
            self.views[0][c0:c0 + src.shape[0]] = src
            return
        for v, a, b, o in self._pieces(c0, src.shape[0]):
            if ckind:
                decompress(src[o:o + b - a], v[a:b], ckind)
            else:
                v[a:b] = src[o:o + b - a]


class Group:
    """A communicator: ``rank``, ``size``, ``local_rank``, ``local_size`` and the collectives.

    Built by :func:`terrapipe.comm.init` (the world) and :meth:`split`. ``mpi_comm`` is an mpi4py
    communicator, or None for a lone process (every collective is then local).
    """

    def _init_execution(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self._state = threading.Lock()  # _pending and the pool (NOTE in Group.run)
        self._exec = threading.RLock()  # held while a collective body runs
        self._pool: ThreadPoolExecutor | None = None
        self._pending = 0
        self._failed: str | None = None
        self._half = 0
        self.segment = None
        self.staging_pool = None  # comm/staging.py: pinned buffers and side streams, made on demand
        self.nccl_pg = None  # comm/nccl.py: None (undecided), False (staged) or the process group
        self.owns_torch_world = False  # comm/nccl.py made torch.distributed's world for NCCL
        self._views: dict[np.dtype, tuple[np.ndarray, np.ndarray]] = {}  # rows, scratch by dtype
        self._small_entries: dict[tuple, tuple | None] = {}  # allreduce_small's plans
        self._ring_pending: dict[int, list] = {}  # per ring communicator: its done-message sends
        forced = os.environ.get("TERRAPIPE_COMM_BACKEND", "auto").lower()
        self.force_mpi, self.force_shm = forced == "mpi", forced == "shm"

    def __init__(self, mpi_comm=None, timeout: float = 300.0, node_size: int | None = None) -> None:
        self._init_execution(timeout)
        self.comm = mpi_comm
        if mpi_comm is None:
            self.rank, self.size, self.local_rank, self.local_size, self.nnodes = 0, 1, 0, 1, 1
            self.node = self.cross = self.board = None
            self.world_ranks = [0]
            return
        from mpi4py import MPI

        self._MPI = MPI
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.world_ranks = mpi_comm.allgather(MPI.COMM_WORLD.Get_rank())
        if node_size:
            color = self.rank // node_size
        else:
            shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            color = shared.allreduce(self.rank, op=MPI.MIN)
            shared.Free()
        self.node = mpi_comm.Split(color, key=self.rank)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.cross = mpi_comm.Split(self.local_rank, key=self.rank)
        self._cross_ranks = self.cross.allgather(self.rank)
        self._ring_comm = mpi_comm.Dup()  # ring traffic never meets the user's send/recv tags
        colors = mpi_comm.allgather(color)
        self.nnodes = len(set(colors))
        sizes = {colors.count(c) for c in set(colors)}
        self.uniform = len(sizes) == 1
        p = self.local_size
        board_bytes = Board.nbytes(p)
        self.segment = Segment(self.node, board_bytes + p * _ROW_BYTES)
        words = self.segment.buf[:board_bytes].view(np.int64)
        self.board = Board(words, p, self.local_rank, self.node.allgather(self.rank))
        self.board.progress = self._progress  # NOTE [MPI progress] 4 in ring.py
        self._rows_u8 = self.segment.buf[board_bytes:board_bytes + p * _ROW_BYTES].reshape(p, _ROW_BYTES)
        self._acc = np.empty(kreduce.TILE, np.float32)
        self._private_u8 = np.empty(_ROW_BYTES, np.uint8)

    # -- structure --------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> Group:
        """Ranks with the same ``color`` form a new group, ordered by ``key`` (default: rank)."""
        if self.comm is None:
            return Group(None, self.timeout)
        return Group(self.comm.Split(int(color), self.rank if key is None else int(key)), self.timeout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.comm is not None and not self._failed:
            self._closing_barrier()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.staging_pool = None
        self.nccl_pg = None
        if self.owns_torch_world:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_torch_world = False

    def _closing_barrier(self) -> None:
        """Every rank progresses MPI until every rank got here (NOTE [MPI progress] 3 in ring.py):
        done messages and MPI's own sends still waiting on a peer complete before MPI goes."""
        reqs = [r for pending in self._ring_pending.values() for r in pending]
        self._ring_pending.clear()
        try:
            self._mpi_wait_all(reqs + [self.comm.Ibarrier()], "closing the group")
        except CollectiveTimeoutError:
            pass  # a peer died or never closed: nothing left to protect, and exit must go on

    def _progress(self) -> None:
        """One turn of MPI's progress engine (NOTE [MPI progress] 4 in ring.py)."""
        self._ring_comm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG)

    # -- execution -----------------------------------------------------------------------------
    def run(self, fn, async_op: bool):
        """Run a collective body in issue order (NOTE [collective ordering]).

        Issuing an async collective only queues it (``_state``, never held while a body runs), so
        a backward hook launching bucket k + 1 returns while bucket k is being reduced. Bodies run
        one at a time under ``_exec``: on the worker thread, or inline for a sync call issued
        when nothing async is queued or running."""
        if self._failed:
            raise CommError(f"this group is unusable after an earlier failure: {self._failed}")
        if async_op:
            with self._state:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="terrapipe-comm")
                self._pending += 1
                fut = self._pool.submit(self._guarded, fn)
            fut.add_done_callback(self._one_done)
            return Handle(fut)
        with self._state:
            inline = self._pending == 0
            if inline:
                # Free: nothing is queued, and a body releases _exec before its future completes.
                self._exec.acquire()
        if inline:
            try:
                return self._guarded(fn)
            finally:
                self._exec.release()
        return self.run(fn, True).wait()

    def _one_done(self, _fut) -> None:
        with self._state:
            self._pending -= 1

    def _guarded(self, fn, *args):
        with self._exec:
            try:
                return fn(*args)
            except CollectiveTimeoutError as e:
                self._failed = str(e)  # step counters are out of step now: no further use
                raise

    # -- signatures ----------------------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=512)
    def _signature_of(coll: str, op: int, dtype_name: str | None, size: int, shape: tuple,
                      root: int) -> np.ndarray:
        sig = np.zeros(SIG_WORDS, np.int64)
        sig[0], sig[1], sig[3] = _COLL[coll], op, root
        if dtype_name is not None:
            sig[2], sig[4], sig[5] = DTYPE_CODES[dtype_name], size, len(shape)
            dims = list(shape)[:SIG_WORDS - 6]
            sig[6:6 + len(dims)] = dims
        sig.flags.writeable = False
        return sig

    @classmethod
    def _signature(cls, coll: str, op: int = 0, buf: Buffer | None = None, root: int = -1) -> np.ndarray:
        if buf is None:
            return cls._signature_of(coll, op, None, 0, (), root)
        return cls._signature_of(coll, op, buf.dtype_name, buf.size, tuple(buf.shape), root)

    def _check(self, coll: str, step: int) -> None:
        sigs = self.board.sigs(step)
        if rows_equal(sigs) >= 0:
            self._mismatch(coll, sigs, self.board.ranks)

    def _agree(self, coll: str, op: int = 0, buf: Buffer | None = None, root: int = -1) -> None:
        if self.size == 1:
            return
        sig = self._signature(coll, op, buf, root)
        self._check(coll, self.board.barrier(self.timeout, coll, sig))
        if self.nnodes > 1:
            allsigs = np.empty((self.cross.Get_size(), SIG_WORDS), np.int64)
            self._mpi_wait(self.cross.Iallgather(sig, allsigs), coll, self.cross)
            if not (allsigs == allsigs[0]).all():
                self._mismatch(coll, allsigs, self._cross_ranks)

    @staticmethod
    def _mismatch(coll: str, sigs: np.ndarray, ranks: list[int]) -> None:
        def desc(s):
            parts = [_CODE_DTYPE.get(int(s[2]), "?"), str(tuple(int(d) for d in s[6:6 + int(s[5])]))]
            if s[0] != _COLL[coll]:
                parts.insert(0, f"in {[k for k, v in _COLL.items() if v == s[0]] or ['?']}")
            if s[1] or coll in ("allreduce", "reduce", "reduce_scatter"):
                parts.append(f"op={_CODE_OP.get(int(s[1]), s[1])}")
            if s[3] >= 0:
                parts.append(f"root={int(s[3])}")
            return " ".join(parts)

        lines = "; ".join(f"rank {r}: {desc(s)}" for r, s in zip(ranks, sigs, strict=True))
        raise CollectiveMismatchError(f"{coll}: ranks called it differently: {lines}")

    def _mpi_wait(self, req, what: str, comm=None, peer: int | None = None) -> None:
        """Poll an MPI request on ``comm`` (default: the group's) until done, or raise
        CollectiveTimeoutError after the timeout naming the ranks it waits for (``peer``: the one
        rank of ``comm`` it depends on, when there is one)."""
        if not req.Test():
            self._mpi_wait_all([req], what, comm, peer)

    def _mpi_wait_all(self, reqs: list, what: str, comm=None, peer: int | None = None) -> None:
        MPI = self._MPI
        start = time.monotonic()
        spins = 0
        while not MPI.Request.Testall(reqs):
            spins += 1
            if spins > 200:
                os.sched_yield()
                if spins % 256 == 0 and time.monotonic() - start > self.timeout:
                    for req in reqs:
                        req.Cancel()
                    comm = comm or self.comm
                    late, why = self._late_ranks(comm, peer)
                    names = ", ".join(f"rank {r}" for r in late)
                    raise CollectiveTimeoutError(
                        f"{what}: timed out after {self.timeout:g}s in MPI waiting for {names} ({why})",
                        late)

    def _late_ranks(self, comm, peer: int | None) -> tuple[list[int], str]:
        """Group ranks an MPI wait on ``comm`` is stuck on, and how they were found: ranks of this
        node that died or have not reached this collective (the board's step counters), else
        the peer the wait depends on, else every other rank of ``comm``."""
        board = self.board
        if board is not None:
            dead = [board.ranks[q] for q in range(self.local_size) if not _alive(int(board.pids[q]))]
            if dead:
                return dead, "died"
            behind = [board.ranks[q] for q in range(self.local_size) if board.steps[q] < board.step]
            if behind:
                return behind, "not arrived at this collective"
        members = self._members(comm)
        if peer is not None:
            return [members[peer]], "its peer in this transfer"
        return [r for r in members if r != self.rank], "one of these never arrived"

    def _members(self, comm) -> list[int]:
        """Group rank of each rank of ``comm`` (the group's own, its ring's, or the cross-node one)."""
        if comm is self.cross:
            return self._cross_ranks
        return list(range(self.size))

    # -- data movement on the segment -----------------------------------------------------------
    def _rows(self, dtype) -> np.ndarray:
        # The whole C-contiguous (p, row) array: kernels get it with an offset rather than a
        # column slice, whose runtime strides would keep their loops from vectorizing (3x slower).
        return self._rows_u8.view(dtype)

    def _reduce_rows(self, rows: np.ndarray, op: int, offset: int, length: int, kind: int,
                     private: bool = False) -> np.ndarray:
        """``dst[offset:offset+length]`` = op over all rows of those columns, where dst is my row
        (only when no other rank reads those columns of it) or, with ``private``, a scratch row
        of my own. Returns dst."""
        mine = self._private_u8.view(rows.dtype) if private else rows[self.local_rank]
        if kind:
            kreduce.reduce_many_16(mine, rows, op, offset, length, kind, self._acc)
        else:
            kreduce.reduce_many_native(mine, rows, op, offset, length)
        return mine

    def _chunk_ranges(self, n: int, itemsize: int):
        half = (_ROW_BYTES // itemsize) // 2
        for c0 in range(0, n, half):
            h = self._half * half
            self._half ^= 1
            yield c0, min(half, n - c0), h

    def _shm_allreduce(self, srcs: _Fused, dsts: _Fused, op: int, dtype, kind: int, ckind: int = 0,
                       root: int = -1, gate=NO_GATE) -> None:
        """Reduce-scatter within the node, allreduce across nodes per part, all-gather back.
        ``kind``: 16-bit format of the rows (0 native); ``ckind``: rows hold compressed copies of
        float32 inputs; ``root`` >= 0: only that rank copies the result out (reduce)."""
        p, me = self.local_size, self.local_rank
        rows = self._rows(dtype)
        item = np.dtype(dtype).itemsize
        for c0, length, h in self._chunk_ranges(srcs.n, item):
            gate.ready(c0 + length)
            srcs.read(c0, length, rows[me, h:h + length], ckind)
            self.board.barrier(self.timeout, "allreduce")
            parts = segments(length, p)
            lo, hi = parts[me]
            if hi > lo:
                self._reduce_rows(rows, op, h + lo, hi - lo, kind)
                mine = rows[me, h + lo:h + hi]
                if self.nnodes > 1:
                    self._cross_allreduce(mine, op, kind)
                if op == kreduce.AVG:
                    self._divide(mine, kind)
            self.board.barrier(self.timeout, "allreduce")
            if root < 0 or root == self.rank:
                for q, (a, b) in enumerate(parts):
                    if b > a:
                        dsts.write(c0 + a, rows[q, h + a:h + b], ckind)
            gate.wrote(c0 + length)

    def _divide(self, arr: np.ndarray, kind: int) -> None:
        if kind:
            kreduce.divide_16(arr, self.size, 0, arr.shape[0], kind)
        elif arr.dtype.kind == "f":
            kreduce.divide_float(arr, self.size, 0, arr.shape[0])
        else:
            kreduce.divide_int(arr, self.size, 0, arr.shape[0])

    def _cross_allreduce(self, part: np.ndarray, op: int, kind: int) -> None:
        # self.cross carries nothing else, so the ring may use it too.
        self._mpi_allreduce_array(self.cross, self.cross, part, op, kind, "allreduce across nodes")

    def _use_mpi(self) -> bool:
        return self.force_mpi or self.nnodes > 1 or not self.uniform

    # -- collectives (bodies; the public functions in collectives.py wrap them) ------------------
    def allreduce_views(self, srcs: list[np.ndarray], dsts: list[np.ndarray], op: int, kind: int,
                        ckind: int = 0, coll: str = "allreduce", sig_buf: Buffer | None = None,
                        gate=NO_GATE) -> None:
        """Allreduce the concatenation of ``srcs`` into that of ``dsts`` (1-D host arrays).

        ``gate`` (optional; NOTE [staging gate]): ``gate.ready(upto)`` is called before any source
        element at fused index < ``upto`` is read, and ``gate.wrote(upto)`` once the results
        before ``upto`` are final in ``dsts``, so copies from and to a device can overlap the
        reduction."""
        if self.size == 1:
            n = sum(s.shape[0] for s in srcs)
            gate.ready(n)
            for src, dst in zip(srcs, dsts, strict=True):
                if ckind:  # the same 16-bit rounding as the multi-rank path
                    tmp = np.empty(src.shape[0], np.uint16)
                    compress(src, tmp, ckind)
                    decompress(tmp, dst, ckind)
                elif dst is not src:
                    dst[...] = src
            gate.wrote(n)
            return
        fs, fd = _Fused(srcs), _Fused(dsts)
        rows_dtype = np.uint16 if (kind or ckind) else srcs[0].dtype
        rkind = ckind or kind
        if (fs.n * np.dtype(rows_dtype).itemsize <= _SMALL_BYTES and self.nnodes == 1
                and not self.force_mpi):
            gate.ready(fs.n)
            self._small_allreduce(fs, fd, op, rows_dtype, rkind, coll, sig_buf)
            gate.wrote(fs.n)
            return
        self._agree(coll, op, sig_buf)
        self._allreduce_agreed(fs, fd, op, rows_dtype, rkind, ckind, gate=gate)

    def _allreduce_agreed(self, fs: _Fused, fd: _Fused, op: int, dtype, kind: int, ckind: int = 0,
                          root: int = -1, gate=NO_GATE) -> None:
        """The data movement of an allreduce (or reduce to ``root``) whose signature the ranks
        already agreed on. Flat over MPI (the ring when large) when nodes differ in rank count,
        when MPI is forced, or for large messages on one node, where the ring's single copy
        beats shared memory's copy-in/copy-out (benchmarks.allreduce); otherwise shared memory,
        hierarchical across nodes, which is also taken for large gated (device-staged) messages:
        its chunks let device copies overlap the reduction (NOTE [staging gate])."""
        large = fs.n * np.dtype(dtype).itemsize >= _RING_BYTES and gate is NO_GATE
        if not self.uniform or (self.nnodes == 1 and (self.force_mpi or (large and not self.force_shm))):
            gate.ready(fs.n)
            self._mpi_allreduce(fs, fd, op, dtype, kind, ckind, root)
            gate.wrote(fs.n)
        else:
            self._shm_allreduce(fs, fd, op, dtype, kind, ckind, root, gate)

    def _small_allreduce(self, fs: _Fused, fd: _Fused, op: int, dtype, kind: int, coll: str,
                         sig_buf: Buffer | None) -> None:
        src = fs.views[0] if len(fs.views) == 1 else np.empty(fs.n, fs.views[0].dtype)
        dst = fd.views[0] if len(fd.views) == 1 else np.empty(fd.n, fd.views[0].dtype)
        if src is not fs.views[0]:
            fs.read(0, fs.n, src)
        self._oneshot(src, dst, np.dtype(dtype), op, kind, coll, self._signature(coll, op, sig_buf))
        if dst is not fd.views[0]:
            fd.write(0, dst)

    def allreduce_small(self, x: np.ndarray, op: int, coll: str = "allreduce", ckind: int = 0,
                        sig_shape: tuple | None = None) -> bool:
        """The latency path of a sync, in-place allreduce of ``x``: True when done here, False
        when ``x`` does not qualify (the caller takes the general path). Qualifies: a
        C-contiguous array of a reducible dtype, at most 64 KiB as exchanged, on a one-node
        shared-memory group with no async collective pending. ``ckind``: float32 sent as 16-bit;
        ``sig_shape``: the shape the signature names (default ``x.shape``). Same signature and
        step accounting as the general small path, so ranks may mix the two."""
        key = (x.dtype, x.shape, op, coll, ckind)
        entry = self._small_entries.get(key)
        if entry is None:
            if len(self._small_entries) > 1024:
                self._small_entries.clear()
            entry = self._small_entries[key] = self._small_entry(
                x.dtype, x.size, op, coll, ckind, x.shape if sig_shape is None else sig_shape)
        if not entry or self._pending or not x.flags.c_contiguous:
            return False
        sig, dtype, kind = entry
        flat = x.reshape(-1)
        if kind and not ckind:
            flat = flat.view(np.uint16)
        with self._state:
            if self._pending:
                return False
            self._exec.acquire()
        try:
            if self._failed:
                raise CommError(f"this group is unusable after an earlier failure: {self._failed}")
            self._guarded(self._oneshot, flat, flat, dtype, op, kind, coll, sig)
        finally:
            self._exec.release()
        return True

    def _small_entry(self, dtype: np.dtype, size: int, op: int, coll: str, ckind: int, shape: tuple):
        name = dtype.name
        kind = ckind or (F16 if name == "float16" else 0)
        rows_dtype = np.dtype(np.uint16) if kind else dtype
        if (self.segment is None or self.size == 1 or self.nnodes > 1 or self.force_mpi
                or name not in ("float32", "float64", "int32", "int64", "float16")
                or (ckind and name != "float32") or size * rows_dtype.itemsize > _SMALL_BYTES):
            return False
        return self._signature_of(coll, op, name, size, tuple(shape), -1), rows_dtype, kind

    def _oneshot(self, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, coll: str,
                 sig: np.ndarray) -> None:
        """A small allreduce in one compiled call (kernels/oneshot.py): data and signature are
        published together and every rank reduces the whole message into a private scratch
        row, never into its shared row, which the others are still reading. ``src``/``dst``:
        1-D, ``dtype`` (the rows' dtype), or float32 over uint16 rows of 16-bit format ``kind``
        (sent rounded)."""
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = (self._rows_u8.view(dtype), self._private_u8.view(dtype))
        rows, scratch = views
        h = self._half * (rows.shape[1] // 2)
        self._half ^= 1
        board = self.board
        step, col = board.reserve()
        divisor = self.size if op == kreduce.AVG else 1
        state = oneshot.oneshot_allreduce(src, dst, rows, h, self.local_rank, board.table, col, sig, step,
                                          op, divisor, kind, scratch, self._acc, _ONESHOT_SPINS)
        if state == oneshot.WAITING:
            board.wait(step, self.timeout, coll)
            state = rows_equal(board.sigs(step))
            if state < 0:
                oneshot.finish(dst, rows, h, op, divisor, kind, scratch, self._acc)
        if state >= 0:
            self._mismatch(coll, board.sigs(step), board.ranks)

    def _mpi_allreduce(self, fs: _Fused, fd: _Fused, op: int, dtype, kind: int, ckind: int,
                       root: int = -1) -> None:
        out = fd.views[0] if len(fd.views) == 1 else None
        # Reduce straight in the destination when it is one flat array this rank may overwrite.
        direct = (out is not None and not ckind and out.dtype == np.dtype(dtype) and out.flags.c_contiguous
                  and (root < 0 or root == self.rank))
        if direct:
            buf = out
            if not (len(fs.views) == 1 and fs.views[0].ctypes.data == out.ctypes.data):
                fs.read(0, fs.n, buf)
        else:
            buf = np.empty(fs.n, dtype)
            fs.read(0, fs.n, buf, ckind)
        self._mpi_allreduce_array(self.comm, self._ring_comm, buf, op, kind, "allreduce")
        if op == kreduce.AVG:
            self._divide(buf, kind)
        if not direct and (root < 0 or root == self.rank):
            fd.write(0, buf, ckind)

    def _mpi_allreduce_array(self, comm, ring_comm, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """In place over ``comm`` (AVG sums): the chunked ring for large buffers (NOTE [ring
        schedule]); below that MPI's own allreduce, or for 16-bit formats an allgather reduced
        here with float32 accumulation."""
        if buf.nbytes >= _RING_BYTES:
            ring_allreduce(ring_comm, buf, op, kind,
                           lambda req, w, peer: self._mpi_wait(req, f"{what}: {w}", comm, peer),
                           self._ring_pending.setdefault(id(ring_comm), []))
        elif kind:
            gathered = np.empty((comm.Get_size(), buf.shape[0]), buf.dtype)
            self._mpi_wait(comm.Iallgather(buf, gathered), what, comm)
            kreduce.reduce_many_16(buf, gathered, op, 0, buf.shape[0], kind, self._acc)
        else:
            MPI = self._MPI
            mop = {kreduce.SUM: MPI.SUM, kreduce.AVG: MPI.SUM, kreduce.PROD: MPI.PROD,
                   kreduce.MIN: MPI.MIN, kreduce.MAX: MPI.MAX}[op]
            self._mpi_wait(comm.Iallreduce(MPI.IN_PLACE, buf, mop), what, comm)

    # -- collective entry points: the one-rank shortcut and the signature agreement, once; the
    # data movement is in the _bodies below (TorchGroup overrides only those) -----------------
    def broadcast_flat(self, buf: Buffer, root: int) -> None:
        if self.size > 1:
            self._agree("broadcast", 0, buf, root)
            self._broadcast(buf, root)

    def allgather_flat(self, buf: Buffer, out: np.ndarray, root: int = -1) -> None:
        """out: (size, n) flat rows; ``root`` >= 0 makes it a gather (only root fills out)."""
        if self.size == 1:
            out[0] = buf.flat
            return
        coll = "gather" if root >= 0 else "allgather"
        self._agree(coll, 0, buf, root)
        self._allgather(buf, out, root, coll)

    def scatter_flat(self, full: Buffer, out: np.ndarray, root: int) -> None:
        """full: (size * n) on every rank (read on root only); out: this rank's n elements."""
        if self.size == 1:
            out[...] = full.flat[:out.shape[0]]
            return
        self._agree("scatter", 0, full, root)
        self._scatter(full, out, root)

    def reduce_scatter_flat(self, buf: Buffer, out: np.ndarray, op: int) -> None:
        """out: this rank's part (np.array_split over ranks) of the reduced flat buffer."""
        if self.size == 1:
            out[...] = buf.flat
            return
        self._agree("reduce_scatter", op, buf)
        self._reduce_scatter(buf, out, op)

    def reduce_flat(self, buf: Buffer, op: int, root: int) -> None:
        if self.size > 1:
            self._agree("reduce", op, buf, root)
            self._reduce(buf, op, root)

    def barrier(self) -> None:
        if self.size > 1:
            self._agree("barrier")
            self._barrier()

    # -- data movement of agreed collectives (shared memory on a node, MPI between nodes) -------
    def _broadcast(self, buf: Buffer, root: int) -> None:
        if self._use_mpi():
            self._mpi_wait(self.comm.Ibcast(buf.flat, root=root), "broadcast")
            return
        rows = self._rows(buf.flat.dtype)
        lroot = self.board.ranks.index(root)
        for c0, length, h in self._chunk_ranges(buf.size, buf.flat.itemsize):
            if self.rank == root:
                rows[lroot, h:h + length] = buf.flat[c0:c0 + length]
            self.board.barrier(self.timeout, "broadcast")
            if self.rank != root:
                buf.flat[c0:c0 + length] = rows[lroot, h:h + length]

    def _allgather(self, buf: Buffer, out: np.ndarray, root: int, coll: str) -> None:
        if self._use_mpi():
            if root >= 0:
                recv = out if self.rank == root else None
                self._mpi_wait(self.comm.Igather(buf.flat, recv, root=root), coll)
            else:
                self._mpi_wait(self.comm.Iallgather(buf.flat, out), coll)
            return
        rows = self._rows(buf.flat.dtype)
        me = self.local_rank
        for c0, length, h in self._chunk_ranges(buf.size, buf.flat.itemsize):
            rows[me, h:h + length] = buf.flat[c0:c0 + length]
            self.board.barrier(self.timeout, coll)
            if root < 0 or root == self.rank:
                for q in range(self.local_size):
                    out[self.board.ranks[q], c0:c0 + length] = rows[q, h:h + length]

    def _scatter(self, full: Buffer, out: np.ndarray, root: int) -> None:
        n = out.shape[0]
        if self._use_mpi():
            self._mpi_wait(self.comm.Iscatter(full.flat if self.rank == root else None, out, root=root),
                           "scatter")
            return
        rows = self._rows(out.dtype)
        me = self.local_rank
        for c0, length, h in self._chunk_ranges(n, out.itemsize):
            if self.rank == root:
                for q in range(self.local_size):
                    r = self.board.ranks[q]
                    rows[q, h:h + length] = full.flat[r * n + c0:r * n + c0 + length]
            self.board.barrier(self.timeout, "scatter")
            out[c0:c0 + length] = rows[me, h:h + length]

    def _reduce_scatter(self, buf: Buffer, out: np.ndarray, op: int) -> None:
        n = buf.size
        parts = segments(n, self.size)
        if self._use_mpi() or buf.kind:
            # Through a full allreduce: simple, and correct for every dtype and topology.
            tmp = np.empty(n, buf.flat.dtype)
            self._allreduce_agreed(_Fused([buf.flat]), _Fused([tmp]), op, buf.flat.dtype, buf.kind)
            lo, hi = parts[self.rank]
            out[...] = tmp[lo:hi]
            return
        rows = self._rows(buf.flat.dtype)
        me = self.local_rank
        lo_me, hi_me = parts[self.rank]
        for c0, length, h in self._chunk_ranges(n, buf.flat.itemsize):
            rows[me, h:h + length] = buf.flat[c0:c0 + length]
            self.board.barrier(self.timeout, "reduce_scatter")
            a, b = max(lo_me, c0), min(hi_me, c0 + length)
            if b > a:
                self._reduce_rows(rows, op, h + a - c0, b - a, 0)
                dst = out[a - lo_me:b - lo_me]
                dst[...] = rows[me, h + a - c0:h + b - c0]
                if op == kreduce.AVG:
                    self._divide(dst, 0)

    def _reduce(self, buf: Buffer, op: int, root: int) -> None:
        tmp = buf.flat if self.rank == root else np.empty_like(buf.flat)
        self._allreduce_agreed(_Fused([buf.flat]), _Fused([tmp]), op, buf.flat.dtype, buf.kind, root=root)

    def _barrier(self) -> None:
        if self.nnodes > 1:  # on one node the agreement was the barrier
            self._mpi_wait(self.comm.Ibarrier(), "barrier")

    def send(self, buf: Buffer, dest: int, tag: int) -> None:
        if self.comm is None:
            raise CommError("send: a lone process has no peer")
        self._mpi_wait(self.comm.Isend(buf.flat, dest=dest, tag=tag), f"send to rank {dest}")

    def recv(self, buf: Buffer, source: int, tag: int) -> None:
        if self.comm is None:
            raise CommError("recv: a lone process has no peer")
        self._mpi_wait(self.comm.Irecv(buf.flat, source=source, tag=tag), f"recv from rank {source}")
