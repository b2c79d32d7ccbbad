"""horovod.torch's DistributedOptimizer with ``op=hvd.Adasum``: the delta optimizer.

Adasum combines what each rank would do, not what each rank saw: each rank takes its own
optimizer's step, and the ranks' steps (the parameters' deltas) are combined by Adasum
(comm.adasum_allreduce), so a learning rate tuned for one rank stays right at any rank count
(Horovod's Adasum guide). As Horovod runs it, per parameter and overlapped with backward:

1. When a parameter's gradient is complete (its last backward pass of the step:
   ``backward_passes_per_step``), the wrapped optimizer steps that parameter alone (its
   parameter groups narrowed to it for the call, so its state and hyper-parameters are its
   own), from zero: what is left in the parameter is the step itself (``-lr * f(grad)``), and
   its value before is kept aside.
2. The step is reduced at once, in place, by ``hvd.allreduce_async_(op=Adasum)`` under the
   parameter's name, through the compression given.
3. ``step()`` reduces the parameters whose gradient never came (their step on a zero or stale
   gradient, as Horovod's), waits for every reduction, and sets each parameter to its value
   before plus the combined step.

Only over the global process set and a power of two of ranks (Horovod's rules); at one rank
DistributedOptimizer is the plain one. ``synchronize()`` does nothing (there is nothing to wait
for before step, which waits itself) and ``skip_synchronize()`` is refused, as Horovod refuses it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import basics
from .errors import TOO_MANY_PASSES, ZERO_GRAD_IN_FLIGHT
from .execute import ADASUM
from .mpi_ops import allreduce_async_, synchronize

__all__ = ["_DistributedAdasumOptimizer"]


class _DistributedAdasumOptimizer:
    """Methods of the class DistributedOptimizer makes for ``op=Adasum`` (a subclass of the
    wrapped optimizer's class sharing its parameter groups and state)."""

    def _hvd_setup(self, named_parameters: list[tuple[str, torch.Tensor]], compression,
                   backward_passes_per_step: int) -> None:
        basics._require()
        self._hvd_compression = compression
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_delay = {p: backward_passes_per_step for _, p in named_parameters}
        self._hvd_handles: dict[torch.Tensor, tuple[int | None, object]] = {}
        self._hvd_requires_update: set[torch.Tensor] = set()
        # Each parameter's value before its step (clause 1): the delta is measured from it.
        self._hvd_start = {p: torch.zeros_like(p, requires_grad=False) for _, p in named_parameters}
        self._hvd_hooks = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)  # Horovod's: every parameter has a gradient
                    self._hvd_requires_update.add(p)
                    self._hvd_hooks.append(p.register_post_accumulate_grad_hook(self._hvd_on_grad))

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        for p in self._hvd_delay:
            self._hvd_delay[p] = passes

    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        if self._hvd_handles.get(p, (None, None))[0] is not None and self._hvd_delay[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        handle, ctx = None, None
        self._hvd_delay[p] -= 1
        if self._hvd_delay[p] == 0:
            handle, ctx = self._hvd_reduce_step(p)
        self._hvd_handles[p] = (handle, ctx)

    @torch.no_grad()
    def _hvd_reduce_step(self, p: torch.Tensor):
        """Clauses 1 and 2 for ``p``: its own step, left in ``p`` as a delta, reduced in place."""
        start = self._hvd_start[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.copy_(p)
            super(self.__class__, self).step()
        finally:
            for group, params in zip(self.param_groups, stashed, strict=True):
                group["params"] = params
        p.sub_(start)
        compressed, ctx = self._hvd_compression.compress(p)
        return allreduce_async_(compressed, name=self._parameter_names.get(p), op=ADASUM), (compressed, ctx)

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` waits for the reductions it applies."""

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover (a generator, as contextmanager wants)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self._hvd_requires_update - set(self._hvd_handles):
            self._hvd_handles[p] = self._hvd_reduce_step(p)
        pending, self._hvd_handles = self._hvd_handles, {}
        failure = None
        for p, (handle, ctx) in pending.items():
            try:
                if handle is None:  # step() before the last backward pass of the step
                    handle, ctx = self._hvd_reduce_step(p)
                compressed, cctx = ctx
                delta = self._hvd_compression.decompress(synchronize(handle), cctx)
            except Exception as e:  # the other reductions are still waited for (their names freed)
                failure = failure or e
                continue
            start = self._hvd_start[p]
            start.add_(delta)
            p.copy_(start)
            self._hvd_delay[p] = self.backward_passes_per_step
        if failure is not None:
            raise failure
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_handles:
            raise AssertionError(ZERO_GRAD_IN_FLIGHT)
        return super(self.__class__, self).zero_grad(set_to_none)
