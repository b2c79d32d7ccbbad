"""terrapipe.engine: data-parallel training over terrapipe.comm and terrapipe.pipeline.

broadcast_parameters / broadcast_optimizer_state start every rank from the same state;
DistributedGradients averages gradients in buckets overlapped with backward;
DistributedOptimizer wraps any torch optimizer on top of it; ``terrapipe run`` launches ranks.
"""

from .gradients import DistributedGradients
from .optimizer import DistributedOptimizer
from .sync import broadcast_optimizer_state, broadcast_parameters

__all__ = ["DistributedGradients", "DistributedOptimizer", "broadcast_optimizer_state",
           "broadcast_parameters"]
