"""horovod.torch's DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state, on
terrapipe's engine: gradients are averaged by the engine's DistributedGradients (flat buckets,
each parameter's ``.grad`` a view into one: Horovod's Tensor Fusion), whose buckets are issued
as named grouped allreduces through the process set's coordinator, so they take part in
Horovod's negotiation (``join``, out-of-order ranks) like any hvd collective.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import numpy as np
import torch

from ..engine import DistributedGradients
from . import basics
from .adasum_optimizer import _DistributedAdasumOptimizer
from .basics import ProcessSet, global_process_set
from .compression import Compression, wire_format
from .errors import TOO_MANY_PASSES, ZERO_GRAD_IN_FLIGHT
from .execute import ADASUM, AVERAGE, SUM
from .mpi_ops import _allreduce_issue, _broadcast_issue, broadcast_object, sparse_allreduce_async, synchronize

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]

_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                    "your code.")


class _Handle:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def wait(self):
        return synchronize(self.handle)


class _NegotiatedGradients(DistributedGradients):
    """DistributedGradients whose buckets go through the hvd coordinator as grouped allreduces
    named after their first parameter.

    Sparse gradients (``nn.Embedding(sparse=True)``) are Horovod's: with ``sparse_as_dense`` they
    are reduced dense in their bucket and made sparse again by :meth:`synchronize`; without, by
    :func:`sparse_allreduce_async` (every rank's entries gathered). In the first step such a
    parameter's bucket slot carries zeros; the first synchronize agrees on rank 0's sparse
    parameters (with the bucket order) and cuts them out of the buckets, and from then on a
    rank with no gradient for one sends its share empty, so no rank waits for it."""

    def __init__(self, params, names: dict[torch.Tensor, str], op: int, predivide: float, compression,
                 process_set: ProcessSet, passes: int, buckets, sparse_as_dense: bool) -> None:
        fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        bucket_mb = int(fusion) / 2**20 if fusion and int(fusion) > 0 else 25
        self.param_names = names
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self._sparse_dims: dict[int, int] = {}  # parameters seen with sparse gradients: sparse_dim
        self._outside: dict[int, int] = {}  # agreed sparse parameters, out of the buckets: sparse_dim
        self._sparse_pending: dict[int, tuple[torch.Tensor, object]] = {}  # id: (parameter, wait)
        super().__init__(params, bucket_mb=bucket_mb, backward_passes_per_step=passes,
                         group=process_set._group, backend="jit", buckets=buckets)
        self._by_id = {id(p): p for p in self.parameters}
        self.hvd_op, self.predivide = op, predivide
        self.hvd_compression = compression

    def take_grad(self, p: torch.Tensor, last: bool) -> None:
        key = id(p)
        if p.grad.is_sparse:
            self._sparse_dims.setdefault(key, p.grad.sparse_dim())
        if key not in self._outside and (not p.grad.is_sparse or self.sparse_as_dense):
            return super().take_grad(p, last)
        if last:  # earlier passes of a step accumulate in the sparse .grad itself
            self._sparse_pending[key] = (p, self._sparse_reduce(p, p.grad))
            if key not in self._outside:
                p.grad = None  # still in a bucket (first step): its slot is reduced as zeros

    def _sparse_reduce(self, p: torch.Tensor, grad: torch.Tensor):
        if not grad.is_sparse:
            grad = grad.to_sparse(self._outside.get(id(p), 1))
        return sparse_allreduce_async(grad, self._op_name(p), self.hvd_op, self.process_set)

    def _op_name(self, p: torch.Tensor) -> str:
        return f"DistributedOptimizer.{self.param_names[p]}"

    def synchronize(self) -> None:
        try:
            super().synchronize()  # the first one also agrees on the parameters outside the buckets
            for key, sparse_dim in self._outside.items():
                if key not in self._sparse_pending:  # no gradient on this rank: an empty share
                    p = self._by_id[key]
                    grad = p.grad if p.grad is not None else torch.sparse_coo_tensor(
                        torch.empty(sparse_dim, 0, dtype=torch.int64),
                        torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype), p.shape)
                    self._sparse_pending[key] = (p, self._sparse_reduce(p, grad))
        finally:  # the sparse reductions are waited for (their names freed) even when a bucket failed
            pending, self._sparse_pending = self._sparse_pending, {}
            for p, wait in pending.values():
                p.grad = wait()
        if self.sparse_as_dense:  # the update sees the gradients' layout again
            for key, sparse_dim in self._sparse_dims.items():
                p = self._by_id[key]
                if p.grad is not None and not p.grad.is_sparse:
                    p.grad = p.grad.to_sparse(sparse_dim)

    def in_flight(self) -> bool:
        return super().in_flight() or bool(self._sparse_pending)

    def bucketed(self, params):
        return [p for p in params if id(p) not in self._outside]

    def set_buckets(self, buckets) -> None:
        super().set_buckets(buckets)
        self.bucket_names = [self._op_name(b[0]) + (f"+{len(b) - 1}" if len(b) > 1 else "")
                             for b in self.buckets]

    def broadcast_order(self, order):
        # Through the coordinator, as every hvd collective of this process set goes; with it, the
        # sparse parameters rank 0 saw (their sparse_dim, else 0), which leave the buckets.
        dims = [0 if self.sparse_as_dense else self._sparse_dims.get(id(p), 0) for p in self.parameters]
        t = torch.from_numpy(np.concatenate([order, np.asarray(dims, np.int64)]))
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        synchronize(_broadcast_issue([t], [t], root, "DistributedOptimizer.bucket_order", self.process_set))
        agreed = t[len(order):].tolist()
        self._outside = {id(p): d for p, d in zip(self.parameters, agreed, strict=True) if d}
        return t[:len(order)].numpy()

    def reduce_bucket(self, b: int, flat: torch.Tensor):
        if self.hvd_op == AVERAGE:  # Horovod splits the average around the sum
            pre, post = 1.0 / self.predivide, self.predivide
        else:
            pre = post = 1.0
        wire, custom = wire_format(self.hvd_compression, flat.dtype)
        if custom:
            # compress around the reduction, as Horovod runs a custom Compressor
            c, ctx = self.hvd_compression.compress(flat)
            h = _allreduce_issue([c], [c], self.bucket_names[b], self.hvd_op, pre, post, "", self.process_set)
            return _Decompress(h, flat, self.hvd_compression, ctx)
        return _Handle(_allreduce_issue([flat], [flat], self.bucket_names[b], self.hvd_op, pre, post, wire,
                                        self.process_set))

    def too_many_passes(self) -> None:
        raise AssertionError(TOO_MANY_PASSES)


class _Decompress:
    def __init__(self, handle, flat, compression, ctx) -> None:
        self.handle, self.flat, self.compression, self.ctx = handle, flat, compression, ctx

    def wait(self) -> None:
        c = synchronize(self.handle)
        with torch.no_grad():
            self.flat.copy_(self.compression.decompress(c, self.ctx))


def named_parameters_of(param_groups, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` checked as Horovod checks them (tuples, unique names, every parameter
    of ``param_groups`` named), or Horovod's names for unnamed ones."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    names = [k for k, _ in named_parameters]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = [id(p) for p in params if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not "
                         f"named. Python object ids: {', '.join(str(i) for i in unnamed)}")
    return named_parameters


class _DistributedOptimizer:
    """Methods of the class DistributedOptimizer makes (a subclass of the wrapped optimizer's
    class, as Horovod makes it, so isinstance checks and LR schedulers keep working)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        named_parameters = named_parameters_of(self.param_groups, named_parameters)
        if op not in (AVERAGE, SUM, ADASUM):  # Adasum here only at one rank (DistributedOptimizer)
            raise ValueError(f"op: DistributedOptimizer reduces with Average, Sum or Adasum, got {op!r}")
        if gradient_predivide_factor != 1.0 and op != AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if groups is not None and num_groups:
            raise ValueError("Only one of num_groups and groups may be given")
        if groups is not None:
            if not isinstance(groups, list) or any(not isinstance(g, list) for g in groups):
                raise ValueError("groups should be a list of lists of parameters")
            buckets = groups
        elif num_groups:
            trainable = [p for p in params if p.requires_grad]
            k = max(1, min(int(num_groups), len(trainable)))
            q, r = divmod(len(trainable), k)
            buckets, o = [], 0
            for i in range(k):
                n = q + (1 if i < r else 0)
                buckets.append(trainable[o:o + n])
                o += n
        else:
            buckets = None
        # Horovod's attribute, and the names buckets are issued under (tensors hash by identity)
        self._parameter_names = {v: k for k, v in named_parameters}
        self._hvd_should_sync = True
        self._hvd_synchronized = False
        basics._require()
        self._hvd_grads = None
        self._hvd_args = (params, op, gradient_predivide_factor, compression,
                          process_set or global_process_set, backward_passes_per_step, buckets,
                          bool(sparse_as_dense))
        self._hvd_bind()
        basics.on_world_change(self._hvd_world_changed)
        self.backward_passes_per_step = backward_passes_per_step

    def _hvd_bind(self) -> None:
        """Gradient hooks over the process set as this world has it (none for a set of one)."""
        params, op, predivide, compression, ps, passes, buckets, sparse_as_dense = self._hvd_args
        self._hvd_grads = None
        if ps.included() and ps.size() > 1:
            basics.coordinator(ps)
            self._hvd_grads = _NegotiatedGradients(params, self._parameter_names, op, predivide, compression,
                                                   ps, passes, buckets, sparse_as_dense)

    def _hvd_world_changed(self, joined: bool) -> None:
        """hvd.shutdown() (``joined`` False) detaches the hooks; hvd.init() makes them again over
        the new world, whose size may differ (an elastic job's next generation)."""
        if self._hvd_grads is not None:
            self._hvd_grads.remove()
            self._hvd_grads = None
        if joined:
            self._hvd_bind()

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        args = self._hvd_args
        self._hvd_args = (*args[:5], passes, *args[6:])
        if self._hvd_grads is not None:
            self._hvd_grads.passes_per_step = passes

    def synchronize(self) -> None:
        """Wait until every gradient is reduced across the process set (issuing the buckets
        backward did not complete, with zeros for parameters that got no gradient)."""
        if self._hvd_grads is not None:
            self._hvd_grads.synchronize()
        self._hvd_synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronize: call :meth:`synchronize` first."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            else:
                self.synchronize()
        self._hvd_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_grads is not None:
            # Horovod's rule: any gradient produced since the last synchronize (reduced or not)
            if self._hvd_grads.in_flight() or self._hvd_grads.step_started():
                raise AssertionError(ZERO_GRAD_IN_FLIGHT)
            self._hvd_grads.zero_grad(set_to_none)
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op=AVERAGE,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced (``op``: Average or Sum)
    over ``process_set``. Reduction starts in backward, bucket by bucket (``num_groups`` equal
    groups or explicit ``groups`` of parameters instead of size-based buckets); ``synchronize()``
    waits for it. ``backward_passes_per_step=k``: gradients accumulate locally over k backward
    passes, then are reduced. ``gradient_predivide_factor=f``: Average as (sum of g/f) * f / size.
    The returned optimizer is an instance of a subclass of ``optimizer``'s class sharing its
    parameter groups and state. ``op=Adasum`` (two ranks or more) reduces updates instead of
    gradients: each rank's own step of each parameter, combined by Adasum
    (horovod/adasum_optimizer.py)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if gradient_predivide_factor != 1.0 and int(op) != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if int(backward_passes_per_step) <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    adasum = int(op) == ADASUM and basics.size() > 1  # Horovod's choice: one rank has nothing to combine
    if adasum and (process_set or global_process_set) != global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    methods = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    base = type(optimizer)
    cls = type(base.__name__, (base,), {k: v for k, v in methods.__dict__.items()
                                        if not k.startswith("__") or k == "__doc__"})
    new = cls.__new__(cls)
    new.__dict__.update(optimizer.__dict__)  # same param_groups, state and hooks
    if adasum:
        new._hvd_setup(named_parameters_of(new.param_groups, named_parameters), compression,
                       int(backward_passes_per_step))
    else:
        new._hvd_setup(named_parameters, compression, int(backward_passes_per_step), int(op),
                       float(gradient_predivide_factor), num_groups, groups, sparse_as_dense, process_set)
    return new


@torch.no_grad()
def broadcast_parameters(params, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place: ``params`` is a ``state_dict()``,
    ``named_parameters()`` or a list of (name, tensor) / tensors. One fused broadcast per dtype."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif hasattr(params, "__iter__"):  # named_parameters(), a list of (name, tensor) or tensors
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors = [p for _, p in items if isinstance(p, torch.Tensor) and p.numel()]
    if not tensors:
        return
    by_device: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device.type, []).append(t.data if isinstance(t, torch.nn.Parameter) else t)
    for device, ts in sorted(by_device.items()):
        synchronize(_broadcast_issue(ts, ts, root_rank, f"broadcast_parameters.{device}", process_set,
                                     single=False))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s. State
    that does not exist yet (a fresh optimizer) is created first, by a step on zero gradients
    that leaves the parameters as they were; as in Horovod, a parameter that requires grad and
    had none is left with a zero ``.grad``. Any torch.optim optimizer works (LBFGS included:
    its state is broadcast as it is)."""
    if not optimizer.state_dict()["state"] and not isinstance(optimizer, torch.optim.LBFGS):
        _create_state(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast_optimizer_state",
                             process_set=process_set)
    if basics.rank() != int(root_rank):
        optimizer.load_state_dict(state)


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if "_hvd_setup" in type(optimizer).__dict__:  # a DistributedOptimizer: the wrapped class's step
        super(type(optimizer), optimizer).step()
    else:
        optimizer.step()
    for p, value, grad in saved:
        p.copy_(value)
        if grad is not None:
            p.grad = grad
