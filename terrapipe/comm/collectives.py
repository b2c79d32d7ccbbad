"""The public collectives of terrapipe.comm, on NumPy arrays and torch tensors.

Every function takes an optional ``group`` (default: the world from :func:`init`) and
``async_op``: with ``async_op=True`` it returns a :class:`~terrapipe.comm.group.Handle` whose
``wait()`` gives the result; several may be outstanding and they complete in issue order.
Arrays and tensors may be non-contiguous (results are written back) or CUDA tensors: NCCL for
allreduce, broadcast and allgather where every rank can use it (comm/transports/nccl.py), else copied
through host memory (pinned and overlapped for jit_allreduce: comm/staging.py). Ranks must
call collectives in the same order with matching arguments; otherwise every rank raises
CollectiveMismatchError (see NOTE [collective ordering] in comm/execution.py). Each call goes
to comm/select.py, which picks the algorithm (comm/algorithms/) and transport
(comm/transports/) that run it.

NOTE [a read-only array a collective writes]
    1. A NumPy array that cannot be written (``np.frombuffer`` of bytes, a broadcast view,
       ``flags.writeable = False``) where a call writes its result: ``x`` of an in-place
       allreduce, root's ``x`` of reduce, ``x`` of recv, ``out=``, the tensors of
       jit_allreduce and adasum_allreduce. Refused before the call, on that rank only, the
       peers would wait for it to the timeout (or meet its next call: a mismatch, and every
       later call out of step); refused by the kernels, it was a compile error.
    2. So that rank takes part with a private copy in its place and then raises a ValueError
       naming the argument and its rank: the peers complete the call with its data, and the
       group stays usable. An async call is run to completion before the error (its order
       among outstanding calls is kept: calls complete in issue order anyway).
    3. Where the array is only read (the input of allgather, gather, scatter, reduce_scatter,
       broadcast's root), read-only is fine; a read-only receiver of broadcast is refused the
       same way in comm/select.py.

Why one module: these are the public collectives, one function each with its argument
checks and docstring; each is a few lines that hand the call to comm/select.py.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import sys
import traceback
import zlib

import numpy as np

from .. import launch_env, settings, timeline
from ..kernels import BF16, F16
from ..kernels import reduce as kreduce
from . import clock, execution, rendezvous, select
from .algorithms import adasum
from .buffers import Buffer, plain_array
from .errors import SetupAbandoned
from .execution import Handle
from .group import Group, force_backend, forced_backend
from .message import NO_GATE
from .select import Request
from .transports import nccl
from .transports.shm import remove_stale

__all__ = [
    "init", "finalize", "forced_backend", "world", "is_initialized", "rank", "size", "local_rank",
    "local_size",
    "allreduce", "broadcast", "allgather", "reduce_scatter", "reduce", "gather", "scatter",
    "send", "recv", "barrier", "jit_allreduce", "adasum_allreduce", "broadcast_object", "cuda_collectives",
]

_world: Group | None = None
_clock = (0, 0)


def init(backend: str = "auto", timeout: float = 300.0) -> Group:
    """Join the world (idempotent) and return it.

    Under ``mpiexec`` (or ``terrapipe run``) the world comes from mpi4py; under ``torchrun`` (or
    SLURM with MASTER_ADDR) from torch.distributed over Gloo, with each machine's shared memory
    (NOTE [machines over Gloo] in comm/group.py; on one machine every collective takes it); a
    lone process needs nothing.
    ``timeout``: seconds a collective waits for the other ranks before raising
    CollectiveTimeoutError. ``TERRAPIPE_NODE_SIZE=k`` groups ranks k per node (to emulate
    several nodes on one machine). ``backend`` (or ``TERRAPIPE_COMM_BACKEND``) "mpi" routes every
    collective through MPI; "shm" keeps large allreduces on one node in shared memory, where
    "auto" sends those above the one-shot's limit through the MPI ring when each rank has a core
    (NOTE [algorithm selection] in comm/select.py); "torch" joins over torch.distributed (Gloo). Also
    exports RANK / WORLD_SIZE / LOCAL_RANK for libraries that read them (FastLoader's sharding
    defaults).
    """
    global _world
    if _world is not None:
        return _world
    if backend not in ("auto", "mpi", "shm", "torch"):
        raise ValueError(f"backend: expected 'auto', 'mpi', 'shm' or 'torch', got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    remove_stale()
    launched = launch_env.mpi_launched()
    if backend != "auto":
        force_backend(backend)  # every group of this process routes by it, the world first
    backend = forced_backend()
    if rendezvous.is_elastic() and not launched:
        _world = _join_elastic(timeout)
    elif backend == "torch" or (backend == "auto" and not launched and launch_env.torch_launched()):
        _world = Group.over_torch(timeout)
    elif launched or backend != "auto":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()
        node_size = settings.get("TERRAPIPE_NODE_SIZE") or None
        _world = Group(comm, timeout, node_size)
        if _world.size > 1:
            _abort_on_uncaught_exception(MPI)
    else:
        _world = Group(None, timeout)
    # Overwritten, not defaulted: values inherited from a parent process must not win over the
    # world this process actually joined.
    os.environ["RANK"] = str(_world.rank)
    os.environ["WORLD_SIZE"] = str(_world.size)
    os.environ["LOCAL_RANK"] = str(_world.local_rank)
    global _clock
    _clock = clock.align(_world)  # the timeline's one clock across nodes
    atexit.register(_at_exit)
    return _world


def _join_elastic(timeout: float) -> Group:
    """The world of an elastic job: the next generation its launcher forms with this worker in
    it (NOTE [elastic generations] in comm/rendezvous.py), over shared memory on one machine,
    over Gloo across machines; a generation superseded while its group was being set up is left
    for the next."""
    while True:
        membership, store = rendezvous.join(settings.get("TERRAPIPE_ELASTIC_TIMEOUT"))
        g, r, n = membership.generation, membership.rank, membership.size
        abandon = rendezvous.superseded(store, g)
        try:
            try:
                return Group.over_store(store, f"elastic/gen/{g}/group", r, n, timeout, abandon)
            except ValueError:  # members on several machines (every member finds it alike)
                return Group.over_store_and_gloo(store, f"elastic/gen/{g}/across", r, n, timeout, abandon)
        except SetupAbandoned:
            continue


def clock_alignment() -> tuple[int, int]:
    """``(offset_ns, bound_ns)``: what comm.init added to this rank's timeline clock to read rank
    0's, and the most that can be off by (half the best round trip); (0, 0) on one node."""
    return _clock


