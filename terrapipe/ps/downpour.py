"""Downpour SGD: every rank pushes its updates to the parameter server and pulls the server's
parameters back, each on its own period, never waiting for another rank.

NOTE [downpour bookkeeping]
    1. ``base`` is what the server is known to contain of this rank's work: the parameters at
       the last push (or at the last pull applied). Every ``n_push`` steps the rank pushes
       ``params - base`` (the local optimizer's accumulated updates) with rule "add", and sets
       ``base = params``.
    2. Every ``n_pull`` steps it issues a pull; it lands at a later step (or before the next
       push, which waits for it): ``params = pulled + (params - base)``, ``base = pulled``. The
       pull ran after every earlier push of this rank (NOTE [shard chunks] 2) and no push ran
       since it was issued, so updates not yet pushed are kept and none is counted twice.
    3. Every rank's update lands on the server in full: with ``p`` ranks the server moves up to
       ``p`` times as far per step as one rank's optimizer would, as in asynchronous SGD.
       Scale the learning rate accordingly.
"""

from __future__ import annotations

import torch

from ..comm import barrier
from .tensor import ShardedTensor
from .wrapper import ModeOptimizer

__all__ = ["Downpour"]


class Downpour(ModeOptimizer):
    """Downpour SGD over a :class:`ShardedTensor` of the parameters (NOTE [downpour
    bookkeeping]). ``n_push``/``n_pull``: steps between pushes and between pulls. Parameters
    must be on the CPU or CUDA (staged through host memory)."""

    def __init__(self, optimizer: torch.optim.Optimizer, n_push: int = 1, n_pull: int = 1,
                 group=None, chunk_bytes: int = 1 << 20) -> None:
        for name, v in (("n_push", n_push), ("n_pull", n_pull)):
            if int(v) < 1:
                raise ValueError(f"Downpour: {name} must be at least 1, got {v}")
        super().__init__(optimizer, group)
        self.n_push, self.n_pull = int(n_push), int(n_pull)
        flat = self.flat()
        host = flat.detach().to("cpu")
        self.server = ShardedTensor(host, self.group, chunk_bytes)
        self._base = flat.clone()
        self._delta = torch.empty_like(host)
        self._pulled = torch.empty_like(host)
        self._push = self._pull = None

    def after_step(self) -> None:
        if self._pull is not None and self._pull.done():
            self._land_pull()
        if self.steps % self.n_push == 0:
            self._push_updates()
        if self.steps % self.n_pull == 0 and self._pull is None:
            self._pull = self.server.pull(self._pulled)

    def _push_updates(self) -> None:
        if self._pull is not None:
            self._land_pull()  # NOTE [downpour bookkeeping] 2
        if self._push is not None:
            self._push.wait()  # _delta is the push's until it completes
        flat = self.flat()
        self._delta.copy_(flat - self._base)
        self._base.copy_(flat)
        self._push = self.server.push(self._delta, "add")

    def _land_pull(self) -> None:
        self._pull.wait()
        self._pull = None
        flat = self.flat()
        pulled = self._pulled.to(flat.device)
        self.assign(pulled + (flat - self._base))
        self._base.copy_(pulled)

    def consolidate(self) -> None:
        """Collective: push what is left, wait until every rank has, then take the server's
        parameters."""
        with torch.no_grad():
            self._push_updates()
            self._push.wait()
            barrier(group=self.group)
            self._pull = self.server.pull(self._pulled)
            self._land_pull()

    def close(self) -> None:
        self.server.close()
