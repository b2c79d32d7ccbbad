"""``ProcessGroupTerrapipe``: a torch.distributed process group over terrapipe's transports.

NOTE [the terrapipe process group]
    torch (2.13) accepts a pure-Python subclass of ``torch.distributed.ProcessGroup`` from a
    registered backend's creator and calls its methods directly: from ``dist.all_reduce`` and
    friends, from DDP's reducer (one flat bucket per ``allreduce``, completion through
    ``get_future()``), from FSDP2 and the functional collectives. How this group serves them:
    1. Data moves through a :class:`terrapipe.comm.Group`, with the same signature agreement as
       every terrapipe collective, so a shape, dtype or root mismatch raises on every rank
       instead of corrupting data or hanging. Under an MPI launcher (``mpiexec``, ``terrapipe
       run``) whose ranks are torch's ranks, the group is made over MPI (shared memory on each
       node, MPI between nodes and for the ring, as ``terrapipe.comm`` routes them); else it is
       set up through the store torch hands the backend (no MPI needed; under MPI too with
       ``TERRAPIPE_COMM_BACKEND=shm``): shared memory between the ranks of one machine, and
       where they span machines of as many ranks each (torchrun across nodes), shared memory on
       each machine of two or more and TCP rings between the machines (NOTE [machines over
       Gloo] in comm/group.py), allreduces hierarchical. The ranks decide which together,
       through the store.
    2. An asynchronous call (``opts.asyncOp``, which DDP's reducer and ``async_op=True`` set)
       returns at once. The transfer runs on the group's ordered executor thread, which releases
       the GIL inside the kernels, so backward keeps running on the caller's thread while a
       bucket is reduced. The returned ``Work`` wraps a ``torch.futures.Future`` completed on
       that thread with the output tensors (``[tensor]`` for allreduce, what DDP's hooks read
       with ``fut.value()[0]``), or with the error. Where the outputs are CUDA tensors the
       future is made for their devices, as a NCCL Work's is: completing it records an event on
       the completing thread's current stream, and a consumer's ``wait()`` makes its own current
       stream wait for that event. A synchronous call (``dist.all_reduce``
       without ``async_op``) runs on the caller's thread, in order after anything outstanding,
       and takes terrapipe's latency path: no thread hand-off for the 4 KiB allreduce.
    3. What the shared-memory transport does not do (point-to-point, all-to-all, gather and
       scatter of lists, bitwise reductions, dtypes the reduction kernels do not cover; ranks on
       machines of unequal rank counts) goes to a Gloo process group built on the same store
       beside it, so every call of the ProcessGroup API behaves as on Gloo. It is never the Gloo
       group the terrapipe group itself calls across machines: two threads enqueueing on one
       Gloo group could order their calls differently on different ranks. Each channel keeps
       its own issue order, identical on every rank; as with any async collective, a result is
       read after ``wait()``.
    4. Timeouts: the group's timeout (``init_process_group(timeout=)``) bounds every wait on
       another rank; a late rank is named in the CollectiveTimeoutError, and the group is then
       unusable, as a Gloo group is after a timeout.
    5. torchrun's restarts (``--max-restarts``) hand every attempt's workers the same store, the
       agent's, still holding the last attempt's keys (torch 2.13): the group's keys go under the
       attempt's number (``TORCHELASTIC_RESTART_COUNT``), so a restarted group never reads a dead
       worker's Gloo address or segment name. (torch's own Gloo backend reads them: a restarted
       ``backend="gloo"`` job fails in Gloo's connectFullMesh, "Connection refused".)
    6. A synchronous call over host tensors returns a :class:`_Completed` Work: done when made,
       its future made only where someone asks for it (``get_future()``), since torch's own
       wrapper only calls ``wait()`` and drops it. A future made and completed per call, and
       the chaining of already finished results, were half the Python a small
       ``dist.all_reduce`` paid in this class (AMD EPYC, the transfer itself stubbed out: 5.3
       -> 2.6 us a call here, 6.9 -> 4.1 with torch's wrapper). Where ranks share cores that
       counts several times over: at 4 emulated machines x 1 over 1gbit, 4 KiB,
       ``dist.all_reduce`` took 1.44-1.63x the time of ``comm.allreduce`` of a NumPy array,
       interleaved in one run, before, and 1.38-1.50x after.

Why one module: torch calls one ProcessGroup class; its methods are thin adapters from
torch's option objects to terrapipe.comm, and the NOTE above ties them together.
"""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from .. import launch_env
from ..comm import DTYPES, OPS, Group, Handle, StoreComm, forced_backend, node_of
from ..comm import allgather as _allgather
from ..comm import allreduce as _allreduce
from ..comm import broadcast as _broadcast
from ..comm import jit_allreduce as _jit_allreduce
from ..comm import reduce as _reduce
from ..comm import reduce_scatter as _reduce_scatter

