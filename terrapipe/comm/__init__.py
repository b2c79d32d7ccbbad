"""terrapipe.comm: process groups and collectives (imports kernels, never pipeline).

Ranks on a node exchange through shared memory and reduce with the kernels; nodes exchange
through MPI (mpi4py). See collectives.py for the functions, group.py for how they run,
staging.py for CUDA tensors copied through pinned host memory and nccl.py for NCCL.
"""

from .collectives import (
    Group,
    Handle,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    clock_alignment,
    finalize,
    forced_backend,
    gather,
    init,
    is_initialized,
    jit_allreduce,
    local_rank,
    local_size,
    rank,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
    size,
    world,
)
from .errors import CollectiveMismatchError, CollectiveTimeoutError, CommError
from .store import StoreComm

__all__ = [
    "Group", "Handle", "allgather", "allreduce", "barrier", "broadcast", "broadcast_object",
    "clock_alignment", "finalize", "forced_backend", "gather",
    "init", "is_initialized", "jit_allreduce", "local_rank", "local_size", "rank", "recv",
    "reduce", "reduce_scatter", "scatter", "send", "size", "world",
    "CollectiveMismatchError", "CollectiveTimeoutError", "CommError", "StoreComm",
]
