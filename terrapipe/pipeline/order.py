"""Sample order: a pure function of (seed, epoch, rank, world_size), DistributedSampler's rules."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["epoch_indices"]


def epoch_indices(n: int, *, seed: int, epoch: int, shuffle: bool, rank: int, world_size: int,
                  drop_tail: bool = False) -> np.ndarray:
    """This rank's sample indices for ``epoch`` (int64).

    Exactly ``torch.utils.data.DistributedSampler``: a ``torch.randperm`` seeded with
    ``seed + epoch`` (or 0..n-1), padded by wrap-around to a multiple of ``world_size`` (or, with
    ``drop_tail``, truncated), then every ``world_size``-th index from ``rank``. Every sample
    appears once per epoch across ranks, and every rank gets the same count.
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).numpy()
    else:
        order = np.arange(n, dtype=np.int64)
    if drop_tail and n % world_size:
        total = (n // world_size) * world_size
        order = order[:total]
    else:
        total = math.ceil(n / world_size) * world_size
        pad = total - n
        if pad:
            reps = math.ceil(pad / n)
            order = np.concatenate([order] + [order] * reps)[:total]
    return order[rank:total:world_size].astype(np.int64)
