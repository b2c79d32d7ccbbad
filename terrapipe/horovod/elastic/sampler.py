"""hvd.elastic.ElasticSampler (horovod.torch.elastic.sampler): DistributedSampler's dealing of an
epoch over the ranks, which after a reset deals only the indices not yet processed over the new
world."""

from __future__ import annotations

import math
import random

import torch.utils.data

from .. import basics

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Indices of ``dataset`` for this rank; ``shuffle`` with ``seed + epoch`` (the same order on
    every rank). The epoch's order is fixed; ``processed_num`` (the same on every rank: each
    :meth:`record_batch` adds ``batch_size * world size``) marks how far the world has come in
    it. After a reset, ``state_dict``/``load_state_dict`` (what TorchState syncs) re-deal the
    rest, ``indices[processed_num:]``, over the new ranks: rank r takes every size-th index from
    r, the last ones repeated to make it even (as DistributedSampler pads).

    Call :meth:`record_batch` after each batch and :meth:`set_epoch` at the *end* of an epoch
    (it clears the processed count, so calling it at the start of a resumed epoch would redo
    samples).
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first index."""
        self.epoch = int(epoch)
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """``batch_size`` samples were processed on every rank."""
        self.processed_num += int(batch_size) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Deal the epoch's unprocessed indices over the world as it is now."""
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        pad = self.total_size - len(indices)
        while pad > 0 and indices:  # repeat from the start, as often as it takes
            indices += indices[:pad]
            pad = self.total_size - len(indices)
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
