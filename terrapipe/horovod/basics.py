"""Lifecycle, topology and process sets of terrapipe.horovod (horovod.common.basics and
horovod.common.process_sets, on terrapipe.comm).

Each process set (the global one included) owns a terrapipe Group split from the world, used only
by its Coordinator's thread (NOTE [name negotiation] in negotiation.py), so hvd collectives never
interleave with terrapipe.comm calls the script makes itself.

Why one module: init, shutdown, the topology queries and the process sets read and change one
state (``_state``, under one lock): a set is made from init's world and released by shutdown,
and ``HOROVOD_TIMELINE``'s trace lives from one to the other.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref

import numpy as np

from .. import comm as _comm
from .. import settings, timeline
from .errors import HorovodInternalError
from .execute import RUNNERS
from .negotiation import Coordinator

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]

for _kind, _run in RUNNERS.items():
    Coordinator.register(_kind, _run)

_NOT_INIT = "Horovod has not been initialized; use hvd.init()."
_lock = threading.RLock()


def _stall_timeout() -> float:
    """Seconds a named collective waits for ranks that have not issued it (TERRAPIPE_HOROVOD_TIMEOUT,
    else HOROVOD_STALL_SHUTDOWN_TIME_SECONDS when set, else 300). It bounds the wait for a *name*
    (NOTE [name negotiation] 3c), never a transport wait: a 3 s stall limit must not turn a rank
    descheduled for 3 s into a dead process set (the transport waits ``_transport_timeout``)."""
    ours = settings.get("TERRAPIPE_HOROVOD_TIMEOUT")
    if ours is not None:
        return ours
    value = os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "")  # Horovod's own variable
    if value.strip() and float(value) > 0:
        return float(value)
    return 300.0


def _start_env_timeline(rank: int) -> bool:
    """Horovod's ``HOROVOD_TIMELINE=path``: rank 0 records a live trace at ``path`` from init to
    shutdown (NOTE [one trace per job] 5 in terrapipe/timeline.py), with coordinator rounds when
    ``HOROVOD_TIMELINE_MARK_CYCLES`` is set; ``DYNAMIC`` (or unset) leaves it to
    :func:`start_timeline`. Returns whether this rank started one. A trace already being recorded
    (``TERRAPIPE_TIMELINE``: every rank's) is kept."""
    path = os.environ.get("HOROVOD_TIMELINE", "").strip()
    if not path or path.upper() == "DYNAMIC" or rank != 0:
        return False
    if timeline.enabled():
        print(f"terrapipe.horovod: HOROVOD_TIMELINE={path} ignored: a timeline is already recording "
              f"to {timeline.path()}", file=sys.stderr, flush=True)
        return False
    cycles = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").strip().lower() not in ("", "0", "false")
    timeline.start(path, mark_cycles=cycles, live=True)
    return True


def _transport_timeout(stall: float) -> float:
    """Seconds one coordinator round waits for the other ranks' coordinators: comm's default,
    or the stall limit when that is longer (a rank may legitimately issue nothing for that long)."""
    return max(300.0, stall)


class ProcessSet:
    """A subset of the ranks that collectives can run on (``process_set=`` of every collective).

    ``ProcessSet([0, 2])`` names global ranks; ``ProcessSet(mpi4py_comm)`` takes a communicator's
    ranks (of MPI.COMM_WORLD). It becomes usable once registered: in ``hvd.init(process_sets=
    [...])`` or with ``hvd.add_process_set`` (collective: every rank registers the same sets in
    the same order). ``process_set_id`` is None until then.
    """

    def __init__(self, ranks_or_comm) -> None:
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            from mpi4py import MPI

            self.mpi_comm = ranks_or_comm
            if ranks_or_comm == MPI.COMM_NULL:
                self.ranks = None
            else:
                ranks = MPI.Group.Translate_ranks(ranks_or_comm.Get_group(), list(range(ranks_or_comm.size)),
                                                  MPI.COMM_WORLD.Get_group())
                self.ranks = sorted(int(r) for r in ranks)
        else:
            ranks = [int(r) for r in ranks_or_comm]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet: ranks must be distinct, got {ranks}")
            self.ranks = sorted(ranks)
        self.process_set_id: int | None = None
        self._coordinator: Coordinator | None = None
        self._group: _comm.Group | None = None

    def _check(self) -> Coordinator:
        if self.process_set_id is None or _state.sets.get(self.process_set_id) is not self:
            if not _state.initialized:
                raise ValueError(_NOT_INIT)
            raise ValueError(f"{self}: not registered (hvd.init(process_sets=[...]) or hvd.add_process_set)")
        if self._coordinator is None:
            raise ValueError(f"{self}: rank {rank()} is not in this process set")
        return self._coordinator

    def size(self) -> int | None:
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None when it is not a member."""
        if self.ranks is None or not _state.initialized:
            return None
        r = rank()
        return self.ranks.index(r) if r in self.ranks else None

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before hvd.init())."""
        if not _state.initialized or self.ranks is None:
            return None
        return rank() in self.ranks

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks or ()))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _State:
    def __init__(self) -> None:
        self.initialized = False
        self.base: _comm.Group | None = None  # the hvd world (COMM_WORLD, or init's comm)
        self.sets: dict[int, ProcessSet] = {}
        self.next_id = 1
        self.cross = (0, 1)
        self.timeout = 300.0
        self.env_timeline = False  # init started HOROVOD_TIMELINE's live trace (rank 0)


