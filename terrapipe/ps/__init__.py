"""terrapipe.ps: a parameter server (tensors sharded over a group's ranks, pushed to and pulled
from asynchronously) and the asynchronous training modes built on it.

    t = ps.ShardedTensor(init, group=None)   # collective
    t.push(x, rule="add", scale=1.0)         # "add" | "copy" | "zero"; returns a Handle
    t.pull(out).wait()
    t.close()                                # collective

Modes (optimizer wrappers, usable with ``terrapipe.engine.Engine``): :class:`Downpour`,
:class:`EASGD`, :class:`ModelAveraging`. Imports comm and kernels only.
"""

from ..comm import Handle
from .averaging import ModelAveraging
from .downpour import Downpour
from .easgd import EASGD
from .tensor import ShardedTensor
from .wrapper import ModeOptimizer, WrappedOptimizer

__all__ = ["Handle", "ShardedTensor", "ModeOptimizer", "WrappedOptimizer", "Downpour", "EASGD",
           "ModelAveraging"]