__all__ = ["ProcessGroupTerrapipe", "create"]



class _Work(dist.Work):
    """A Work over a torch future: ``wait()`` raises the collective's error (a Work made by
    ``_create_work_from_future`` reports success even when its future failed), and
    ``get_future()`` is the future itself, completed with the output tensors."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._fut.wait()  # re-raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self):
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None


class _Completed(dist.Work):
    """A synchronous call's Work over host tensors, done when made (the transfer ran on the
    caller's thread): its future, completed with ``value``, is made only where someone asks
    for it (NOTE [the terrapipe process group] 6)."""

    def __init__(self, value) -> None:
        super().__init__()
        self._value = value
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            self._fut = torch.futures.Future()
            self._fut.set_result(self._value)
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None


_RED = dist.ReduceOp.RedOpType
# What terrapipe.comm reduces (its kernels) and moves; the rest goes to Gloo.
_REDUCIBLE = {getattr(torch, d.name) for d in DTYPES if d.reduced}
_COPYABLE = {getattr(torch, d.name) for d in DTYPES if hasattr(torch, d.name)}
# By the enum's integer value: pybind11's enums hash and compare in about a microsecond each,
# which every small collective paid twice (an int's cost is a tenth of that).
_OPS = {int(getattr(_RED, op.torch)): op.name for op in OPS}
_PREMUL_SUM = int(_RED.PREMUL_SUM)


def _op_of(op) -> tuple[str | None, float | torch.Tensor | None]:
    """(terrapipe op name or None for "Gloo's", premultiply factor or None)."""
    kind = int(getattr(op, "op", op))
    if kind == _PREMUL_SUM:
        return "sum", op.factor if hasattr(op, "factor") else None
    return _OPS.get(kind), None


class _Done:
    """A synchronous call's result where a finish function reads ``wait()`` of a handle."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def wait(self):
        return self.value


def _future_for(outputs: Sequence[torch.Tensor]) -> torch.futures.Future:
    """A future for a Work whose value holds ``outputs``: made for their devices where they are
    CUDA tensors, as a NCCL Work's is (NOTE [the terrapipe process group] 2)."""
    devices = sorted({t.device for t in outputs if t.is_cuda}, key=str)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _finished(value, outputs: Sequence[torch.Tensor]) -> dist.Work:
    """The Work of a synchronous call that finished with ``value`` (holding ``outputs``): over
    host tensors a :class:`_Completed`, no future made unless asked for (NOTE [the terrapipe
    process group] 6); over CUDA tensors a future completed now, for their devices."""
    for t in outputs:
        if t.is_cuda:
            fut = _future_for(outputs)
            fut.set_result(value)
            return _Work(fut)
    return _Completed(value)


def _as_handle(value) -> Handle:
    """A comm Handle, or a synchronous call's result as an already finished one."""
    if isinstance(value, Handle):
        return value
    f: Future = Future()
    f.set_result(value)
    return Handle(f)


def _fusable(small: Sequence[torch.Tensor], large: Sequence[torch.Tensor], p: int) -> bool:
    """Pairs that one collective can carry: every tensor of one dtype on the host, each of
    ``large`` ``p`` times the elements of its partner in ``small``."""
    if not small or len(small) != len(large):
        return False
    dtype = small[0].dtype
    return all(s.dtype == dtype and b.dtype == dtype and not s.is_cuda and not b.is_cuda
               and s.is_contiguous() and b.is_contiguous()
               and b.numel() == p * s.numel() for s, b in zip(small, large, strict=True))


def _async(opts) -> bool:
    return bool(getattr(opts, "asyncOp", True))


