"""Process groups: topology, the order collectives run in, signature agreement, and the one place
that picks the transport (comm/transport.py) each collective's data moves through.

NOTE [collective ordering]
    1. Every rank of a group issues its collectives in the same order, sync and async alike.
    2. Async calls run on the group's single worker thread in submission order; a sync call runs
       inline when nothing async is queued or running, else it queues behind them.
    3. Issuing never waits for a running collective: the queue's state has its own lock
       (``_state``), distinct from the one a running body holds (``_exec``).
    4. Every collective starts with a signature agreement: all ranks exchange (collective, op,
       dtype, shape, root) over the group's control transport and compare before any data moves,
       so a mismatch raises CollectiveMismatchError on every rank. Small allreduces on one node
       publish signature and data together (ShmTransport.oneshot).

NOTE [transport selection]
    ``Group._route`` and the predicates ``allreduce_views`` asks before it (``_shared_fits``,
    ``_single_copy_fits``, ``_oneshot_fits``) are the only places that choose; the crossovers are
    measured with ``python -m benchmarks.allreduce --algorithms -n 2`` / ``-n 4``.
    1. CUDA tensors go to NCCL before any of this, when the group can use it (comm/nccl.py).
    2. Under torchrun every collective goes over Gloo.
    3. Under MPI, flat over MPI when MPI is forced or nodes differ in rank count.
    4. Across nodes: allreduce is hierarchical (shm on the node, MPI per part between nodes),
       the other collectives go over MPI.
    5. On one node, an allreduce of at most ``ShmTransport.small_bytes`` is the one-shot: one
       barrier, signature and data together, each rank reading p x n bytes, kept within 4 MiB
       (2 MiB messages at 2 ranks, 1 MiB at 4: ``shm.ONESHOT_READ_BYTES``), where it beats
       MPICH's Allreduce here (1.2-2x).
    6. An allreduce in place on a piece of a shared array (``Group.shared_array``; NOTE
       [shared arrays] in shm.py) takes the shared path from ``shm.SHARED_MIN_BYTES`` (512
       KiB), before the one-shot, sync (the latency path declines it) or async alike.
    7. On one node, an allreduce of private host memory from ``cma.MIN_BYTES`` (2 MiB) goes
       single-copy where the kernel lets the node's ranks read each other's memory (NOTE
       [single-copy allreduce] in cma.py): each rank reads its part of the peers' sources and
       then their reduced parts, nothing through the segment. Interleaved, float32 sum in place
       (``benchmarks.allreduce --algorithms``), at 2 ranks: 2 MiB 287 us vs the one-shot's 335,
       4 MiB 467 vs the ring's 564, 64 MiB 10.8 ms vs 12.0 (the chunked segment: 17.9); at 4
       ranks on 2 cores it loses to the one-shot at 1 MiB (608 vs 420 us), ties the segment at
       2 MiB and leads from 4 MiB (1.7 vs 2.2 ms; 64 MiB 30.5 vs 33.8). Device-staged messages
       keep the segment (their chunks overlap the copies); the signature marks the path, so
       ranks that chose differently get CollectiveMismatchError, not a hang.
    8. Larger ones that do not go single-copy go through our ring over MPI when every local rank
       has a core of its own: one copy fewer than the segment (at 2 ranks here 1.3-1.5x the chunked
       segment from 1 MiB, 2.4x MPICH from 32 MiB). When ranks outnumber the node's cores, each
       ring step waits for a neighbour to be scheduled (at 4 ranks on 2 cores the ring took 3x the
       segment's time at 1 MiB), so the chunked segment carries them, as it does device-staged
       allreduces (their chunks overlap the copies, NOTE [staging gate] in shm.py) and everything
       under ``TERRAPIPE_COMM_BACKEND=shm``.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import settings, timeline
from ..kernels import reduce as kreduce
from ..kernels.floats import F16, compress, decompress
from . import cma
from .buffers import DTYPE_CODES, Buffer
from .errors import CollectiveMismatchError, CollectiveTimeoutError, CommError
from .shm import SHARED_MIN_BYTES, SIG_WORDS, ShmTransport
from .transport import NO_GATE, Fused, Transport

__all__ = ["Group", "Handle", "NO_GATE", "forced_backend", "force_backend"]

_backend_choice: str | None = None  # comm.init(backend=...) when it named one


def force_backend(backend: str | None) -> None:
    """Make ``backend`` ("mpi", "shm", "torch"; None: back to the setting) what every group made
    from now on in this process routes by, over ``TERRAPIPE_COMM_BACKEND`` (comm.init's
    ``backend=``)."""
    global _backend_choice
    _backend_choice = backend


def forced_backend() -> str:
    """The backend this process's groups route by: what :func:`terrapipe.comm.init` was asked
    for when it named one, else ``TERRAPIPE_COMM_BACKEND`` ("auto", "mpi", "shm" or "torch")."""
    return _backend_choice or settings.get("TERRAPIPE_COMM_BACKEND")

_COLL = {"allreduce": 1, "broadcast": 2, "allgather": 3, "reduce_scatter": 4, "reduce": 5,
         "gather": 6, "scatter": 7, "barrier": 8, "jit_allreduce": 9,
         "nccl_allreduce": 10, "nccl_broadcast": 11, "nccl_allgather": 12, "shared_array": 13}
# Signature words: 0 collective, 1 op, 2 dtype, 3 root, 4 elements, 5 dims, then the dims up to
# _SHARED_WORD, where a shared array's (segment, byte offset) go (NOTE [shared arrays] 2 in shm.py).
_SHARED_WORD = SIG_WORDS - 2
_SINGLE_COPY = -1  # at _SHARED_WORD: private memory, read by the peers (NOTE [single-copy allreduce])
_CODE_DTYPE = {v: k for k, v in DTYPE_CODES.items()}
_CODE_OP = {v: k for k, v in kreduce.OPS.items()}


class Handle:
    """An outstanding async collective. ``wait()`` returns its result (or raises its error)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None):
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


