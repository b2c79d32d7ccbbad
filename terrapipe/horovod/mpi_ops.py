"""horovod.torch's collectives on torch tensors: plain, in-place (``_``), async (``_async``,
with :func:`poll` / :func:`synchronize`) and grouped forms, autograd through them as Horovod
defines it, and the object collectives.

Every call becomes an Entry on its process set's Coordinator (NOTE [name negotiation] in
negotiation.py): matched by ``name`` across ranks, in any order. Outputs are allocated here, in
the caller's thread; until :func:`synchronize` returns, the input (and for ``_`` forms the
output) belongs to the collective.

Why one module: ``horovod.torch.mpi_ops`` is one module in Horovod, and scripts import
names from it directly; every function here is that API's.
"""

from __future__ import annotations

import io
import json
import pickle
import threading
import warnings

import numpy as np
import torch

from .. import timeline
from . import basics
from .basics import ProcessSet, global_process_set
from .compression import Compression, wire_format
from .errors import TensorArgumentError
from .execute import ADASUM, AVERAGE, MAX, MIN, OP_NAMES, PRODUCT, SUM, dtype_name
from .negotiation import JOIN, Entry

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async",
    "poll", "synchronize", "join", "barrier", "broadcast_object", "allgather_object",
]

Average, Sum, Adasum, Min, Max, Product = AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT

_handles: dict[int, tuple[Entry, object]] = {}
_handles_lock = threading.Lock()
_next_handle = 0


