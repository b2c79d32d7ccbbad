"""What every training mode shares: an optimizer wrapper over one flat copy of the parameters.

A mode wraps a ``torch.optim.Optimizer``: ``step()`` runs the wrapped optimizer's step on the
local gradients, then the mode's exchange. Everything else (``zero_grad``, ``param_groups``,
``state``, ``state_dict``) is the wrapped optimizer's, so a GradScaler or ``Engine`` drives a mode
as it drives any optimizer (attach learning-rate schedulers to the wrapped optimizer).
``consolidate()`` (collective) makes every rank's parameters the consensus model; ``Engine``
calls it at the end of each epoch, before validation and checkpointing.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..comm import broadcast, world

__all__ = ["WrappedOptimizer", "ModeOptimizer"]


class WrappedOptimizer:
    """Delegates what a training loop, a GradScaler or a checkpoint reads of an optimizer
    (``param_groups``, ``state``, ``defaults``, ``zero_grad``, ``state_dict``) to the wrapped
    ``self.optimizer``: the base of every optimizer wrapper (these modes, and
    ``terrapipe.engine.DistributedOptimizer``)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class ModeOptimizer(WrappedOptimizer):
    """Base of the training modes: ``optimizer`` (its parameters, every group, on one device
    and of one dtype), ``group`` (default: the world). Collective: broadcasts rank 0's
    parameters so every rank starts from the same model."""

    def __init__(self, optimizer: torch.optim.Optimizer, group=None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__}: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.group = world() if group is None else group
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError(f"{type(self).__name__}: optimizer has no parameters")
        kinds = {(p.device, p.dtype) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"{type(self).__name__}: parameters must share one device and dtype, "
                             f"got {sorted(map(str, kinds))}")
        self.steps = 0
        with torch.no_grad():
            flat = self.flat()
            broadcast(flat, 0, group=self.group)
            self.assign(flat)

    def step(self, closure=None):
        """The wrapped optimizer's step, then the mode's exchange (:meth:`after_step`)."""
        loss = self.optimizer.step(closure)
        self.steps += 1
        with torch.no_grad():
            self.after_step()
        return loss

    # -- for the modes -------------------------------------------------------------------------
    def flat(self) -> torch.Tensor:
        """A new flat copy of the parameters: (numel,), their dtype and device."""
        return parameters_to_vector(self.params)

    def assign(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (numel,) into the parameters."""
        vector_to_parameters(flat, self.params)

    def after_step(self) -> None:
        raise NotImplementedError

    def consolidate(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Collective: release what the mode holds (after :meth:`consolidate`)."""
