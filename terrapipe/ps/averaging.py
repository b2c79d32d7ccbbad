"""Periodic model averaging (local SGD): every ``k`` steps, parameters are averaged over ranks."""

from __future__ import annotations

import torch

from ..comm import allreduce
from .wrapper import ModeOptimizer

__all__ = ["ModelAveraging"]


class ModelAveraging(ModeOptimizer):
    """Each rank steps on its own gradients; every ``k`` steps the parameters are allreduced and
    divided by the number of ranks (a synchronous collective, so the slowest rank sets the pace
    once per ``k`` steps instead of every step). With ``k=1`` and plain SGD this is synchronous
    data parallelism: the average of ``w - lr * g_r`` is ``w - lr * mean(g_r)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 1, group=None) -> None:
        if int(k) < 1:
            raise ValueError(f"ModelAveraging: k must be at least 1, got {k}")
        super().__init__(optimizer, group)
        self.k = int(k)

    def after_step(self) -> None:
        if self.steps % self.k == 0:
            self._average()

    def _average(self) -> None:
        flat = self.flat()
        allreduce(flat, "avg", group=self.group)
        self.assign(flat)

    def consolidate(self) -> None:
        """Average now (collective), whatever the step count."""
        with torch.no_grad():
            self._average()
