"""Sample order: a pure function of (seed, epoch, rank, world_size), DistributedSampler's rules,
and the rest of an epoch after its first ``start`` samples (a resume, at any world size)."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["epoch_indices"]


def epoch_indices(n: int, *, seed: int, epoch: int, shuffle: bool, rank: int, world_size: int,
                  drop_tail: bool = False, start: int = 0) -> np.ndarray:
    """This rank's sample indices for ``epoch`` (int64).

    Exactly ``torch.utils.data.DistributedSampler``: a ``torch.randperm`` seeded with
    ``seed + epoch`` (or 0..n-1), padded by wrap-around to a multiple of ``world_size`` (or, with
    ``drop_tail``, truncated), then every ``world_size``-th index from ``rank``. Every sample
    appears once per epoch across ranks, and every rank gets the same count.

    ``start``: the epoch's first ``start`` samples (of the permutation, before padding) are
    consumed already: the rest, ``order[start:]``, is padded by wrap-around from the
    permutation's beginning (at most ``world_size - 1`` samples) and dealt the same way. With
    ``start`` a multiple of ``world_size`` this is the tail of the uninterrupted deal; at another
    world size it is the same samples in the same global order (global position ``rank +
    world_size * i`` is rank ``rank``'s i-th), each once.
    """
    if not 0 <= start <= n:
        raise ValueError(f"start must be in [0, {n}], got {start}")
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).numpy()
    else:
        order = np.arange(n, dtype=np.int64)
    end = (n // world_size) * world_size if drop_tail and n % world_size else n
    rest = order[min(start, end):end]
    total = math.ceil(len(rest) / world_size) * world_size
    if total > len(rest):
        rest = np.concatenate([rest, np.resize(order, total - len(rest))])
    return rest[rank:total:world_size].astype(np.int64)