_state = _State()
_listeners: list[weakref.WeakMethod] = []


def on_world_change(method) -> None:
    """Call the bound ``method(joined)`` after every :func:`init` (``joined`` True) and at the
    start of every :func:`shutdown` (False), for as long as its object lives: how an object built
    over one world (a DistributedOptimizer's gradient hooks) follows an elastic job into the next
    (terrapipe.horovod.elastic)."""
    _listeners.append(weakref.WeakMethod(method))


def _tell_listeners(joined: bool) -> None:
    alive = [ref for ref in _listeners if ref() is not None]
    _listeners[:] = alive
    for ref in alive:
        method = ref()
        if method is not None:
            method(joined)


def init(comm=None, process_sets=None) -> None:
    """Join the job (idempotent until :func:`shutdown`; init after shutdown joins again).

    ``comm``: None (every rank the launcher started), a list of ranks, or an mpi4py
    communicator (duplicated) to run on instead. ``process_sets``: ProcessSets to register now,
    or ``"dynamic"`` (sets may always be added later here). Under ``terrapipe run`` / mpiexec the
    world is MPI's; under ``terrapipe run --gloo`` / torchrun it is Gloo's.
    """
    with _lock:
        if _state.initialized:
            return
        timeout = _stall_timeout()
        transport = _transport_timeout(timeout)
        try:
            world = _comm.init()
        except _comm.WorkerRemoved as e:  # NOTE [elastic generations] 5: the launcher's decision
            print(f"terrapipe.horovod: {e}; exiting", file=sys.stderr, flush=True)
            raise SystemExit(0) from None
        if comm is None:
            base = world.split(0, timeout=transport)
        elif isinstance(comm, (list, tuple)):
            members = sorted({int(r) for r in comm})
            base = world.split(0 if world.rank in members else 1, timeout=transport)
            if world.rank not in members:
                base.close()
                raise ValueError(f"init: comm={members} does not include this rank ({world.rank})")
        else:
            base = _comm.Group(comm.Dup(), transport)
        _state.base, _state.timeout = base, timeout
        local = _comm.allgather(np.array([base.local_rank], np.int64), group=base)[:, 0]
        same = [r for r in range(base.size) if local[r] == base.local_rank]
        _state.cross = (same.index(base.rank), len(same))
        global_process_set.ranks = list(range(base.size))
        global_process_set._group = base.split(0)
        global_process_set._coordinator = Coordinator(global_process_set._group, timeout,
                                                      global_process_set.ranks, "global process set")
        _state.sets = {0: global_process_set}
        _state.next_id = 1
        _state.initialized = True
        _state.env_timeline = _start_env_timeline(base.rank)
        _tell_listeners(True)
        if process_sets is not None and process_sets != "dynamic":
            for ps in process_sets:
                add_process_set(ps)