def _abort_on_uncaught_exception(MPI) -> None:
    """An uncaught exception on one rank ends the whole job at once (as ``python -m mpi4py``
    does): otherwise that rank waits in MPI_Finalize at exit while the others wait for it in
    their next collective."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        status_dir = settings.get("TERRAPIPE_RUN_STATUS")  # set by `terrapipe run`
        if status_dir:
            # Before aborting: the launcher kills every other process right after
            # (NOTE [rank status] in launch_env.py).
            launch_env.record_exit(status_dir, MPI.COMM_WORLD.Get_rank(), 1,
                                   "".join(traceback.format_exception_only(kind, value)))
        if _world is not None and execution.first_failure() is not None:
            _world.settle_at_exit(_EXIT_SETTLE)  # NOTE [collective ordering] 7
        _abort(MPI)

    sys.excepthook = hook


def finalize() -> None:
    """Release the world's shared memory and threads (also runs at exit); a later :func:`init`
    starts afresh (its ``backend=`` too, and forgets earlier failures)."""
    global _world
    if _world is not None:
        _world.close()
        _world = None
    force_backend(None)
    execution.forget_failures()


def _at_exit() -> None:
    """:func:`finalize` at exit; after a failed collective, end the job instead (NOTE
    [collective ordering] 6 and 7 in comm/execution.py)."""
    failure = execution.first_failure()
    if failure is not None and _world is not None and _world.comm is not None and _world.size > 1:
        from mpi4py import MPI

        running = _world.settle_at_exit(_EXIT_SETTLE)
        print(f"terrapipe.comm: rank {_world.rank} ends the job (MPI_Abort) at exit after a "
              f"failed collective, as MPI_Finalize would wait for ranks that cannot come: "
              f"{failure}" + (f" (ranks {running} of this node still running)" if running else ""),
              file=sys.stderr, flush=True)
        _abort(MPI)
    if _world is not None:
        _world.settle_at_exit(0)  # a node peer aborting waits for no rank that is leaving
    finalize()


_ABORT_GRACE = 5  # seconds MPI_Abort may take before the rank exits by itself (_abort)
# Seconds the exit hook waits for this node's other ranks to reach their exits before it aborts
# the job (NOTE [collective ordering] 7 in comm/execution.py).
_EXIT_SETTLE = 5


def _abort(MPI) -> None:
    """MPI_Abort(COMM_WORLD, 1): the launcher ends every rank of the job; first this rank
    removes the name of MPICH's node file, which no killed rank would. A rank cut off from
    its launcher (its node's link down) is never answered and would wait in MPI_Abort for ever:
    it ends by itself (SIGALRM) after ``_ABORT_GRACE`` seconds, so no rank outlives the job it
    failed."""
    launch_env.unlink_own_mpi_segments()  # the node's other ranks are about to be killed
    # The kernel's timer, not a thread: MPI_Abort waits on its launcher holding the GIL, and
    # SIGALRM's default action ends the process with no Python code to run.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(_ABORT_GRACE)
    MPI.COMM_WORLD.Abort(1)


def is_initialized() -> bool:
    return _world is not None


def world() -> Group:
    return _world if _world is not None else init()


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def _g(group: Group | None) -> Group:
    return group if group is not None else world()


def _run(group: Group, body, async_op: bool, coll: str | None = None, x=None):
    """Run ``body`` on ``group`` in issue order; ``coll`` and ``x`` name it on the timeline."""
    label = (coll, _nbytes(x)) if coll is not None and timeline.enabled() else None
    return group.run(body, async_op, label)


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    nbytes = getattr(x, "nbytes", None)
    if nbytes is None and hasattr(x, "element_size"):
        return int(x.numel() * x.element_size())
    return int(nbytes or 0)


def _tensor_type():
    """``torch.Tensor`` where torch is imported, else None (a tensor implies it is; no import)."""
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def allreduce(x, op: str = "sum", *, out=None, async_op: bool = False, group: Group | None = None):
    """Elementwise reduction over ranks: sum, avg, min, max, prod.

    In place on ``x`` unless ``out`` (same shape and dtype) is given. Returns the result (x or
    out), or a Handle. float16/bfloat16 accumulate in float32; avg divides once.
    """
    g = group if group is not None else _world if _world is not None else init()  # _g(group), inline
    if _read_only(x if out is None else out):  # NOTE [a read-only array a collective writes]
        allreduce(x, op, out=np.empty_like(x if out is None else out), group=g)
        raise _refused("allreduce", "x" if out is None else "out", g)
    # Latency path first: small sync in-place allreduces of plain arrays skip the general
    # machinery; those of a NumPy array or CPU tensor of a dtype, shape and op it took before
    # take its fast lane (select.small_lane; a tensor as its NumPy view).
    kind = type(x)
    if out is None and not async_op and type(op) is str and (kind is np.ndarray or kind is _tensor_type()):
        lane = g.small_lanes.get((kind, x.dtype, x.shape, op))
        if lane is not None:
            arr = x if kind is np.ndarray else plain_array(x)
            if arr is not None and lane(arr):
                return x
    code = kreduce.op_code(op)
    if out is None and not async_op:
        arr = plain_array(x)
        if arr is not None and select.allreduce_small(g, arr, code):
            key = (kind, x.dtype, x.shape, op)
            if type(op) is str and key not in g.small_lanes:
                lanes = g.small_lanes
                if len(lanes) > 1024:
                    lanes.clear()
                lanes[key] = select.small_lane(g, arr, code)  # None: it has none
            return x
    if _wants_nccl(g, x, "allreduce"):
        if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
            raise ValueError(f"out: expected {x.dtype} {tuple(x.shape)} on {x.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")

        def on_nccl(transport, t):
            transport.allreduce(t, out, code)
            return x if out is None else out

        return _via_nccl(g, x, "allreduce", code, -1, on_nccl,
                         lambda: _allreduce_staged(g, x, out, code)(), async_op)
    return _run(g, _allreduce_staged(g, x, out, code), async_op, "allreduce", x)


def _allreduce_staged(g: Group, x, out, code: int):
    """The body of an allreduce of host memory (CUDA tensors copied through it)."""
    src = Buffer(x, "x")
    dst = src if out is None else Buffer(out, "out")
    if dst is not src and (dst.shape != src.shape or dst.dtype_name != src.dtype_name):
        raise ValueError(f"out: expected {src.dtype_name} {src.shape}, got {dst.dtype_name} {dst.shape}")
    if src.dtype_name in ("uint8", "int8", "int16", "uint16", "bool"):
        raise TypeError(f"allreduce: cannot reduce dtype {src.dtype_name}")

    def body():
        select.allreduce_views(g, [src.flat], [dst.flat], code, src.kind, sig_buf=src)
        dst.commit()
        return dst.orig

    return body


def _via_nccl(g: Group, x, coll: str, code: int, root: int, on_nccl, staged, async_op: bool):
    """Run ``on_nccl(transport, x.detach())`` on the caller's current stream after the ranks agree on
    the ``nccl_<coll>`` signature, or ``staged()`` when the group decides against NCCL (see
    comm/transports/nccl.py). The stream is captured here, in the caller's thread: async bodies run on the
    group's worker thread."""
    torch = sys.modules["torch"]
    caller = torch.cuda.current_stream(x.device)
    sig = _Sig(_torch_dtype_name(x), x.numel(), tuple(x.shape))

    def body():
        with torch.cuda.stream(caller):
            g.agree(f"nccl_{coll}", code, sig, root)
            transport = nccl.process_group(g, x.device)
            if transport is None:
                return staged()
            with timeline.span("comm", "nccl enqueue"):
                return on_nccl(transport, x.detach())

    return _run(g, body, async_op, coll, x)


def _nccl_or_staged(g: Group, x, coll: str, code: int, root: int, on_nccl, staged, async_op: bool):
    """A collective of one input ``x``: on NCCL through :func:`_via_nccl` when this rank wants it
    for a CUDA tensor, else ``staged(Buffer(x))`` with the Buffer made here, in the caller's
    thread (and, for a CUDA tensor, on its current stream)."""
    if _wants_nccl(g, x, coll):
        return _via_nccl(g, x, coll, code, root, on_nccl, lambda: staged(Buffer(x, "x")), async_op)
    buf = Buffer(x, "x")
    return _run(g, lambda: staged(buf), async_op, coll, x)


def broadcast(x, root: int = 0, *, async_op: bool = False, group: Group | None = None):
    """Copy ``x`` of rank ``root`` into ``x`` on every rank (in place)."""
    g = _g(group)
    _check_root(root, g)
    if not async_op:  # the latency path (NOTE [one-shot copies] in comm/algorithms/oneshot.py)
        arr = plain_array(x)
        if arr is not None and select.broadcast_small(g, arr, root):
            return x

    def staged(buf: Buffer):
        select.broadcast(g, buf, root)
        buf.commit()
        return buf.orig

    def on_nccl(transport, t):
        transport.broadcast(t, root)
        return x

    return _nccl_or_staged(g, x, "broadcast", 0, root, on_nccl, staged, async_op)


def allgather(x, *, out=None, async_op: bool = False, group: Group | None = None):
    """Every rank's ``x`` stacked: a new array/tensor of shape (size, *x.shape), or ``out``,
    written and returned: an array or tensor of ``x``'s type, dtype and device with size *
    x.numel() elements in any shape (as ``torch.distributed.all_gather_into_tensor``'s output),
    rank r's ``x`` in its r-th block of x.numel() elements, C order. With ``out`` nothing is
    allocated per call (a new result too large for the allocator to reuse is fresh pages,
    faulted in at every call)."""
    g = _g(group)
    if _read_only(out):  # NOTE [a read-only array a collective writes]
        allgather(x, out=np.empty_like(out), group=g)
        raise _refused("allgather", "out", g)
    if out is not None:
        x = _input_for_out(x, out, g.size * _numel(x), "allgather")
    if not async_op:  # the latency path (NOTE [one-shot copies] in comm/algorithms/oneshot.py)
        arr = plain_array(x)
        maker = _maker(x, arr, out) if arr is not None else None
        if maker is not None:
            made = select.gather_small(g, arr, maker)
            if made is not None:
                return made

    def staged(buf: Buffer):
        made, obuf = _result(buf, (g.size, *buf.shape), out)
        select.allgather(g, buf, obuf.flat.reshape(g.size, buf.size))
        return _delivered(made, obuf, out, x)

    def on_nccl(transport, t):
        made = transport.allgather(t)
        if out is None:
            return made
        out.copy_(made.reshape(out.shape))  # on the device: NCCL's result is a tensor of its own
        return out

    return _nccl_or_staged(g, x, "allgather", 0, -1, on_nccl, staged, async_op)


def gather(x, root: int = 0, *, async_op: bool = False, group: Group | None = None):
    """Like allgather, but only ``root`` gets the (size, *x.shape) result; others get None."""
    g = _g(group)
    _check_root(root, g)
    if not async_op:  # the latency path, as allgather's
        arr = plain_array(x)
        if arr is not None:
            out = select.gather_small(g, arr, _maker(x, arr), root)
            if out is not None:
                return out if g.rank == root else None
    buf = Buffer(x, "x")
    out, obuf = buf.like((g.size, *buf.shape))

    def body():
        select.allgather(g, buf, obuf.flat.reshape(g.size, buf.size), root=root)
        return _like_input(out, x) if g.rank == root else None

    return _run(g, body, async_op, "gather", x)


def scatter(x, root: int = 0, *, async_op: bool = False, group: Group | None = None):
    """``x`` has shape (size, ...) on every rank (read on root); returns this rank's ``x[rank]``
    from root as a new array/tensor."""
    g = _g(group)
    _check_root(root, g)
    buf = Buffer(x, "x")
    if not buf.shape or buf.shape[0] != g.size:
        raise ValueError(f"scatter: x must have shape (size={g.size}, ...), got {buf.shape}")
    out, obuf = buf.like(buf.shape[1:])

    def body():
        select.scatter(g, buf, obuf.flat, root)
        return _like_input(out, x)

    return _run(g, body, async_op, "scatter", x)


def reduce(x, op: str = "sum", root: int = 0, *, async_op: bool = False, group: Group | None = None):
    """Reduce into ``x`` on ``root`` (others' ``x`` is left as it was)."""
    g = _g(group)
    _check_root(root, g)
    code = kreduce.op_code(op)
    if g.rank == root and _read_only(x):  # NOTE [a read-only array a collective writes]
        reduce(x.copy(), op, root, group=g)
        raise _refused("reduce", "x", g)
    buf = Buffer(x, "x")

    def body():
        select.reduce(g, buf, code, root)
        if g.rank == root:
            buf.commit()
        return buf.orig

    return _run(g, body, async_op, "reduce", x)


def reduce_scatter(x, op: str = "sum", *, out=None, async_op: bool = False, group: Group | None = None):
    """Reduce the flat ``x`` over ranks and return this rank's part of it, a 1-D array/tensor:
    parts split as ``np.array_split`` (sizes need not divide evenly). ``out``: written with
    the part and returned instead (``x``'s type, dtype and device, the part's number of
    elements in any shape, as ``torch.distributed.reduce_scatter_tensor``'s output)."""
    g = _g(group)
    code = kreduce.op_code(op)
    q, r = divmod(_numel(x), g.size)
    n = q + (1 if g.rank < r else 0)
    if _read_only(out):  # NOTE [a read-only array a collective writes]
        reduce_scatter(x, op, out=np.empty_like(out), group=g)
        raise _refused("reduce_scatter", "out", g)
    if out is not None:
        x = _input_for_out(x, out, n, "reduce_scatter")
    if not async_op:  # the latency path (NOTE [one-shot copies] 6 in comm/algorithms/oneshot.py)
        arr = plain_array(x)
        maker = _maker(x, arr, out) if arr is not None else None
        if maker is not None:
            made = select.reduce_scatter_small(g, arr, code, maker)
            if made is not None:
                return made
    buf = Buffer(x, "x")
    made, obuf = _result(buf, (n,), out)

    def body():
        select.reduce_scatter(g, buf, obuf.flat, code)
        return _delivered(made, obuf, out, x)

    return _run(g, body, async_op, "reduce_scatter", x)


def barrier(*, async_op: bool = False, group: Group | None = None):
    g = _g(group)
    return _run(g, lambda: select.barrier(g), async_op, "barrier", None)


def send(x, dest: int, tag: int = 0, *, group: Group | None = None) -> None:
    """Blocking point-to-point send of ``x`` to rank ``dest`` (over MPI)."""
    g = _g(group)
    _check_root(dest, g, "dest")
    select.send(g, Buffer(x, "x"), dest, tag)


def recv(x, source: int, tag: int = 0, *, group: Group | None = None):
    """Blocking receive into ``x`` (whose shape and dtype must match the sender's)."""
    g = _g(group)
    _check_root(source, g, "source")
    if _read_only(x):  # NOTE [a read-only array a collective writes]
        recv(np.empty_like(x), source, tag, group=g)
        raise _refused("recv", "x", g)
    buf = Buffer(x, "x")
    select.recv(g, buf, source, tag)
    buf.commit()
    return x


def broadcast_object(obj, root: int = 0, *, group: Group | None = None):
    """Pickle ``obj`` on ``root`` and return it on every rank (small control data: configs,
    optimizer state)."""
    import pickle

    g = _g(group)
    _check_root(root, g)
    if g.size == 1:
        return obj
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if g.rank == root else np.empty(0, np.uint8)
    n = np.array([payload.size], np.int64)
    broadcast(n, root, group=g)
    if g.rank != root:
        payload = np.empty(int(n[0]), np.uint8)
    broadcast(payload, root, group=g)
    return obj if g.rank == root else pickle.loads(payload.tobytes())


def _read_only(x) -> bool:
    """Whether ``x`` is a NumPy array that cannot be written (torch tensors always can)."""
    return isinstance(x, np.ndarray) and not x.flags.writeable


def _stand_ins(items: list) -> tuple[list, str]:
    """``items`` with a private copy in place of each read-only array, and the read-only ones'
    names (``"tensors[i], ..."``; empty when there are none)."""
    read_only = [i for i, t in enumerate(items) if _read_only(t)]
    if not read_only:  # the common case: nothing is copied or built
        return items, ""
    stand_ins = [t.copy() if i in read_only else t for i, t in enumerate(items)]
    return stand_ins, ", ".join(f"tensors[{i}]" for i in read_only)


def _refused(coll: str, name: str, g: Group) -> ValueError:
    """The error of a rank whose ``name`` is read-only where ``coll`` writes its result
    (NOTE [a read-only array a collective writes])."""
    return ValueError(f"{coll}: {name} is read-only on rank {g.rank}, where the call writes its result; "
                      f"this rank took part with a copy, so the peers completed the call")


def _check_root(root: int, g: Group, name: str = "root") -> None:
    if not 0 <= root < g.size:
        raise ValueError(f"{name}={root} is outside a group of {g.size} ranks")


def jit_allreduce(tensors, op: str = "avg", compression: str | None = None, *,
                  async_op: bool = False, group: Group | None = None):
    """The CPU-staged gradient path: allreduce a list of tensors (or one) as one fused buffer.

    Tensors are grouped by dtype; each group is reduced as one buffer made of the tensors' own
    memory (no staging copy of the whole group): through the node's shared segment in chunks
    (copy in, reduce-scatter with the JIT kernels, allreduce of each part across nodes over MPI,
    all-gather, copy out), or through the MPI ring for large groups on one node. With
    ``compression="bf16"`` or ``"fp16"`` float32 tensors travel as 16-bit values and are
    accumulated in float32. In place; returns the list (or a Handle).

    CUDA tensors (one device per call) are copied on a side stream, in pieces, while the chunks
    already there are reduced, and each reduced piece is copied back at once (NOTE [staging
    streams] in comm/staging.py): on one node straight into and out of the node's shared rows
    (NOTE [staged rows] in comm/algorithms/staged_rows.py), otherwise through one pinned host
    buffer. The host never waits for the whole device: when the call returns (or
    ``Handle.wait()`` does), the caller's current stream is ordered after the copies back, so
    work queued on it sees the result. Until then the tensors belong to the collective.
    """
    g = _g(group)
    code = kreduce.op_code(op)
    single = not isinstance(tensors, (list, tuple))
    items = [tensors] if single else list(tensors)
    stand_ins, read_only = _stand_ins(items)
    if read_only:  # NOTE [a read-only array a collective writes]
        jit_allreduce(stand_ins, op, compression, group=g)
        raise _refused("jit_allreduce", read_only, g)
    ckind = {None: 0, "bf16": BF16, "bfloat16": BF16, "fp16": F16, "float16": F16}.get(compression, -1)
    if ckind < 0:
        raise ValueError(f"compression: expected None, 'bf16' or 'fp16', got {compression!r}")
    if len(items) == 1 and not async_op:
        # One tensor, alone or in a list (a small gradient bucket): the latency path, whose
        # signature is the one the general path below would agree on (elements, tensor count).
        arr = plain_array(items[0])
        use_c = ckind if arr is not None and arr.dtype == np.float32 else 0
        if arr is not None and select.allreduce_small(g, arr, code, "jit_allreduce", use_c, (arr.size, 1)):
            return tensors
    # One plan per dtype: the Buffers of host tensors, or a StagedGroup when CUDA tensors are
    # among them (pinned staging overlapped with the reduction: NOTE [staging streams]).
    groups: dict[str, list] = {}
    for i, t in enumerate(items):
        m = t if _is_cuda(t) else Buffer(t, f"tensors[{i}]")
        name = m.dtype_name if isinstance(m, Buffer) else _torch_dtype_name(t)
        groups.setdefault(name, []).append((i, m))
    plans = []
    for name in sorted(groups):
        members = [m for _, m in groups[name]]
        if all(isinstance(m, Buffer) for m in members):
            plans.append((name, members, None))
        else:
            from .staging import StagedGroup  # imports torch: only when CUDA tensors come

            names = [f"tensors[{i}]" for i, _ in groups[name]]
            plans.append((name, members, StagedGroup(members, names, g)))  # records the producer

    def body():
        for name, members, staged in plans:
            use_c = ckind if name == "float32" else 0
            if staged is not None:
                with timeline.span("comm", "staging: host views made"):
                    staged.start()
                views, kind = staged.views, staged.kind
            else:
                views, kind = [b.flat for b in members], members[0].kind
            n = sum(v.shape[0] for v in views)
            sig = _Sig(name, n, (n, len(views)))  # dtype, total elements, tensor count
            select.allreduce_views(g, views, views, code, kind, use_c, coll="jit_allreduce", sig_buf=sig,
                                   gate=staged or NO_GATE)
            if staged is not None:
                with timeline.span("comm", "staging: copies to device queued"):
                    staged.finish()
            else:
                for b in members:
                    b.commit()
        return tensors

    return _run(g, body, async_op, "jit_allreduce", items)


_ADASUM_DTYPES = ("float16", "bfloat16", "float32", "float64")


def adasum_allreduce(tensors, *, async_op: bool = False, group: Group | None = None):
    """Adasum of each tensor over the group's ranks (Horovod's ``op=hvd.Adasum``), in place.

    Each tensor is combined with its own coefficients, pairwise up a tree of ranks: two ranks'
    gradients ``a`` and ``b`` become ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``, their sum
    where they are orthogonal and their average where they are parallel (kernels/adasum.py;
    NOTE [adasum by halves] in comm/algorithms/adasum.py). ``tensors``: one or a list of
    float16 / bfloat16 / float32 / float64 arrays or tensors (CPU or CUDA, the latter through
    host memory), the same shapes on every rank; a group of a power of two of ranks. Dot
    products and norms are summed in float64. Each dtype's tensors are fused into one vector
    (a copy, unless it is one contiguous tensor). Returns ``tensors`` (or a Handle); until then
    they belong to the collective.
    """
    g = _g(group)
    if g.size & (g.size - 1):
        raise ValueError(f"adasum_allreduce: needs a power of two of ranks; this group has {g.size}")
    single = not isinstance(tensors, (list, tuple))
    items = [tensors] if single else list(tensors)
    if not items:
        raise ValueError("adasum_allreduce: no tensors given")
    stand_ins, read_only = _stand_ins(items)
    if read_only:  # NOTE [a read-only array a collective writes]
        adasum_allreduce(stand_ins, group=g)
        raise _refused("adasum_allreduce", read_only, g)
    bufs = [Buffer(t, f"tensors[{i}]") for i, t in enumerate(items)]
    groups: dict[str, list[Buffer]] = {}
    for i, b in enumerate(bufs):
        if b.dtype_name not in _ADASUM_DTYPES:
            raise TypeError(f"adasum_allreduce: tensors[{i}] is {b.dtype_name}; Adasum combines "
                            f"floating-point tensors ({', '.join(_ADASUM_DTYPES)})")
        groups.setdefault(b.dtype_name, []).append(b)

    def body():
        for name in sorted(groups):
            members = groups[name]
            sizes = [b.size for b in members]
            bounds = np.array([0, *itertools.accumulate(sizes)], np.int64)
            # Each tensor's length is part of the signature (its coefficients are its own); past
            # the signature's room, their count and a digest of them.
            shape = tuple(sizes) if len(sizes) <= 14 else (len(sizes), zlib.crc32(bounds.tobytes()))
            if g.size == 1:
                continue
            fused = members[0].flat if len(members) == 1 else np.concatenate([b.flat for b in members])
            adasum.allreduce(g, fused, bounds, members[0].kind, adasum.Called(name, int(bounds[-1]), shape))
            if len(members) > 1:
                for b, lo, hi in zip(members, bounds[:-1], bounds[1:], strict=True):
                    b.flat[...] = fused[lo:hi]
        for b in bufs:
            b.commit()
        return tensors

    return _run(g, body, async_op, "adasum_allreduce", items)


def cuda_collectives(group: Group | None = None) -> str:
    """How collectives of CUDA tensors on ``group`` (default: the world) run on this rank:
    "nccl" (NCCL's own, on the caller's stream) or "staged" (through host memory). Local; the
    group decides collectively at its first NCCL collective, and this answers that decision
    once made (NOTE [algorithm selection] 1 in comm/select.py)."""
    return select.select(_g(group), Request("allreduce", cuda=True))


def _wants_nccl(g: Group, x, coll: str) -> bool:
    """Whether this rank asks for NCCL's own ``coll`` of ``x`` (NOTE [algorithm selection] 1)."""
    return _is_cuda(x) and select.select(g, Request(coll, cuda=True)) == "nccl"


def _is_cuda(x) -> bool:
    torch = sys.modules.get("torch")  # a CUDA tensor implies torch is imported
    return torch is not None and isinstance(x, torch.Tensor) and x.is_cuda


def _torch_dtype_name(t) -> str:
    """A tensor's dtype as Buffer names it ("float32", "bfloat16", ...), without a Buffer."""
    return str(t.dtype).removeprefix("torch.")


def _maker(x, arr: np.ndarray, out=None):
    """``make_out`` for the latency paths of select (gather_small, reduce_scatter_small):
    ``make_out(shape)`` is a new array of ``x``'s type and dtype (a CPU tensor for a tensor)
    and its NumPy view, made only once the latency path takes the call; or ``out`` (checked by
    :func:`_input_for_out`) and its view in that shape, or None where ``out`` has no plain view (a
    strided, bfloat16 or CUDA one: the general path then takes the call)."""
    if out is not None:
        view = plain_array(out)
        if view is None:
            return None

        def given(shape: tuple):
            return out, view.reshape(shape)
        return given
    if type(x) is np.ndarray:
        def array(shape: tuple):
            a = np.empty(shape, arr.dtype)
            return a, a
        return array

    def tensor(shape: tuple):
        t = sys.modules["torch"].empty(shape, dtype=x.dtype)
        return t, t.numpy()
    return tensor


def _numel(x) -> int:
    """Elements of an array or tensor (``x.size`` is a method on a tensor)."""
    if isinstance(x, np.ndarray):
        return x.size
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a numpy array or torch tensor, got {type(x).__name__}")
    return x.numel()


def _input_for_out(x, out, count: int, coll: str):
    """``x`` for a collective that writes its result of ``count`` elements into ``out``, copied
    where the two overlap (:func:`_unaliased`); raise unless ``out`` can take the result: ``x``'s
    dtype, the same type of container (a NumPy array, or a tensor on ``x``'s device)."""
    if isinstance(x, np.ndarray):
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{coll}: out must be a numpy array like x, got {type(out).__name__}")
        same = out.dtype == x.dtype and out.size == count
        where = ""
    else:
        torch = sys.modules["torch"]  # x is a tensor, so torch is imported
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{coll}: out must be a tensor like x, got {type(out).__name__}")
        same = out.dtype == x.dtype and out.numel() == count and out.device == x.device
        where = f" on {x.device}"
    if not same:
        got = f"{out.dtype} of {_numel(out)} elements" + (f" on {out.device}" if where else "")
        raise ValueError(f"{coll}: out must be {x.dtype} of {count} elements{where}, got {got}")
    return _unaliased(x, out)


def _unaliased(x, out):
    """``x``, or a private copy of it where its memory may overlap ``out``'s: an in-place
    allgather (``x`` a block of ``out``, as FSDP's all-gather passes it) or a part written over
    its own input. MPI refuses aliased buffers ("Buffers must not be aliased"), and a transport
    that writes ``out`` while it still reads ``x`` would read what it wrote. The copy is of
    ``x`` alone, 1 / size of an allgather's result."""
    if isinstance(x, np.ndarray):
        return x.copy() if np.may_share_memory(x, out) else x
    if x.numel() == 0 or out.numel() == 0:  # empty storages may all have address 0
        return x
    return x.clone() if x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() else x


def _result(buf: Buffer, shape: tuple, out):
    """A general path's result and its Buffer: a new one of ``buf``'s type in ``shape``, or
    ``out``'s (checked by :func:`_input_for_out`)."""
    return buf.like(shape) if out is None else (out, Buffer(out, "out"))


def _delivered(made, obuf: Buffer, out, x):
    """The result :func:`_result` made, once written: ``out`` with its Buffer committed (strided
    or device memory written back), or the new result on ``x``'s device."""
    if out is None:
        return _like_input(made, x)
    obuf.commit()
    return out


def _like_input(out, x):
    """A result made in host memory, moved to ``x``'s device when ``x`` is a CUDA tensor."""
    return out.to(x.device) if _is_cuda(x) else out


class _Sig:
    """What a signature is made of (Group.signature), without a Buffer's copy of the data."""

    def __init__(self, dtype_name: str, size: int, shape: tuple) -> None:
        self.dtype_name = dtype_name
        self.size = size
        self.shape = shape


__all__ += ["Handle", "Group"]
