"""Elastic averaging SGD (EASGD, Zhang, Choromanska and LeCun 2015), asynchronous form: every
``tau`` steps a rank pulls the center variable from the parameter server, moves towards it by
``alpha * (x - center)`` and pushes the same amount onto the center."""

from __future__ import annotations

import torch

from ..comm import barrier
from .tensor import ShardedTensor
from .wrapper import ModeOptimizer

__all__ = ["EASGD"]


class EASGD(ModeOptimizer):
    """Each rank's parameters ``x`` are held elastically to a center ``c`` on the parameter
    server: every ``tau`` steps ``d = alpha * (x - c)``, ``x -= d``, ``c += d`` (the push, an
    "add" that never loses another rank's). ``alpha`` defaults to ``0.9 / size`` (the paper's
    ``beta = p * alpha = 0.9``). The center starts as rank 0's parameters; :meth:`consolidate`
    makes it every rank's model."""

    def __init__(self, optimizer: torch.optim.Optimizer, alpha: float | None = None, tau: int = 1,
                 group=None, chunk_bytes: int = 1 << 20) -> None:
        if int(tau) < 1:
            raise ValueError(f"EASGD: tau must be at least 1, got {tau}")
        super().__init__(optimizer, group)
        self.alpha = 0.9 / self.group.size if alpha is None else float(alpha)
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"EASGD: alpha must be in (0, 1), got {alpha}")
        self.tau = int(tau)
        host = self.flat().detach().to("cpu")
        self.center = ShardedTensor(host, self.group, chunk_bytes)
        self._center = torch.empty_like(host)
        self._diff = torch.empty_like(host)
        self._push = None

    def after_step(self) -> None:
        if self.steps % self.tau == 0:
            self._elastic()

    def _elastic(self) -> None:
        if self._push is not None:
            self._push.wait()  # _diff is the push's until it completes
        self.center.pull(self._center).wait()
        flat = self.flat()
        diff = (flat - self._center.to(flat.device)).mul_(self.alpha)
        self.assign(flat - diff)
        self._diff.copy_(diff)
        self._push = self.center.push(self._diff, "add")

    def consolidate(self) -> None:
        """Collective: wait until every rank's pushes landed, then take the center."""
        with torch.no_grad():
            if self._push is not None:
                self._push.wait()
            barrier(group=self.group)
            flat = self.flat()
            self.assign(self.center.pull(self._center).wait().to(flat.device))

    def close(self) -> None:
        self.center.close()
