"""What an elastic Engine keeps in memory to survive a rank's death: a commit of the training
state every few steps, restored on every survivor when a collective fails (Engine(elastic=True),
docs/elastic.md).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

__all__ = ["Commit", "kept_copy"]


def kept_copy(saved, current):
    """A copy of ``current`` (a ``state_dict``: nested dicts, lists and tuples of tensors and
    plain values) for a commit, written into ``saved``'s tensors where the structure, shapes,
    dtypes and devices match, else new. A commit every few steps then copies at memory bandwidth
    and allocates nothing: 31 ms where a ``deepcopy`` takes 50 ms, for a 26M-parameter model with
    SGD momentum (docs/elastic.md). ``current`` is not aliased; ``saved`` is reused."""
    if isinstance(current, torch.Tensor):
        if (isinstance(saved, torch.Tensor) and saved.shape == current.shape and saved.dtype == current.dtype
                and saved.device == current.device and saved.layout == current.layout == torch.strided):
            return saved.copy_(current.detach())
        return current.detach().clone()
    if isinstance(current, dict):
        old = saved if isinstance(saved, dict) else {}
        return {k: kept_copy(old.get(k), v) for k, v in current.items()}
    if isinstance(current, (list, tuple)):
        same = isinstance(saved, (list, tuple)) and len(saved) == len(current)
        olds = saved if same else [None] * len(current)
        out = [kept_copy(o, v) for o, v in zip(olds, current, strict=True)]
        if isinstance(current, list):
            return out
        return type(current)(*out) if hasattr(current, "_fields") else type(current)(out)  # namedtuple
    return copy.deepcopy(current)


class Commit:
    """The training state at one step: the model's and the optimizer's state dicts, the train
    loader's position, the epoch's metric sums, the history, the step count and torch's CPU
    random state. :meth:`take` overwrites it (reusing its tensors); :meth:`put_back` restores
    it into the objects it was taken from (the optimizer gets a copy: torch's
    ``Optimizer.load_state_dict`` keeps the tensors it is given)."""

    def __init__(self) -> None:
        self.model = self.optimizer = None
        self.loader: dict | None = None
        self.epoch = self.step = 0
        self.sums = np.zeros(3)
        self.history: list[dict] = []
        self.rng: torch.Tensor | None = None

    def take(self, model: torch.nn.Module, optimizer, loader_state: dict, epoch: int, step: int,
             sums: np.ndarray, history: list[dict]) -> None:
        self.model = kept_copy(self.model, model.state_dict())
        self.optimizer = kept_copy(self.optimizer, optimizer.state_dict())
        self.loader = dict(loader_state)
        self.epoch, self.step = int(epoch), int(step)
        self.sums = np.array(sums, copy=True)
        self.history = copy.deepcopy(history)
        self.rng = torch.get_rng_state()

    def put_back(self, model: torch.nn.Module, optimizer, loader) -> None:
        model.load_state_dict(self.model)
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        loader.load_state_dict(self.loader)
        torch.set_rng_state(self.rng)
