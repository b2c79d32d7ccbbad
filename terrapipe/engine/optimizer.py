"""DistributedOptimizer: any torch optimizer, stepping on gradients averaged across ranks."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import comm, settings, timeline
from ..ps import WrappedOptimizer
from .autotune import AutoTuner
from .gradients import DistributedGradients

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(WrappedOptimizer):
    """Wrap ``optimizer`` (Horovod's DistributedOptimizer, TorchMPI's AllReduceSGD).

    Gradients of ``model`` are averaged during backward by a :class:`DistributedGradients`
    (``bucket_mb``, ``compression``, ``backward_passes_per_step``, ``backend``: "jit", "nccl" or
    "auto", see that class); ``step()`` waits for them,
    then steps the wrapped optimizer. ``autotune=True`` (default: ``TERRAPIPE_AUTOTUNE`` set, as
    ``terrapipe run --autotune`` does) searches the bucket sizes and the ring's knobs during the
    first steps and caches the best (NOTE [autotune] in engine/autotune.py).
    With ``backward_passes_per_step=k``, call ``step()`` after
    every k-th backward. ``zero_grad()`` while reductions are in flight raises.

    With a GradScaler (or anything else that reads gradients before the step), follow Horovod's
    order, so nothing reads or unscales a gradient a reduction still owns, and a step skipped
    for an inf leaves no reduction pending::

        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)

    ``step()`` after ``synchronize()`` with no backward in between does not reduce again.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, bucket_mb: float = 25,
                 compression: str | None = None, backward_passes_per_step: int = 1,
                 first_bucket_mb: float = 1, op: str = "avg", group: comm.Group | None = None,
                 backend: str = "auto", autotune: bool | None = None) -> None:
        self.optimizer = optimizer
        self._skip_sync = False
        self._settings = dict(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, compression=compression,
                              op=op, backward_passes_per_step=backward_passes_per_step, backend=backend)
        if autotune is None:
            autotune = settings.get("TERRAPIPE_AUTOTUNE")
        self._autotune = bool(autotune)
        self._attach(model, group)

    def _attach(self, model, group: comm.Group | None) -> None:
        """The gradient hooks over ``group`` (and the autotuner, when asked for and the group
        has more than one rank)."""
        self.gradients = DistributedGradients(model, group=group, **self._settings)
        tunable = self._autotune and self.gradients.group.size > 1
        self.autotuner = AutoTuner(self.gradients) if tunable else None

    def rejoin(self, group: comm.Group | None = None) -> None:
        """Average over ``group`` from now on (default: ``comm.world()`` as it is now): after an
        elastic job formed its next generation (Engine(elastic=True)). The old hooks are removed
        and reductions still pending are dropped; the gradients already in ``.grad`` stay, and
        the next ``synchronize()`` averages them over the new group. Collective over ``group``
        (the new gradient buffers may be shared)."""
        params = self.gradients.parameters
        self.gradients.remove()
        self._attach(params, group)

    records_step = True  # Engine leaves the "optimizer step" span to it (timeline_summary)

    def step(self, closure=None):
        if self._skip_sync:  # the caller's step (an AMP step) is the span: terrapipe/timeline_summary.py
            out = self.optimizer.step(closure)
        else:
            with timeline.span("engine", "optimizer step"):
                if not self.gradients.synchronized:
                    self.gradients.synchronize()
                out = self.optimizer.step(closure)
        if self.autotuner is not None:
            self.autotuner.after_step()
        return out

    def synchronize(self) -> None:
        """Wait until every gradient is averaged across ranks (launching what backward did not)."""
        self.gradients.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside steps on the gradients as they are: call :meth:`synchronize` first."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def no_sync(self):
        return self.gradients.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gradients.zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)
