"""terrapipe.engine: data-parallel training over terrapipe.comm and terrapipe.pipeline.

broadcast_parameters / broadcast_optimizer_state start every rank from the same state;
DistributedGradients averages gradients in buckets overlapped with backward;
DistributedOptimizer wraps any torch optimizer on top of it; Engine runs train/test loops with
hooks, progress, metrics and checkpoints; AutoTuner searches the communication knobs while
training runs; ``terrapipe run`` launches ranks.

The names load on first use: ``terrapipe run``'s per-rank wrapper (``python -m
terrapipe.engine.rank_status``) imports this package, and must not pay for torch (3 s a rank on
two cores) before the rank's own command starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy loader below returns, for readers and type checkers
    from .autotune import AutoTuner
    from .commit import Commit, kept_copy
    from .function_job import FunctionJobError, run_function
    from .gradients import DistributedGradients
    from .optimizer import DistributedOptimizer
    from .sync import broadcast_optimizer_state, broadcast_parameters
    from .trainer import HOOKS, CheckpointError, Engine, load_checkpoint

__all__ = ["AutoTuner", "CheckpointError", "Commit", "kept_copy", "DistributedGradients", "FunctionJobError",
           "run_function",
           "DistributedOptimizer", "Engine", "HOOKS",
           "load_checkpoint",
           "broadcast_optimizer_state", "broadcast_parameters"]

_MODULE_OF = {"AutoTuner": ".autotune", "Commit": ".commit", "kept_copy": ".commit",
              "FunctionJobError": ".function_job", "run_function": ".function_job",
              "DistributedGradients": ".gradients",
              "DistributedOptimizer": ".optimizer", "broadcast_optimizer_state": ".sync",
              "broadcast_parameters": ".sync", "HOOKS": ".trainer", "CheckpointError": ".trainer",
              "Engine": ".trainer", "load_checkpoint": ".trainer"}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'terrapipe.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