def shutdown() -> None:
    """Stop every process set's coordinator (collectives still queued run first) and release
    their groups. ``init()`` may be called again afterwards."""
    with _lock:
        if not _state.initialized:
            return
        _tell_listeners(False)
        for ps in list(_state.sets.values()):
            _release(ps)
        _state.sets = {}
        if _state.base is not None:
            _state.base.close()
        _state.base = None
        _state.initialized = False
        if _state.env_timeline and timeline.live():  # the one init started (not start_timeline's)
            timeline.stop()
        _state.env_timeline = False
        if _comm.is_elastic():  # an elastic job: the next init joins a new generation
            _comm.finalize()


atexit.register(shutdown)


def _release(ps: ProcessSet) -> None:
    ended = True
    if ps._coordinator is not None:
        ended = ps._coordinator.close()
    if ps._group is not None and ended:  # a thread stuck in a collective keeps its group
        ps._group.close()
    ps._coordinator, ps._group = None, None
    if ps is not global_process_set:
        ps.process_set_id = None


def _require() -> _comm.Group:
    if not _state.initialized:
        raise ValueError(_NOT_INIT)
    return _state.base


def is_initialized() -> bool:
    return _state.initialized


def size() -> int:
    """Number of processes in the job."""
    return _require().size


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    return _require().rank


def local_size() -> int:
    """Number of processes on this node."""
    return _require().local_size


def local_rank() -> int:
    """This process's rank on its node."""
    return _require().local_rank


def cross_size() -> int:
    """Number of nodes with a process of this local rank."""
    _require()
    return _state.cross[1]


def cross_rank() -> int:
    """This process's rank among the processes of the same local rank on every node."""
    _require()
    return _state.cross[0]


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    return _require().uniform


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with MPI_THREAD_MULTIPLE (False when MPI is not used)."""
    _require()
    if not mpi_enabled():
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Whether the job runs over MPI (launched by mpiexec or ``terrapipe run``)."""
    return _require().comm is not None


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def gloo_enabled() -> bool:
    """Whether the job runs over Gloo (``terrapipe run --gloo``, torchrun)."""
    return _require().gloo is not None


def gloo_built() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version as an integer (2.18.3 -> 21803) when torch has NCCL and CUDA, else 0."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (AttributeError, RuntimeError, TypeError):
        return 0
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def add_process_set(process_set) -> ProcessSet:
    """Register ``process_set`` (a ProcessSet or a list of ranks); collective over every rank,
    which must register the same sets in the same order. Returns the registered ProcessSet."""
    with _lock:
        base = _require()
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.ranks is None:
            raise ValueError(f"add_process_set: {ps} has no ranks (MPI.COMM_NULL on this rank?)")
        bad = [r for r in ps.ranks if not 0 <= r < base.size]
        if bad:
            raise ValueError(f"add_process_set: ranks {bad} are outside a job of {base.size} ranks")
        for other in _state.sets.values():
            if other.ranks == ps.ranks:
                raise ValueError(f"add_process_set: a process set with ranks {ps.ranks} is already "
                                 f"registered (id {other.process_set_id})")
        member = base.rank in ps.ranks
        group = base.split(1 if member else 0)
        if member:
            ps._group = group
            ps._coordinator = Coordinator(group, _state.timeout, ps.ranks, f"process set {ps.ranks}")
        else:
            group.close()
        ps.process_set_id = _state.next_id
        _state.next_id += 1
        _state.sets[ps.process_set_id] = ps
        return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective over every rank, after its collectives finished);
    False when it was not registered."""
    with _lock:
        _require()
        if process_set is global_process_set or process_set.process_set_id == 0:
            raise ValueError("remove_process_set: the global process set cannot be removed")
        if _state.sets.get(process_set.process_set_id) is not process_set:
            return False
        del _state.sets[process_set.process_set_id]
        _release(process_set)
        _comm.barrier(group=_state.base)
        return True


def coordinator(process_set: ProcessSet) -> Coordinator:
    """The coordinator of a registered set this rank belongs to (ValueError otherwise)."""
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set: expected a ProcessSet, got {type(process_set).__name__}")
    co = process_set._check()
    if co.dead:
        raise HorovodInternalError(f"{co.label}: unusable after an earlier failure: {co.dead}")
    return co