class Group:
    """A communicator: ``rank``, ``size``, ``local_rank``, ``local_size`` and the collectives.

    Built by :func:`terrapipe.comm.init` (the world) and :meth:`split`: ``Group(mpi_comm)`` over
    an mpi4py communicator (None: a lone process, every collective local), or
    :meth:`over_torch` over torch.distributed. ``timeout``: seconds a collective waits for the
    other ranks. ``node_size``: group ranks k per node (emulates several nodes on one machine).
    """

    def __init__(self, mpi_comm=None, timeout: float = 300.0, node_size: int | None = None) -> None:
        self._init_execution(timeout)
        self.comm = mpi_comm
        if mpi_comm is None:
            self.rank, self.size, self.local_rank, self.local_size, self.nnodes = 0, 1, 0, 1, 1
            self.whole_world = True
            return
        from mpi4py import MPI

        from .mpi import MpiTransport

        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.whole_world = self.size == MPI.COMM_WORLD.Get_size()
        if node_size:
            color = self.rank // node_size
        else:
            shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            color = shared.allreduce(self.rank, op=MPI.MIN)
            shared.Free()
        node = mpi_comm.Split(color, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        # Cores this node's ranks may run on: the union of their affinity masks (ranks bound
        # to one core each still count every core).
        cores = set().union(*node.allgather(sorted(os.sched_getaffinity(0))))
        self.oversubscribed = self.local_size > len(cores)
        cross = mpi_comm.Split(self.local_rank, key=self.rank)
        colors = mpi_comm.allgather(color)
        self.nnodes = len(set(colors))
        self.uniform = len({colors.count(c) for c in set(colors)}) == 1
        late = lambda: self.shm.late() if self.shm is not None else None  # noqa: E731
        self.mpi = MpiTransport(mpi_comm, list(range(self.size)), self.timeout, late)
        cross_mpi = None
        if self.nnodes > 1:
            cross_mpi = MpiTransport(cross, cross.allgather(self.rank), self.timeout, late)
        self._cross = cross_mpi
        self.shm = ShmTransport(node, self.rank, self.size, node.allgather(self.rank), self.timeout,
                                cross_mpi)
        self.shm.board.progress = self.mpi.progress  # NOTE [MPI progress] 4 in ring.py
        if cross_mpi is None:
            cross.Free()
        self.control = self.shm

    @classmethod
    def over_torch(cls, timeout: float = 300.0, pg=None) -> Group:
        """A group over torch.distributed (Gloo): the default group (initialised here from the
        environment if nothing did), or the process group ``pg``."""
        from .. import launch_env
        from .gloo import GlooTransport

        return cls._over_gloo(GlooTransport(timeout, pg), timeout, pg is None and launch_env.local_size())

    @classmethod
    def over_store(cls, store, prefix: str, rank: int, size: int, timeout: float = 300.0) -> Group:
        """A group of ``size`` processes on one node, over shared memory, set up through a
        key-value store (torch c10d's ``Store``: what a ``torch.distributed`` backend is given)
        instead of MPI. ``prefix``: a key space unique to this group. Every rank must be on this
        node (ValueError naming the ranks that are not); ranks on several nodes need MPI or Gloo
        between them."""
        from .store import StoreComm, node_of

        self = cls.__new__(cls)
        self._init_execution(timeout)
        comm = StoreComm(store, prefix, rank, size, timeout)
        nodes = comm.allgather(node_of())
        away = [r for r, n in enumerate(nodes) if n != nodes[rank]]
        if away:
            raise ValueError(f"over_store: ranks {away} are on another node than rank {rank}; "
                             f"shared memory reaches one node only")
        self.comm = None
        self.rank, self.size = int(rank), int(size)
        self.local_rank, self.local_size, self.nnodes = self.rank, self.size, 1
        self.whole_world = False
        if self.size > 1:
            cores = set().union(*map(set, comm.allgather(sorted(os.sched_getaffinity(0)))))
            self.oversubscribed = self.size > len(cores)
            self.shm = ShmTransport(comm, self.rank, self.size, list(range(self.size)), self.timeout)
            self.control = self.shm
        return self

    @classmethod
    def _over_gloo(cls, gloo, timeout: float, local_size: int | None) -> Group:
        self = cls.__new__(cls)
        self._init_execution(timeout)
        self.comm = None
        self.gloo = self.control = gloo
        self.rank, self.size = gloo.rank, gloo.size
        self.local_size = local_size or self.size
        self.local_rank = self.rank % self.local_size
        self.nnodes = max(1, self.size // self.local_size)
        self.whole_world = gloo.pg is None
        return self

    def _init_execution(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self._state = threading.Lock()  # _pending and the pool (NOTE [collective ordering] 3)
        self._exec = threading.RLock()  # held while a collective body runs
        self._pool: ThreadPoolExecutor | None = None
        self._pending = 0
        self._failed: str | None = None
        self.shm: ShmTransport | None = None
        self.mpi = self.gloo = self._cross = self.control = None
        self.uniform = True
        self.oversubscribed = False
        self.staging_pool = None  # comm/staging.py: pinned buffers and side streams, made on demand
        self.nccl = None  # comm/nccl.py: None (undecided), False (staged) or its NcclTransport
        self._small_entries: dict[tuple, tuple | None] = {}  # allreduce_small's plans
        forced = forced_backend()
        self.force_mpi, self.force_shm = forced == "mpi", forced == "shm"

    @property
    def transport(self) -> Transport | None:
        """The transport signatures are agreed over (None for a lone process)."""
        return self.control

    # -- structure --------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None, timeout: float | None = None) -> Group:
        """Ranks with the same ``color`` form a new group, ordered by ``key`` (default: rank),
        whose collectives wait ``timeout`` seconds for late ranks (default: this group's).
        Collective over this group."""
        key = self.rank if key is None else int(key)
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"split: timeout must be positive, got {timeout}")
        if self.gloo is not None:
            return Group._over_gloo(self.gloo.split(int(color), key), timeout, None)
        if self.comm is None:
            return Group(None, timeout)
        return Group(self.comm.Split(int(color), key), timeout)

    def exchange_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable, small), in rank order; outside the collective order,
        for set-up between collectives (comm/nccl.py)."""
        if self.comm is not None:
            return self.comm.allgather(obj)
        if self.gloo is not None:
            import torch.distributed as dist

            out = [None] * self.size
            dist.all_gather_object(out, obj, group=self.gloo.pg)
            return out
        return [obj]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        healthy = not self._failed
        for t in (self._cross, self.mpi, self.gloo):
            if t is not None and (healthy or t is self.gloo):
                t.close()
        if self.shm is not None:
            self.shm.close(healthy)  # frees its node communicator
        self.shm = self.mpi = self._cross = self.gloo = self.control = None
        self.staging_pool = None
        if self.nccl:
            self.nccl.close()
        self.nccl = None

    def tune(self, ring_bytes: int | None = None, ring_chunk_bytes: int | None = None) -> None:
        """Set the MPI ring's threshold (allreduces of at least ``ring_bytes`` take our ring, smaller
        ones MPI's own) and message size for every collective issued after this call, which
        runs in issue order (NOTE [collective ordering]). Collective: every rank sets the same
        values at the same point (the autotuner does, from scores all ranks share)."""
        for name, v in (("ring_bytes", ring_bytes), ("ring_chunk_bytes", ring_chunk_bytes)):
            if v is not None and int(v) <= 0:
                raise ValueError(f"tune: {name} must be positive, got {v}")

        def body():
            for t in (self.mpi, self._cross):
                if t is not None:
                    t.tune(ring_bytes, ring_chunk_bytes)

        self.run(body, False)

    def uses_ring(self) -> bool:
        """Whether this group has an MPI transport whose ring :meth:`tune` would change."""
        return self.mpi is not None or self._cross is not None

    def tuning(self) -> dict[str, int]:
        """The ring's threshold and message size in use (the defaults where there is no MPI)."""
        from .mpi import RING_BYTES
        from .ring import CHUNK_BYTES

        t = self.mpi or self._cross
        return {"ring_bytes": t.ring_bytes if t else RING_BYTES,
                "ring_chunk_bytes": t.chunk_bytes if t else CHUNK_BYTES}

    # -- execution -----------------------------------------------------------------------------
    def run(self, fn, async_op: bool, label: tuple[str, int] | None = None):
        """Run a collective body in issue order (NOTE [collective ordering]). ``label``: (name,
        bytes) for the timeline, which records the body as a span and an async call from issue
        to completion."""
        if self._failed:
            raise CommError(f"this group is unusable after an earlier failure: {self._failed}")
        if label is not None and timeline.enabled():
            fn = _traced(fn, label)
        if async_op:
            with self._state:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="terrapipe-comm")
                self._pending += 1
                fut = self._pool.submit(self._guarded, fn)
            fut.add_done_callback(self._one_done)
            if label is not None and timeline.enabled():
                _trace_handle(fut, label)
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
            dims = list(shape)[:_SHARED_WORD - 6]
            sig[6:6 + len(dims)] = dims
        sig.flags.writeable = False
        return sig

    @classmethod
    def _signature(cls, coll: str, op: int = 0, buf: Buffer | None = None, root: int = -1) -> np.ndarray:
        if buf is None:
            return cls._signature_of(coll, op, None, 0, (), root)
        return cls._signature_of(coll, op, buf.dtype_name, buf.size, tuple(buf.shape), root)

    def agree(self, coll: str, op: int = 0, buf=None, root: int = -1) -> None:
        """NOTE [collective ordering] 4: raise CollectiveMismatchError on every rank unless all
        called ``coll`` alike. ``buf``: anything with dtype_name, size and shape."""
        if self.size == 1:
            return
        sig = self._signature(coll, op, buf, root)
        with timeline.span("comm", "agreement"):
            self.control.agree(coll, sig, functools.partial(self._mismatch, coll))

    @staticmethod
    def _mismatch(coll: str, sigs: np.ndarray, ranks: list[int]) -> None:
        if (sigs == sigs[0]).all():
            return

        def desc(s):
            parts = [_CODE_DTYPE.get(int(s[2]), "?"), str(tuple(int(d) for d in s[6:6 + int(s[5])]))]
            if s[0] != _COLL[coll]:
                parts.insert(0, f"in {[k for k, v in _COLL.items() if v == s[0]] or ['?']}")
            if s[1] or coll in ("allreduce", "reduce", "reduce_scatter"):
                parts.append(f"op={_CODE_OP.get(int(s[1]), s[1])}")
            if s[3] >= 0:
                parts.append(f"root={int(s[3])}")
            if s[_SHARED_WORD] == _SINGLE_COPY:
                parts.append("in private memory (single copy)")
            elif s[_SHARED_WORD]:
                parts.append(f"in shared array {int(s[_SHARED_WORD])} at byte {int(s[_SHARED_WORD + 1])}")
            elif coll in ("allreduce", "jit_allreduce") and (sigs[:, _SHARED_WORD] > 0).any():
                parts.append("in private memory")
            elif coll in ("allreduce", "jit_allreduce") and (sigs[:, _SHARED_WORD] == _SINGLE_COPY).any():
                parts.append("by another path")
            return " ".join(parts)

        lines = "; ".join(f"rank {r}: {desc(s)}" for r, s in zip(ranks, sigs, strict=True))
        raise CollectiveMismatchError(f"{coll}: ranks called it differently: {lines}")

    # -- NOTE [transport selection] ----------------------------------------------------------------
    def _route(self, coll: str, gate=NO_GATE) -> Transport:
        if self.gloo is not None:
            return self.gloo
        if self.mpi is None:
            return self.shm  # a one-node group set up without MPI (over_store)
        if self.force_mpi or not self.uniform:
            return self.mpi
        if coll == "allreduce":
            if self.nnodes == 1 and not self.oversubscribed and gate is NO_GATE and not self.force_shm:
                return self.mpi
            return self.shm
        return self.mpi if self.nnodes > 1 else self.shm

    def _oneshot_fits(self, nbytes: int) -> bool:
        return (self.shm is not None and self.nnodes == 1 and not self.force_mpi
                and nbytes <= self.shm.small_bytes)

    def _shared_fits(self, nbytes: int) -> bool:
        """Whether an allreduce of ``nbytes`` in a shared array takes the shared path rather than
        the one-shot (NOTE [transport selection] 6)."""
        return nbytes >= SHARED_MIN_BYTES

    # -- allreduce -----------------------------------------------------------------------------
    def allreduce_views(self, srcs: list[np.ndarray], dsts: list[np.ndarray], op: int, kind: int,
                        ckind: int = 0, coll: str = "allreduce", sig_buf=None, gate=NO_GATE) -> None:
        """Allreduce the concatenation of ``srcs`` into that of ``dsts`` (1-D host arrays).

        ``gate`` (NOTE [staging gate] in shm.py): ``gate.ready(upto)`` is called before any
        source element at fused index < ``upto`` is read, and ``gate.wrote(upto)`` once the
        results before ``upto`` are final in ``dsts``, so copies from and to a device can overlap
        the reduction."""
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
        fs, fd = Fused(srcs), Fused(dsts)
        rows_dtype = np.dtype(np.uint16 if (kind or ckind) else srcs[0].dtype)
        rkind = ckind or kind
        nbytes = fs.n * rows_dtype.itemsize
        where = self._shared_location(fs, fd, ckind, gate) if self._shared_fits(nbytes) else None
        if where is None and gate is NO_GATE and self._single_copy_fits(nbytes, rkind):
            self._allreduce_single_copy(fs, fd, op, rows_dtype, coll, sig_buf)
            return
        if where is None and self._oneshot_fits(nbytes):
            gate.ready(fs.n)
            src = fs.only()
            dst = fd.only()
            if src is None:
                src = np.empty(fs.n, fs.views[0].dtype)
                fs.read(0, fs.n, src)
            if dst is None:
                dst = np.empty(fd.n, fd.views[0].dtype)
            with timeline.span("comm", "one-shot (agreement + reduce)"):
                self.shm.oneshot(src, dst, rows_dtype, op, rkind, coll, self._signature(coll, op, sig_buf),
                                 functools.partial(self._mismatch, coll))
            if dst is not fd.only():
                fd.write(0, dst)
            gate.wrote(fs.n)
            return
        if where is not None:  # NOTE [shared arrays] in shm.py
            sig = self._signature(coll, op, sig_buf).copy()
            sig[_SHARED_WORD:_SHARED_WORD + 2] = where
            with timeline.span("comm", "agreement"):
                self.control.agree(coll, sig, functools.partial(self._mismatch, coll))
            self.shm.allreduce_shared(where[0], where[1], fs.n, op, rows_dtype, rkind)
            return
        self.agree(coll, op, sig_buf)
        self._route("allreduce", gate).allreduce(fs, fd, op, rows_dtype, rkind, ckind, gate=gate)

    def _single_copy_fits(self, nbytes: int, kind: int, min_bytes: int = cma.MIN_BYTES) -> bool:
        """Whether a host allreduce of ``nbytes`` not in a shared array goes single-copy (NOTE
        [transport selection] 7): the same answer on every rank that calls it alike. (Device-staged
        ones keep the segment, whose chunks overlap the copies: NOTE [staging gate] in shm.py.)"""
        return (kind == 0 and nbytes >= min_bytes and self.shm is not None and self.control is self.shm
                and self.shm.peers is not None and self.nnodes == 1 and not self.force_mpi)

    def _allreduce_single_copy(self, fs: Fused, fd: Fused, op: int, dtype: np.dtype, coll: str,
                               sig_buf) -> None:
        """NOTE [single-copy allreduce] in cma.py; a fused message (several arrays) goes through
        one contiguous private copy. Its signature says so, so a rank that chose another path
        (a device-staged message beside host ones) gets CollectiveMismatchError, not a hang."""
        src, dst = fs.only(), fd.only()
        if (src is None or dst is None or not (src.flags.c_contiguous and dst.flags.c_contiguous)
                or (dst.ctypes.data != src.ctypes.data and np.may_share_memory(src, dst))):
            # several arrays, or an output overlapping the input elsewhere than in place
            dst = src = self.shm.staging(fs.n * dtype.itemsize).view(dtype)
            fs.read(0, fs.n, src)
        sig = self._signature(coll, op, sig_buf).copy()
        sig[_SHARED_WORD] = _SINGLE_COPY
        self.shm.post_single_copy(src, dst)
        with timeline.span("comm", "agreement"):
            self.control.agree(coll, sig, functools.partial(self._mismatch, coll))
        self.shm.allreduce_single_copy(src, dst, op)
        if dst is not fd.only():
            fd.write(0, dst)

    def _shared_location(self, fs: Fused, fd: Fused, ckind: int, gate) -> tuple[int, int] | None:
        """(segment, byte offset) when this allreduce takes the in-place path through a shared
        array (NOTE [shared arrays] 2 in shm.py), else None."""
        if self.shm is None or ckind or gate is not NO_GATE:  # Gloo groups have no shm
            return None
        src, dst = fs.only(), fd.only()
        if src is None or dst is None:
            return None
        # locate first: without shared arrays it answers at once (an address costs ~3 us)
        where = self.shm.locate(src)
        if where is None or where[1] % src.itemsize:
            return None
        return where if dst is src or dst.ctypes.data == src.ctypes.data else None

    def shared_array(self, nbytes: int) -> np.ndarray | None:
        """A flat uint8 array of ``nbytes`` in this node's shared memory (NOTE [shared arrays]
        in shm.py): an allreduce of a piece of it that every rank passes alike is reduced in place
        with nothing copied in. Collective over the group, in issue order, with the same
        ``nbytes`` on every rank (CollectiveMismatchError otherwise). None where the group cannot
        use it (one rank, Gloo, TERRAPIPE_COMM_BACKEND=mpi, nodes of unequal size) or when the
        node's /dev/shm cannot hold it. The caller owns the array; :meth:`release_shared`
        returns it to private use."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"shared_array: nbytes must be >= 0, got {nbytes}")
        if self.size == 1 or self.shm is None or self.force_mpi or not self.uniform:
            return None

        def body():
            self.agree("shared_array", 0, _Bytes(nbytes))
            try:
                arr = self.shm.alloc_shared(nbytes)
            except OSError:  # raised alike on every rank of the node
                arr = None
            if self.nnodes > 1 and self.comm is not None:  # every node must agree on the path
                from mpi4py import MPI

                if not self.comm.allreduce(arr is not None, op=MPI.LAND) and arr is not None:
                    self.shm.release_shared(arr)
                    arr = None
            return arr

        return self.run(body, False)

    def release_shared(self, arr: np.ndarray) -> None:
        """Return an array of :meth:`shared_array` to private use: allreduces of it take the
        ordinary paths from now on (every rank must release alike). Its memory goes when the last
        view of it does. Local; runs after the collectives issued before it."""
        if self.shm is not None and not self._failed:  # a failed group takes no more calls
            self.run(lambda: self.shm.release_shared(arr), False)

    def allreduce_small(self, x: np.ndarray, op: int, coll: str = "allreduce", ckind: int = 0,
                        sig_shape: tuple | None = None) -> bool:
        """The latency path of a sync, in-place allreduce of ``x``: True when done here, False
        when ``x`` does not qualify (the caller takes the general path). Qualifies: a
        C-contiguous array of a reducible dtype that the one-shot takes (``_oneshot_fits``, and
        not a piece of a shared array the shared path takes), on a one-node shared-memory group
        with no async collective pending. ``ckind``: float32 sent as 16-bit;
        ``sig_shape``: the shape the signature names (default ``x.shape``). Same signature and
        step accounting as the general small path, so ranks may mix the two."""
        key = (x.dtype, x.shape, op, coll, ckind)
        plan = self._small_entries.get(key)
        if plan is None:
            if len(self._small_entries) > 1024:
                self._small_entries.clear()
            plan = self._small_entries[key] = self._small_plan(
                x.dtype, x.size, op, coll, ckind, x.shape if sig_shape is None else sig_shape)
        if not plan or self._pending or not x.flags.c_contiguous:
            return False
        if not ckind and self._shared_fits(x.nbytes) and self.shm.locate(x) is not None:
            return False  # the shared path's, sync or async alike (NOTE [transport selection] 6)
        call, as16 = plan
        flat = x.reshape(-1)
        if as16:
            flat = flat.view(np.uint16)
        with self._state:
            if self._pending:
                return False
            self._exec.acquire()
        try:
            if self._failed:
                raise CommError(f"this group is unusable after an earlier failure: {self._failed}")
            if timeline.enabled():
                with timeline.span("comm", coll, args={"bytes": x.nbytes, "path": "one-shot"}):
                    call(flat, flat)
            else:
                call(flat, flat)
        except CollectiveTimeoutError as e:
            self._failed = str(e)
            raise
        finally:
            self._exec.release()
        return True

    def _small_plan(self, dtype: np.dtype, size: int, op: int, coll: str, ckind: int, shape: tuple):
        """(the one-shot call with everything but the arrays fixed, whether the array is passed
        as uint16 bits), or False when such an allreduce does not take the latency path."""
        name = dtype.name
        kind = ckind or (F16 if name == "float16" else 0)
        rows_dtype = np.dtype(np.uint16) if kind else dtype
        if (self.size == 1 or name not in ("float32", "float64", "int32", "int64", "float16")
                or (ckind and name != "float32") or not self._oneshot_fits(size * rows_dtype.itemsize)
                or self._single_copy_fits(size * rows_dtype.itemsize, kind)):
            return False
        sig = self._signature_of(coll, op, name, size, tuple(shape), -1)
        call = self.shm.oneshot_plan(rows_dtype, op, kind, coll, sig, functools.partial(self._mismatch, coll))
        return call, bool(kind and not ckind)

    # -- the other collectives: the one-rank shortcut and the agreement, once; then the data ------
    def _post_single_copy(self, buf: Buffer, nbytes: int, min_bytes: int, kind: int = 0) -> bool:
        """Whether a collective of ``buf`` moving ``nbytes`` goes single-copy (from
        ``min_bytes``: NOTE [single-copy allreduce] 6 in cma.py), decided alike on every rank
        from what the signature carries; if so, its address is published with the agreement
        that follows."""
        flat = buf.flat
        if not (self._single_copy_fits(nbytes, kind, min_bytes) and flat.flags.c_contiguous):
            return False
        self.shm.post_single_copy(flat, flat)
        return True

    def broadcast_flat(self, buf: Buffer, root: int) -> None:
        # Not single-copy: the segment's chunks let root copy in while the others copy out, as
        # fast here from 1 MiB (NOTE [single-copy allreduce] 6 in cma.py).
        if self.size > 1:
            self.agree("broadcast", 0, buf, root)
            self._route("broadcast").broadcast(buf.flat, root)

    def allgather_flat(self, buf: Buffer, out: np.ndarray, root: int = -1) -> None:
        """out: (size, n) flat rows; ``root`` >= 0 makes it a gather (only root fills out)."""
        if self.size == 1:
            out[0] = buf.flat
            return
        coll = "gather" if root >= 0 else "allgather"
        single = self._post_single_copy(buf, buf.flat.nbytes, cma.MIN_BYTES)
        self.agree(coll, 0, buf, root)
        if single:
            self.shm.allgather_single_copy(buf.flat, out, root)
        else:
            self._route(coll).allgather(buf.flat, out, root)

    def scatter_flat(self, full: Buffer, out: np.ndarray, root: int) -> None:
        """full: (size * n) on every rank (read on root only); out: this rank's n elements."""
        if self.size == 1:
            out[...] = full.flat[:out.shape[0]]
            return
        self.agree("scatter", 0, full, root)
        self._route("scatter").scatter(full.flat, out, root)

    def reduce_scatter_flat(self, buf: Buffer, out: np.ndarray, op: int) -> None:
        """out: this rank's part (np.array_split over ranks) of the reduced flat buffer."""
        if self.size == 1:
            out[...] = buf.flat
            return
        single = self._post_single_copy(buf, buf.flat.nbytes, cma.REDUCE_SCATTER_MIN_BYTES, buf.kind)
        self.agree("reduce_scatter", op, buf)
        if single:
            self.shm.reduce_scatter_single_copy(buf.flat, out, op)
        else:
            self._route("reduce_scatter").reduce_scatter(buf.flat, out, op, buf.kind)

    def reduce_flat(self, buf: Buffer, op: int, root: int) -> None:
        if self.size == 1:
            return
        self.agree("reduce", op, buf, root)
        tmp = buf.flat if self.rank == root else np.empty_like(buf.flat)
        self._route("allreduce").allreduce(
            Fused([buf.flat]), Fused([tmp]), op, buf.flat.dtype, buf.kind, root=root)

    def barrier(self) -> None:
        if self.size > 1:
            self.agree("barrier")
            self._route("barrier").barrier()

    def send(self, buf: Buffer, dest: int, tag: int) -> None:
        self._p2p("send").send(buf.flat, dest, tag)

    def recv(self, buf: Buffer, source: int, tag: int) -> None:
        self._p2p("recv").recv(buf.flat, source, tag)

    def _p2p(self, what: str) -> Transport:
        if self.size == 1:
            raise CommError(f"{what}: a lone process has no peer")
        t = self.gloo or self.mpi
        if t is None:
            raise CommError(f"{what}: point-to-point needs MPI or Gloo; this group has shared memory only")
        return t


_handle_ids = itertools.count(1)


class _Bytes:
    """A byte count as the signature agreement sees a buffer."""

    dtype_name = "uint8"

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.shape = (nbytes,)


def _traced(fn, label: tuple[str, int]):
    name, nbytes = label

    def body():
        with timeline.span("comm", name, args={"bytes": nbytes}):
            return fn()

    return body


def _trace_handle(fut: Future, label: tuple[str, int]) -> None:
    """An async collective on the timeline from issue to completion (NOTE [timeline recording] 5)."""
    name, nbytes = label
    ident = next(_handle_ids)
    timeline.async_begin("comm", name, ident, {"bytes": nbytes})
    fut.add_done_callback(lambda _f: timeline.async_end("comm", name, ident))
