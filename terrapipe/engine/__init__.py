"""terrapipe.engine: data-parallel training over terrapipe.comm and terrapipe.pipeline.

broadcast_parameters / broadcast_optimizer_state start every rank from the same state;
DistributedGradients averages gradients in buckets overlapped with backward;
DistributedOptimizer wraps any torch optimizer on top of it; Engine runs train/test loops with
hooks, progress, metrics and checkpoints; AutoTuner searches the communication knobs while
training runs; ``terrapipe run`` launches ranks.
"""

from .autotune import AutoTuner
from .gradients import DistributedGradients
from .optimizer import DistributedOptimizer
from .sync import broadcast_optimizer_state, broadcast_parameters
from .trainer import HOOKS, CheckpointError, Engine, load_checkpoint

__all__ = ["AutoTuner", "CheckpointError", "DistributedGradients", "DistributedOptimizer", "Engine", "HOOKS",
           "load_checkpoint",
           "broadcast_optimizer_state", "broadcast_parameters"]
