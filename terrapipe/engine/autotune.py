"""Autotune: the communication knobs searched online during the first steps of training.

    opt = DistributedOptimizer(torch.optim.SGD(...), model, autotune=True)   # or TERRAPIPE_AUTOTUNE=1,
                                                                              # or terrapipe run --autotune

NOTE [autotune]
    1. Knobs (``SPACE``): the bucket size and the first bucket's size (how gradients are cut for
       reduction during backward), and the MPI ring's threshold and message size (which allreduces
       take our ring instead of MPI's own, and in what pieces). The ring's two are searched only
       where the group has MPI to tune.
    2. Search: block coordinate descent (:class:`CoordinateSearch`). Starting from the
       configuration in use, one block of knobs at a time takes each combination of its values
       with the others at the best so far, and keeps the best; ``passes`` rounds over the blocks.
       The bucket sizes are a block each; the ring's two knobs are one block, since the message
       size matters only above the threshold and one knob at a time stalls there. Each block
       measures the best so far again and compares only its own measurements, so a machine whose
       speed drifts during the search cannot crown an early, lucky trial. At the defaults that is
       3 + 3 + 9 = 15 trials of 1 + 4 steps, 75 steps (Horovod's Bayesian optimisation samples
       for longer; a grid this small needs no model of the response).
    3. A trial runs ``warmup`` steps (the new buckets' first use) and then ``steps`` measured ones.
       Its score is the median step time (end of one ``optimizer.step()`` to the end of the next,
       so data loading and compute count), the maximum over ranks: every rank gets the same
       numbers and so takes the same decisions, and a change applies on every rank at the same
       step, after ``optimizer.step()`` and before the next backward (rebucketing, Group.tune).
    4. The best configuration is cached per model (parameter shapes and dtypes, reduction
       backend) and world (ranks, ranks per node, nodes) in a JSON file (``TERRAPIPE_AUTOTUNE_CACHE``,
       default ``~/.cache/terrapipe/autotune.json``); a later run with the same key applies it
       with no trials. Rank 0 reads and writes it and broadcasts what it found.
    5. Every trial is logged (logger ``terrapipe.autotune``, and on rank 0 a CSV row per trial in
       ``TERRAPIPE_AUTOTUNE_LOG`` when set, as Horovod's ``--autotune-log-file``).
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np

from .. import comm, settings

__all__ = ["SPACE", "CoordinateSearch", "AutoTuner", "cache_path", "default_blocks"]

log = logging.getLogger("terrapipe.autotune")

SPACE: dict[str, tuple[float, ...]] = {
    "bucket_mb": (5.0, 25.0, 100.0),
    "first_bucket_mb": (0.25, 1.0, 4.0),
    "ring_kb": (256.0, 1024.0, 8192.0),
    "ring_chunk_kb": (128.0, 512.0, 2048.0),
}
_RING_KNOBS = ("ring_kb", "ring_chunk_kb")


def _key(config: Mapping[str, float]) -> tuple:
    return tuple(sorted(config.items()))


def default_blocks(knobs: Sequence[str]) -> list[tuple[str, ...]]:
    """Each knob alone, but the ring's threshold and message size together: the message size
    matters only for allreduces above the threshold, so one at a time can stall where neither
    change alone helps (NOTE [autotune] 2)."""
    ring = tuple(k for k in _RING_KNOBS if k in knobs)
    blocks = [(k,) for k in knobs if k not in ring]
    return blocks + ([ring] if ring else [])


class CoordinateSearch:
    """Block coordinate descent over a grid (NOTE [autotune] 2): :meth:`next` gives the
    configuration to measure (None when done), :meth:`report` its score (lower is better). Each
    block of knobs (default :func:`default_blocks`) takes every combination of its values with
    the other knobs at the best so far, the best so far measured again first; the block's best,
    on the scores of that block alone, becomes the best so far."""

    def __init__(self, space: Mapping[str, Sequence[float]], start: Mapping[str, float], passes: int = 1,
                 blocks: Sequence[Sequence[str]] | None = None) -> None:
        if set(start) != set(space):
            raise ValueError(f"start: expected the knobs {sorted(space)}, got {sorted(start)}")
        if passes < 1:
            raise ValueError(f"passes must be >= 1, got {passes}")
        self.space = {k: tuple(v) for k, v in space.items()}
        blocks = default_blocks(list(space)) if blocks is None else [tuple(b) for b in blocks]
        if sorted(k for b in blocks for k in b) != sorted(space):
            raise ValueError(f"blocks: each knob of {sorted(space)} must be in exactly one block")
        self.best = dict(start)
        self.best_score = float("inf")
        self.trials: list[tuple[dict[str, float], float]] = []
        self._plan = [b for _ in range(passes) for b in blocks]
        self._pending: list[dict[str, float]] = []
        self._block: list[tuple[dict[str, float], float]] = []  # the block under way, as measured

    def next(self) -> dict[str, float] | None:
        while not self._pending:
            if self._block:
                # Compared within the block only: a machine whose speed drifts over the search
                # cannot make an early, lucky measurement win (hence the incumbent's new one).
                self.best, self.best_score = min(self._block, key=lambda t: t[1])
                self._block = []
            if not self._plan:
                return None
            block = self._plan.pop(0)
            combos = itertools.product(*(self.space[k] for k in block))
            candidates = [{**self.best, **dict(zip(block, vals, strict=True))} for vals in combos]
            incumbent = _key(self.best)
            self._pending = [dict(self.best)] + [c for c in candidates if _key(c) != incumbent]
        return dict(self._pending[0])

    def report(self, config: Mapping[str, float], score: float) -> None:
        config = dict(config)
        if not self._pending or _key(config) != _key(self._pending[0]):
            raise ValueError(f"report: {config} is not the configuration next() gave")
        self._pending.pop(0)
        self._block.append((config, float(score)))
        self.trials.append((config, float(score)))


def cache_path() -> str:
    return settings.get("TERRAPIPE_AUTOTUNE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "terrapipe", "autotune.json")


class AutoTuner:
    """Tunes a :class:`DistributedGradients` and its group while training runs; call
    :meth:`after_step` after every ``optimizer.step()`` (DistributedOptimizer does). ``config``:
    the configuration in use."""

    def __init__(self, gradients, space: Mapping[str, Sequence[float]] | None = None, warmup: int = 1,
                 steps: int = 4, passes: int = 1, cache: str | None = None) -> None:
        if warmup < 0 or steps < 1:
            raise ValueError(f"warmup must be >= 0 and steps >= 1, got {warmup}, {steps}")
        self.gradients = gradients
        self.group = gradients.group
        self.warmup, self.steps = int(warmup), int(steps)
        self.cache = cache or cache_path()
        space = dict(SPACE if space is None else space)
        if not gradients.sized:
            space.pop("bucket_mb", None)
            space.pop("first_bucket_mb", None)
        if not self.group.uses_ring():
            for k in _RING_KNOBS:  # nothing to tune: no collective of this group uses the ring
                space.pop(k, None)
        self.space = space
        self.key = self._cache_key()
        self.search: CoordinateSearch | None = None
        self.done = False
        self._samples: list[float] = []
        self._last: float | None = None
        cached = self._load_cached()
        if cached is not None:
            self.config = cached
            self._apply(cached)
            self.done = True
            log.info("autotune: cached configuration %s (%s)", cached, self.cache)
            return
        self.search = CoordinateSearch(space, self.current(), passes)
        self.config = self.search.next()
        self._apply(self.config)

    @property
    def trials(self) -> list[tuple[dict[str, float], float]]:
        """(configuration, score in seconds) in the order measured; none when the cache answered."""
        return self.search.trials if self.search is not None else []

    # -- the knobs ---------------------------------------------------------------------------
    def current(self) -> dict[str, float]:
        """The configuration in use, for the knobs being tuned."""
        t = self.group.tuning()
        now = {"bucket_mb": self.gradients.bucket_mb, "first_bucket_mb": self.gradients.first_bucket_mb,
               "ring_kb": t["ring_bytes"] / 1024, "ring_chunk_kb": t["ring_chunk_bytes"] / 1024}
        return {k: now[k] for k in self.space}

    def _apply(self, config: Mapping[str, float]) -> None:
        g = self.gradients
        if "bucket_mb" in config and (config["bucket_mb"], config["first_bucket_mb"]) != (g.bucket_mb,
                                                                                         g.first_bucket_mb):
            g.rebucket(config["bucket_mb"], config["first_bucket_mb"])
        if "ring_kb" in config:
            self.group.tune(ring_bytes=int(config["ring_kb"] * 1024),
                            ring_chunk_bytes=int(config["ring_chunk_kb"] * 1024))

    # -- stepping ------------------------------------------------------------------------------
    def after_step(self) -> None:
        """Count one finished step; at the end of a trial, score it and move to the next."""
        if self.done:
            return
        now = time.perf_counter()
        if self._last is not None:
            self._samples.append(now - self._last)
        self._last = now
        if len(self._samples) < self.warmup + self.steps:
            return
        local = statistics.median(self._samples[self.warmup:])
        score = float(comm.allreduce(np.array([local]), "max", group=self.group)[0])
        self.search.report(self.config, score)
        self._log_trial(self.config, score)
        nxt = self.search.next()
        if nxt is None:
            self.done = True
            self.config = dict(self.search.best)
            self._apply(self.config)
            self._save()
            log.info("autotune: best %s at %.2f ms per step after %d trials", self.config,
                     1e3 * self.search.best_score, len(self.trials))
        else:
            self.config = nxt
            self._apply(nxt)
        self._samples = []
        self._last = time.perf_counter()  # the change itself is not a step's time

    def _log_trial(self, config: Mapping[str, float], score: float) -> None:
        log.info("autotune trial %d: %s -> %.2f ms per step", len(self.trials), dict(config), 1e3 * score)
        path = settings.get("TERRAPIPE_AUTOTUNE_LOG")
        if path and self.group.rank == 0:
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["trial", *config.keys(), "step_ms"])
                w.writerow([len(self.trials), *config.values(), f"{1e3 * score:.3f}"])

    # -- the cache -------------------------------------------------------------------------------
    def _cache_key(self) -> str:
        g = self.gradients
        desc = {"params": [[list(p.shape), str(p.dtype)] for b in g.buckets for p in b],
                "backend": g.backend, "size": self.group.size, "local_size": self.group.local_size,
                "nodes": self.group.nnodes, "knobs": sorted(self.space)}
        return hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()

    def _read_cache(self) -> dict:
        try:
            with open(self.cache) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("autotune: ignoring unreadable cache %s (%s)", self.cache, e)
            return {}
        return data if isinstance(data, dict) else {}

    def _load_cached(self) -> dict[str, float] | None:
        knobs = list(self.space)
        msg = np.zeros(1 + len(knobs))
        if self.group.rank == 0:
            entry = self._read_cache().get(self.key)
            if isinstance(entry, dict) and isinstance(entry.get("config"), dict):
                try:
                    msg[1:] = [float(entry["config"][k]) for k in knobs]
                    msg[0] = 1.0
                except (KeyError, TypeError, ValueError):
                    log.warning("autotune: ignoring a malformed entry in %s", self.cache)
        if self.group.size > 1:
            comm.broadcast(msg, 0, group=self.group)
        if not msg[0]:
            return None
        return {k: float(v) for k, v in zip(knobs, msg[1:], strict=True)}

    def _save(self) -> None:
        if self.group.rank != 0:
            return
        data = self._read_cache()
        data[self.key] = {"config": self.config, "step_ms": 1e3 * self.search.best_score,
                          "trials": len(self.trials), "saved": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            os.makedirs(os.path.dirname(self.cache) or ".", exist_ok=True)
            tmp = f"{self.cache}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.cache)
        except OSError as e:
            log.warning("autotune: could not write the cache %s (%s)", self.cache, e)