# -- issuing -----------------------------------------------------------------------------------
def _op_from(op, average) -> int:
    """Horovod's rule: ``op`` wins, ``average`` is deprecated, the default is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    elif average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    else:
        op = Average
    op = int(op)
    if op not in OP_NAMES:
        raise ValueError(f"op: expected one of Average, Sum, Min, Max, Product, got {op!r}")
    return op


def _tensors(tensors, what: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:
        raise TensorArgumentError(f"{what}: no tensors given")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise TensorArgumentError(f"{what}: tensors are on different devices ({sorted(devices)}); "
                                  "a grouped collective needs them on one")
    return tensors


def _spec(t: torch.Tensor, free_dim0: bool = False) -> list:
    shape = list(t.shape)
    if free_dim0:
        shape = [-1, *shape[1:]]
    return [dtype_name(t), shape]


def _describe(kind: str, name: str, tensors: list[torch.Tensor], extra: str = "") -> str:
    parts = ", ".join(f"{dtype_name(t)} {list(t.shape)}" for t in tensors[:4])
    if len(tensors) > 4:
        parts += f", ... ({len(tensors)} tensors)"
    where = tensors[0].device.type if tensors else "cpu"
    return f"{kind} {name!r} ({parts} on {where}{extra})"


def _issue(kind: str, name: str | None, meta: list, args, tensors, process_set, post, extra="") -> int:
    co = basics.coordinator(process_set)
    if name is None:
        co.unnamed += 1
        name = f"{kind}.noname.{co.unnamed}"
    else:  # Horovod's op name: the kind, then the user's name (NOTE [name negotiation] 1)
        name = f"{kind}.{name}"
    entry = Entry(str(name), meta, _describe(kind, str(name), tensors, extra), args)
    co.submit(entry)
    return _new_handle(entry, post)


def _new_handle(entry: Entry, post) -> int:
    global _next_handle
    with _handles_lock:
        _next_handle += 1
        _handles[_next_handle] = (entry, post)
        return _next_handle


def poll(handle: int) -> bool:
    """True when the collective behind ``handle`` has finished (successfully or not)."""
    with _handles_lock:
        item = _handles.get(handle)
    if item is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return item[0].done.is_set()


def synchronize(handle: int):
    """Wait for the collective behind ``handle`` and return its output (raise
    HorovodInternalError when it failed). The handle is released either way."""
    with _handles_lock:
        item = _handles.pop(handle, None)
    if item is None:
        return None
    entry, post = item
    result = entry.wait()  # frees the name (NOTE [name negotiation] 1)
    return post(result) if post is not None else result


def _first(result):
    return result[0]


def _device(tensors) -> str:
    return tensors[0].device.type


# -- allreduce ---------------------------------------------------------------------------------
def _check_adasum(tensors, process_set) -> None:
    """Horovod's rules for ``op=Adasum``, raised where it raises them: at the call."""
    if (process_set or global_process_set) != global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    n = basics.size()
    if n & (n - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    for i, t in enumerate(tensors):
        if t.dtype not in _ADASUM_DTYPES:
            raise TensorArgumentError(f"Adasum: tensors[{i}] is {t.dtype}; Adasum combines float16, "
                                      "bfloat16, float32 and float64 tensors")


_ADASUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _allreduce_issue(tensors, outs, name, op, pre, post, wire, process_set, kind="allreduce", single=True):
    if op == ADASUM:
        _check_adasum(tensors, process_set)
    meta = ["allreduce", op, float(pre), float(post), wire, _device(tensors), [_spec(t) for t in tensors]]
    extra = f", op={OP_NAMES[op]}"
    return _issue(kind, name, meta, (tensors, outs), tensors, process_set, _first if single else list, extra)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of ``tensor`` into a new tensor; a handle for :func:`synchronize`."""
    op = _op_from(op, average)
    (t,) = _tensors(tensor, "allreduce_async")
    return _allreduce_issue([t], [torch.empty_like(t)], name, op, prescale_factor, postscale_factor, "",
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``."""
    op = _op_from(op, average)
    (t,) = _tensors(tensor, "allreduce_async_")
    return _allreduce_issue([t], [t], name, op, prescale_factor, postscale_factor, "", process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start one fused allreduce of ``tensors`` (negotiated as one collective)."""
    op = _op_from(op, average)
    ts = _tensors(tensors, "grouped_allreduce_async")
    return _allreduce_issue(ts, [torch.empty_like(t) for t in ts], name, op, prescale_factor,
                            postscale_factor, "", process_set, "grouped_allreduce", single=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set: ProcessSet = global_process_set) -> int:
    op = _op_from(op, average)
    ts = _tensors(tensors, "grouped_allreduce_async_")
    return _allreduce_issue(ts, ts, name, op, prescale_factor, postscale_factor, "", process_set,
                            "grouped_allreduce", single=False)


def _reduce_grads(grads, op, pre, post, process_set, inputs=None, outputs=None):
    """Backward of allreduce: the same allreduce of the gradients for Sum / Average / Adasum
    (Horovod's definition); for Min / Max the summed gradient flows to the ranks whose value won, for
    Product to every rank as d(prod)/dx."""
    if op in (SUM, AVERAGE, ADASUM):
        return grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post,
                                 process_set=process_set)
    summed = grouped_allreduce(list(grads), op=Sum, process_set=process_set)
    if op in (MIN, MAX):
        return [s * (x == y).to(s.dtype) for s, x, y in zip(summed, inputs, outputs, strict=True)]
    return [s * y / x for s, x, y in zip(summed, inputs, outputs, strict=True)]


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, wire, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        ts = [t.detach() for t in tensors]
        outs = synchronize(_allreduce_issue(ts, [torch.empty_like(t) for t in ts], name, op, pre, post, wire,
                                            process_set, "allreduce" if len(ts) == 1 else "grouped_allreduce",
                                            single=False))
        if op in (MIN, MAX, PRODUCT):
            ctx.save_for_backward(*ts, *outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        # Sum/Average save nothing, so each output of a grouped allreduce may be backpropagated
        # on its own (Horovod's tests call backward once per output); saved_tensors would raise
        # on the second call.
        saved = ctx.saved_tensors if op in (MIN, MAX, PRODUCT) else ()
        k = len(grads)
        grads = [g.contiguous() for g in grads]
        out = _reduce_grads(grads, op, pre, post, process_set, saved[:k], saved[k:])
        return (None,) * 6 + tuple(out)


def _compressed(tensors, compression):
    """(tensors to reduce, wire format, contexts to decompress with, or None)."""
    wire, custom = wire_format(compression, tensors[0].dtype)
    if not custom:
        return tensors, wire, None
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], "", [p[1] for p in pairs]


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set: ProcessSet = global_process_set):
    """Reduce ``tensor`` over the ranks of ``process_set`` into a new tensor (same shape, dtype,
    device). ``op``: Average (default), Sum, Adasum, Min, Max, Product; ``prescale_factor`` multiplies
    each input, ``postscale_factor`` the result (integers scaled in float64 and truncated,
    16-bit floats in float32; integer Average truncates toward zero). Differentiable."""
    op = _op_from(op, average)
    (t,) = _tensors(tensor, "allreduce")
    ts, wire, ctxs = _compressed([t], compression)
    (out,) = _AllreduceFn.apply(name, op, prescale_factor, postscale_factor, wire, process_set, *ts)
    return out if ctxs is None else compression.decompress(out, ctxs[0])


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set: ProcessSet = global_process_set):
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set: ProcessSet = global_process_set):
    """:func:`allreduce` of a list of tensors as one fused collective; a list of new tensors."""
    op = _op_from(op, average)
    ts = _tensors(tensors, "grouped_allreduce")
    cts, wire, ctxs = _compressed(ts, compression)
    outs = list(_AllreduceFn.apply(name, op, prescale_factor, postscale_factor, wire, process_set, *cts))
    if ctxs is not None:
        outs = [compression.decompress(o, c) for o, c in zip(outs, ctxs, strict=True)]
    return outs


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set: ProcessSet = global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------------------
def _gatherable(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        raise TensorArgumentError("allgather: a 0-d tensor has no first dimension to gather along; "
                                  "use tensor.reshape(1)")
    return t


def _allgather_issue(tensors, name, process_set, single: bool) -> int:
    ts = [_gatherable(t.detach()) for t in tensors]
    meta = ["allgather", _device(ts), [_spec(t, free_dim0=True) for t in ts]]
    return _issue("allgather" if single else "grouped_allgather", name, meta, ts, ts, process_set,
                  _first if single else list)


def allgather_async(tensor, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather: every rank's ``tensor`` concatenated along dimension 0 (which may
    differ across ranks; the other dimensions may not)."""
    return _allgather_issue(_tensors(tensor, "allgather_async"), name, process_set, True)


def grouped_allgather_async(tensors, name=None, process_set: ProcessSet = global_process_set) -> int:
    return _allgather_issue(_tensors(tensors, "grouped_allgather_async"), name, process_set, False)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.process_set = process_set
        ctx.dims = [t.shape[0] for t in tensors]
        return tuple(synchronize(_allgather_issue(tensors, name, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        # Horovod's definition: the average of the ranks' output gradients, this rank's rows.
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ctx.process_set)
        me = _set_rank(ctx.process_set)
        offsets = dims[:me].sum(0) if me else torch.zeros(len(ctx.dims), dtype=torch.int64)
        out = [r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, ctx.dims, strict=True)]
        return (None, None) + tuple(out)


def allgather(tensor, name=None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (a new tensor).
    Differentiable."""
    (t,) = _tensors(tensor, "allgather")
    return _AllgatherFn.apply(name, process_set, _gatherable(t))[0]


def grouped_allgather(tensors, name=None, process_set: ProcessSet = global_process_set) -> list:
    ts = [_gatherable(t) for t in _tensors(tensors, "grouped_allgather")]
    return list(_AllgatherFn.apply(name, process_set, *ts))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op,
                           process_set: ProcessSet = global_process_set):
    """Start reducing a sparse COO ``tensor`` (any shape, same on every rank) by gathering
    every rank's entries, as Horovod reduces sparse gradients: its indices and values travel
    as two allgathers named ``{name}.indices`` and ``{name}.values``. Returns a function that
    waits and gives a new sparse tensor of ``tensor``'s shape holding every rank's entries,
    uncoalesced (a row two ranks touch appears twice; ``coalesce()`` sums them), with the
    values divided by the set's size for ``op=Average``. ``tensor`` must not change until then.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TensorArgumentError("sparse_allreduce_async: tensor must be a sparse COO torch.Tensor")
    op = int(op)
    if op not in (AVERAGE, SUM):
        raise ValueError(f"sparse_allreduce_async: op must be Average or Sum, got {OP_NAMES.get(op, op)}")
    # Entries go along dimension 0 of both gathers: indices as (nnz, sparse_dim).
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    base = f"{name}." if name is not None else None
    h_indices = allgather_async(indices, name=base and base + "indices", process_set=process_set)
    h_values = allgather_async(values, name=base and base + "values", process_set=process_set)
    n = (process_set or global_process_set).size()

    def wait() -> torch.Tensor:
        gathered_values = synchronize(h_values)
        gathered_indices = synchronize(h_indices)
        if op == AVERAGE:
            gathered_values = gathered_values / n
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       check_invariants=True)  # indices are checked against the shape

    return wait


# -- broadcast ---------------------------------------------------------------------------------
def _set_rank(process_set) -> int:
    ps = process_set or global_process_set
    return ps.rank()


def _root_index(root_rank: int, process_set) -> int:
    ps = process_set or global_process_set
    basics.coordinator(ps)
    root = int(root_rank)
    if root not in ps.ranks:
        raise TensorArgumentError(f"broadcast: root_rank={root} is not a rank of {ps}")
    return ps.ranks.index(root)


def _broadcast_issue(tensors, outs, root_rank, name, process_set, single=True) -> int:
    root = _root_index(root_rank, process_set)
    meta = ["broadcast", root, _device(tensors), [_spec(t) for t in tensors]]
    return _issue("broadcast", name, meta, (tensors, outs), tensors, process_set, _first if single else list,
                  f", root_rank={int(root_rank)}")


def broadcast_async(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    (t,) = _tensors(tensor, "broadcast_async")
    return _broadcast_issue([t.detach()], [torch.empty_like(t)], root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast into ``tensor``."""
    (t,) = _tensors(tensor, "broadcast_async_")
    return _broadcast_issue([t], [t], root_rank, name, process_set)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if basics.rank() != int(ctx.root_rank):
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor; ``root_rank`` is a global rank).
    Differentiable: the root gets the ranks' average gradient, the others zero."""
    (t,) = _tensors(tensor, "broadcast")
    return _BroadcastFn.apply(t, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast`; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------
def _splits_of(tensor: torch.Tensor, splits, n: int) -> np.ndarray:
    if tensor.dim() == 0:
        raise TensorArgumentError("alltoall: a 0-d tensor has no first dimension to split")
    if splits is None:
        if tensor.shape[0] % n:
            raise TensorArgumentError(f"alltoall: the first dimension ({tensor.shape[0]}) must be a multiple "
                                      f"of the number of ranks ({n}) when no splits are given")
        return np.full(n, tensor.shape[0] // n, np.int64)
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise TensorArgumentError(f"alltoall: splits must hold int32 or int64, got {splits.dtype}")
        values = splits.detach().cpu().reshape(-1).numpy().astype(np.int64)
    else:
        values = np.asarray(list(splits), np.int64)
    if values.shape != (n,):
        raise TensorArgumentError(f"alltoall: splits must have one entry per rank ({n}), "
                                  f"got {values.shape[0]}")
    if (values < 0).any():
        raise TensorArgumentError(f"alltoall: splits must not be negative, got {values.tolist()}")
    if int(values.sum()) != tensor.shape[0]:
        raise TensorArgumentError(f"alltoall: splits sum to {int(values.sum())}, but the first dimension "
                                  f"of the tensor is {tensor.shape[0]}")
    return values


def alltoall_async(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall: rows ``splits[i]`` (default: equal parts) go to rank i. Synchronizing
    gives ``(output, received_splits)``."""
    (t,) = _tensors(tensor, "alltoall_async")
    ps = process_set or global_process_set
    basics.coordinator(ps)
    values = _splits_of(t, splits, ps.size())
    t = t.detach()
    meta = ["alltoall", t.device.type, dtype_name(t), [-1, *t.shape[1:]]]
    return _issue("alltoall", name, meta, (t, values), [t], process_set, None)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _unused):
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return out, None, None, None


def alltoall(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set):
    """Scatter slices of ``tensor`` to every rank and gather theirs (rows ``splits[i]`` to rank
    i; default equal parts). Returns the gathered tensor, and with ``splits`` given also the
    rows received from each rank (int32). Differentiable."""
    (t,) = _tensors(tensor, "alltoall")
    out, received = _AlltoallFn.apply(t, splits, name, process_set)
    return out if splits is None else (out, received)


# -- reducescatter -----------------------------------------------------------------------------
def _reducescatter_issue(tensors, name, op, pre, post, process_set, single) -> int:
    if op == ADASUM:  # a RuntimeError, as Horovod's core reports an unsupported reduction
        raise NotImplementedError("reducescatter: op=Adasum is not supported (use Average or Sum)")
    if op not in (AVERAGE, SUM, MIN, MAX, PRODUCT):
        raise ValueError(f"reducescatter: unsupported op {op!r}")
    for t in tensors:
        if t.dim() == 0:
            raise TensorArgumentError("reducescatter: a 0-d tensor has no first dimension to scatter")
    ts = [t.detach() for t in tensors]
    meta = ["reducescatter", op, float(pre), float(post), _device(ts), [_spec(t) for t in ts]]
    return _issue("reducescatter" if single else "grouped_reducescatter", name, meta, ts, ts, process_set,
                  _first if single else list, f", op={OP_NAMES[op]}")


def reducescatter_async(tensor, name=None, op=Average, process_set: ProcessSet = global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    (t,) = _tensors(tensor, "reducescatter_async")
    return _reducescatter_issue([t], name, int(op), prescale_factor, postscale_factor, process_set, True)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set: ProcessSet = global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    ts = _tensors(tensors, "grouped_reducescatter_async")
    return _reducescatter_issue(ts, name, int(op), prescale_factor, postscale_factor, process_set, False)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return tuple(synchronize(_reducescatter_issue(tensors, name, op, pre, post, process_set, False)))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.op not in (SUM, AVERAGE):
            raise RuntimeError("reducescatter: gradients are defined for op=Sum and op=Average only")
        # Horovod's definition: the gathered output gradients, times the set's size for Sum
        full = grouped_allgather([g.contiguous() for g in grads], process_set=ctx.process_set)
        n = (ctx.process_set or global_process_set).size()
        scale = ctx.pre * ctx.post * (n if ctx.op == SUM else 1)
        return (None,) * 5 + tuple(f * scale if scale != 1 else f for f in full)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set: ProcessSet = global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks and give each rank its rows of the result along
    dimension 0 (the first ``dim0 % size`` ranks get one row more). Differentiable."""
    (t,) = _tensors(tensor, "reducescatter")
    (ct,), _, ctxs = _compressed([t], compression)
    (out,) = _ReducescatterFn.apply(name, int(op), prescale_factor, postscale_factor, process_set, ct)
    return out if ctxs is None else compression.decompress(out, ctxs[0])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    ts = _tensors(tensors, "grouped_reducescatter")
    cts, _, ctxs = _compressed(ts, compression)
    outs = list(_ReducescatterFn.apply(name, int(op), prescale_factor, postscale_factor, process_set, *cts))
    if ctxs is not None:
        outs = [compression.decompress(o, c) for o, c in zip(outs, ctxs, strict=True)]
    return outs


# -- control -----------------------------------------------------------------------------------
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every rank's collectives (NEGOTIATE_<OP> and <OP> spans per tensor name, and with
    ``mark_cycles`` each coordinator round as CYCLE_START) until :func:`stop_timeline`, which
    writes them to ``file_path`` on rank 0 as one Chrome trace. Called on every rank."""
    basics.rank()  # raises when not initialized
    timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and write the trace begun by :func:`start_timeline` (collective: every
    rank's events are gathered to rank 0, so it works across machines)."""
    if not timeline.enabled():
        return
    path = timeline.path()
    events = timeline.stop(write=False)
    parts = allgather_object(events, name="stop_timeline")
    if basics.rank() == 0:
        with open(path, "w") as f:
            json.dump([e for part in parts for e in part], f)

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` reached the barrier."""
    synchronize(_issue("barrier", None, ["barrier"], None, [], process_set, None))


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others'
    collectives with zeros (allreduce, reducescatter), no rows (allgather, alltoall) or as a
    receiver (broadcast). Returns the rank that joined last. ``device`` is accepted for
    Horovod's signature (collectives of joined ranks run through host memory)."""
    co = basics.coordinator(global_process_set)
    entry = Entry(JOIN, ["join"], "join")
    co.submit(entry)
    return entry.wait()


def broadcast_object(obj, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set):
    """``root_rank``'s ``obj`` on every rank (pickled on the root; only the job's own ranks'
    bytes are unpickled)."""
    me = basics.rank()
    name = name or "broadcast_object"
    payload = _pickle(obj) if me == int(root_rank) else torch.empty(0, dtype=torch.uint8)
    n = torch.tensor([payload.numel()], dtype=torch.int64)
    broadcast_(n, root_rank, name=f"{name}.size", process_set=process_set)
    if me != int(root_rank):
        payload = torch.empty(int(n[0]), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if me == int(root_rank) else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    name = name or "allgather_object"
    payload = _pickle(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.size",
                      process_set=process_set)
    data = allgather(payload, name=f"{name}.data", process_set=process_set).numpy()
    out, o = [], 0
    for s in sizes.tolist():
        out.append(pickle.loads(data[o:o + s].tobytes()))
        o += s
    return out


def _pickle(obj) -> torch.Tensor:
    b = io.BytesIO()
    pickle.dump(obj, b)
    return torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)