class ProcessGroupTerrapipe(dist.ProcessGroup):
    """The ``"terrapipe"`` torch.distributed backend (NOTE [the terrapipe process group]).

    Made by torch from ``dist.init_process_group(backend="terrapipe")`` and ``dist.new_group``
    (through :func:`create`); not constructed by hand. store: the group's store; rank/size: in
    the group; timeout: per collective.
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: Sequence[int] = ()) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        # Calls served by terrapipe's transports ("terrapipe") vs handed to Gloo ("gloo"): for
        # tests, and for anyone wondering where their collectives go.
        self.served: collections.Counter[str] = collections.Counter()
        seconds = timeout.total_seconds()
        store = dist.PrefixStore(f"attempt{launch_env.restart_count()}/", store)  # NOTE 5 above
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        # torch keeps a group's name (what functional collectives resolve it by) on its
        # backends; the Gloo one beside us carries it. Calls still come to these methods.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)
        self._group: Group | None = _mpi_group(store, rank, size, list(global_ranks), seconds)
        if self._group is None:
            self._group = _group_over_store(store, rank, size, seconds)

    # -- plumbing ------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "terrapipe"

    @property
    def group(self) -> Group | None:
        """The terrapipe group carrying this process group's collectives (None: all on Gloo)."""
        return self._group

    def _ours(self, tensors: Sequence[torch.Tensor], dtypes=_COPYABLE) -> bool:
        return self._group is not None and all(t.dtype in dtypes and not t.is_sparse for t in tensors)

    def _chain(self, handles: list, finish: Callable[[], object],
               outputs: Sequence[torch.Tensor] = ()) -> dist.Work:
        """A Work completed with ``finish()`` once every comm handle in ``handles`` is done
        (a synchronous call's results count as done handles). ``outputs``: the tensors the
        value holds; where they are CUDA tensors the future is made for their devices, as a
        NCCL Work's is, so a consumer's ``wait()`` makes its current stream wait for the
        result (NOTE [the terrapipe process group] 2)."""
        self.served["terrapipe"] += 1
        if not any(isinstance(h, Handle) for h in handles):
            # Synchronous calls, already done: nothing to chain. Made per call, a comm Handle and
            # its callbacks were most of the Python a small synchronous all_reduce paid here.
            handles[:] = [_Done(h) for h in handles]
            try:
                value = finish()
            except Exception as e:  # noqa: BLE001 (the caller's wait() raises it)
                fut = _future_for(outputs)
                fut.set_exception(e)
                return _Work(fut)
            return _finished(value, outputs)
        fut = _future_for(outputs)
        handles[:] = [_as_handle(h) for h in handles]
        left = [len(handles)]
        lock = threading.Lock()  # finished handles call back on this thread, the rest on the group's

        def one(f) -> None:
            exc = f.exception()
            with lock:
                if fut.done():
                    return
                if exc is not None:
                    fut.set_exception(exc)
                    return
                left[0] -= 1
                if left[0]:
                    return
                try:
                    value = finish()
                except Exception as e:  # noqa: BLE001 (the caller's wait() raises it)
                    fut.set_exception(e)
                    return
            fut.set_result(value)

        for h in handles:
            h.future.add_done_callback(one)
        if not handles:
            fut.set_result(finish())
        return _Work(fut)

    def _body(self, body: Callable[[], object]) -> dist.Work:
        """``body`` on the group's ordered executor; the Work completes with its result."""
        handle = self._group.run(body, True)
        return self._chain([handle], lambda: handle.wait())

    @property
    def _g(self) -> dist.ProcessGroup:
        """The Gloo group, counted (NOTE [the terrapipe process group] 3)."""
        self.served["gloo"] += 1
        return self._gloo

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        op, factor = _op_of(opts.reduceOp)
        if op is None or not self._ours(tensors, _REDUCIBLE):
            return self._g.allreduce(tensors, opts)
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        if not _async(opts):  # on this thread, in order after anything outstanding (NOTE 2, 6)
            for t in tensors:
                _allreduce(t, op, group=self._group)
            self.served["terrapipe"] += 1
            return _finished(list(tensors), tensors)
        handles = [_allreduce(t, op, async_op=True, group=self._group) for t in tensors]
        return self._chain(handles, lambda: list(tensors), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """One fused collective per dtype for host tensors (``jit_allreduce``: one agreement,
        the tensors reduced as one buffer, in place); what ``dist._coalescing_manager`` and
        ``all_reduce_coalesced`` call."""
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        op, factor = _op_of(opts.reduceOp)
        if (op is None or not self._ours(tensors, _REDUCIBLE) or not tensors
                or any(t.is_cuda for t in tensors)):
            return self.allreduce(tensors, opts)
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        h = _jit_allreduce(list(tensors), op, async_op=_async(opts), group=self._group)
        return self._chain([h], lambda: list(tensors), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        if not self._ours(tensors):
            return self._g.broadcast(tensors, opts)
        a = _async(opts)
        handles = [_broadcast(t, opts.rootRank, async_op=a, group=self._group) for t in tensors]
        return self._chain(handles, lambda: list(tensors), tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._ours(inputs) or any(o.shape != inputs[0].shape or o.dtype != inputs[0].dtype
                                         for outs in output_lists for o in outs):
            return self._g.allgather(output_lists, inputs, opts)
        for outs in output_lists:
            if len(outs) != self.size():
                raise ValueError(f"allgather: {len(outs)} output tensors for a group of {self.size()}")
        a = _async(opts)
        handles = [_allgather(t, async_op=a, group=self._group) for t in inputs]

        def finish():
            for outs, h in zip(output_lists, handles, strict=True):
                stacked = h.wait()
                for r, o in enumerate(outs):
                    o.copy_(stacked[r])
            return output_lists

        return self._chain(handles, finish, [o for outs in output_lists for o in outs])

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._g.allgather_coalesced(output_lists, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        if not self._ours([input, output]) or output.numel() != input.numel() * self.size():
            return self._g._allgather_base(output, input, opts)
        if output.dtype == input.dtype and output.device == input.device:
            # straight into the output: no result allocated and copied per call
            h = _as_handle(_allgather(input, out=output, async_op=_async(opts), group=self._group))
            return self._chain([h], lambda: [h.wait()], [output])
        h = _as_handle(_allgather(input, async_op=_async(opts), group=self._group))

        def finish():
            output.view(-1).copy_(h.wait().reshape(-1))
            return [output]

        return self._chain([h], finish, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        """Inputs of one dtype: one allgather of their concatenation, cut back into each output
        (``(size * n_i)`` each); otherwise one call per pair."""
        opts = opts if opts is not None else c10d.AllgatherOptions()
        p = self.size()
        if not (_fusable(inputs, outputs, p) and self._ours([*inputs, *outputs])):
            works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
            return self._all_of(works, outputs)
        fused = torch.cat([i.reshape(-1) for i in inputs])
        h = _as_handle(_allgather(fused, async_op=_async(opts), group=self._group))

        def finish():
            rows = h.wait().reshape(p, -1)
            o = 0
            for out, i in zip(outputs, inputs, strict=True):
                out.view(p, -1).copy_(rows[:, o:o + i.numel()])
                o += i.numel()
            return outputs

        return self._chain([h], finish, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_of(self, works: list[dist.Work], value) -> dist.Work:
        def check(f):
            for x in f.value():
                x.value()  # raises the first error into the combined future
            return value

        return _Work(torch.futures.collect_all([w.get_future() for w in works]).then(check))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        op, _ = _op_of(opts.reduceOp)  # a premultiply factor is applied by reduce_scatter_single
        flat_ok = all(len(ins) == self.size() and all(i.shape == outs.shape for i in ins)
                      for outs, ins in zip(outputs, input_lists, strict=True))
        if op is None or not flat_ok or not self._ours(outputs, _REDUCIBLE):
            return self._g.reduce_scatter(outputs, input_lists, opts)
        works = [self.reduce_scatter_single(o, torch.cat([i.reshape(-1) for i in ins]), opts)
                 for o, ins in zip(outputs, input_lists, strict=True)]
        return self._all_of(works, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        op, factor = _op_of(opts.reduceOp)
        if (op is None or not self._ours([input, output], _REDUCIBLE)
                or input.numel() != output.numel() * self.size()):
            return self._g._reduce_scatter_base(output, input, opts)
        if factor is not None:
            input = input * factor
        if output.dtype == input.dtype and output.device == input.device:
            # straight into the output: no part allocated and copied per call
            h = _as_handle(_reduce_scatter(input.contiguous(), op, out=output, async_op=_async(opts),
                                           group=self._group))
            return self._chain([h], lambda: [h.wait()], [output])
        h = _as_handle(_reduce_scatter(input.contiguous(), op, async_op=_async(opts), group=self._group))

        def finish():
            output.view(-1).copy_(h.wait())
            return [output]

        return self._chain([h], finish, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        """Pairs of one dtype: one reduce-scatter of the inputs side by side (rank r's parts of
        every input in row r), cut back into each output; otherwise one call per pair."""
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        op, factor = _op_of(opts.reduceOp)
        p = self.size()
        if (op is None or not _fusable(outputs, inputs, p)
                or not self._ours([*inputs, *outputs], _REDUCIBLE)):
            works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
            return self._all_of(works, outputs)
        fused = torch.cat([i.reshape(p, -1) for i in inputs], dim=1).reshape(-1)
        if factor is not None:
            fused.mul_(factor)
        h = _as_handle(_reduce_scatter(fused, op, async_op=_async(opts), group=self._group))

        def finish():
            mine = h.wait().reshape(-1)
            o = 0
            for out in outputs:
                out.view(-1).copy_(mine[o:o + out.numel()])
                o += out.numel()
            return outputs

        return self._chain([h], finish, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceOptions()
        op, factor = _op_of(opts.reduceOp)
        if op is None or not self._ours(tensors, _REDUCIBLE):
            return self._g.reduce(tensors, opts)
        if factor is not None:
            for t in tensors:
                t.mul_(factor)
        a = _async(opts)
        handles = [_reduce(t, op, opts.rootRank, async_op=a, group=self._group) for t in tensors]
        return self._chain(handles, lambda: list(tensors), tensors)

    def barrier(self, opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.BarrierOptions()
        if self._group is None:
            return self._g.barrier(opts)
        # After every collective issued before it, on both channels (NOTE 3).
        gloo = self._gloo

        def body():
            self._group.barrier()
            gloo.barrier(opts).wait()
            return []

        return self._body(body)

    # -- on Gloo (NOTE [the terrapipe process group] 3) ------------------------------------------
    def gather(self, outputs, inputs, opts=None) -> dist.Work:
        return self._g.gather(outputs, inputs, opts if opts is not None else c10d.GatherOptions())

    def scatter(self, outputs, inputs, opts=None) -> dist.Work:
        return self._g.scatter(outputs, inputs, opts if opts is not None else c10d.ScatterOptions())

    def alltoall(self, outputs, inputs, opts=None) -> dist.Work:
        return self._g.alltoall(outputs, inputs, opts if opts is not None else c10d.AllToAllOptions())

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._g.alltoall_base(output, input, output_splits, input_splits, opts)

    alltoall_base = all_to_all_single

    def send(self, tensors, dst: int, tag: int = 0) -> dist.Work:
        return self._g.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0) -> dist.Work:
        return self._g.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0) -> dist.Work:
        return self._g.recv_anysource(tensors, tag)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        return self._g.monitored_barrier(timeout if timeout is not None else self._timeout, wait_all_ranks)

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def abort(self) -> None:
        self.shutdown()


def _mpi_group(store, rank: int, size: int, global_ranks: list[int], timeout: float) -> Group | None:
    """A group over MPI when every rank of this one was started by an MPI launcher whose world
    ranks are torch's global ranks (NOTE [the terrapipe process group] 1), else None. Decided
    together through the store, so no rank goes to MPI alone."""
    ranks = global_ranks or list(range(size))
    mine = False
    # TERRAPIPE_COMM_BACKEND=shm: shared memory only, the group torchrun's ranks get
    if launch_env.mpi_launched() and forced_backend() != "shm":
        try:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            me = ranks[rank] if rank < len(ranks) else -1
            mine = world.Get_rank() == me and max(ranks) < world.Get_size()
        except ImportError:
            mine = False
    votes = StoreComm(dist.PrefixStore("mpi/", store), "vote", rank, size, timeout).allgather(mine)
    if not all(votes):
        return None
    comm = world.Create_group(world.Get_group().Incl(ranks))
    return Group(comm, timeout)


def _group_over_store(store, rank: int, size: int, timeout: float) -> Group | None:
    """Without MPI (NOTE [the terrapipe process group] 1): shared memory where every rank is on
    this machine; across machines of as many ranks each, shared memory on each where they hold
    two or more, TCP rings between them and a Gloo group of its own (NOTE [machines over Gloo]
    in comm/group.py); else None, everything on Gloo (3). Decided alike on every rank, from
    every rank's machine."""
    nodes = StoreComm(dist.PrefixStore("nodes/", store), "n", rank, size, timeout).allgather(node_of())
    if len(set(nodes)) == 1:
        return Group.over_store(dist.PrefixStore("shm/", store), "g", rank, size, timeout)
    if Group.spans_machines_evenly(nodes):
        return Group.over_store_across_machines(dist.PrefixStore("machines/", store), "g", rank, size,
                                                nodes, timeout)
    return None


def create(opts, backend_options=None) -> ProcessGroupTerrapipe:
    """The creator torch calls for ``backend="terrapipe"`` (extended API)."""
    return ProcessGroupTerrapipe(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                 list(opts.global_ranks_in_group or ()))
