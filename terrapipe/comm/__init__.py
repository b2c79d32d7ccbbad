"""terrapipe.comm: process groups and collectives (imports kernels, never pipeline).

Ranks on a node exchange through shared memory and reduce with the kernels; nodes exchange
through MPI (mpi4py). collectives.py holds the functions; group.py the groups (membership,
topology, agreement); execution.py the order calls run in; select.py picks, per call, an
algorithm (algorithms/) and the transport it runs over (transports/); staging.py copies CUDA
tensors through pinned host memory.
"""

from .collectives import (
    Group,
    Handle,
    adasum_allreduce,
    allgather,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    clock_alignment,
    cuda_collectives,
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
from .dtypes import DTYPES, DType
from .errors import CollectiveMismatchError, CollectiveTimeoutError, CommError, SetupAbandoned
from .ops import OPS, Op
from .rendezvous import Generations, WorkerRemoved, is_elastic, pending_update
from .sockets import connect_ranks, interface_addresses
from .store import StoreComm, hosted_tcp_store, node_of
from .transports.shm import Segment, alive
from .wait import wait_until

__all__ = [
    "Group", "Handle", "adasum_allreduce", "allgather", "allreduce", "barrier", "broadcast",
    "broadcast_object", "clock_alignment", "cuda_collectives", "finalize", "forced_backend", "gather",
    "init", "is_initialized", "jit_allreduce", "local_rank", "local_size", "rank", "recv",
    "reduce", "reduce_scatter", "scatter", "send", "size", "world",
    "CollectiveMismatchError", "CollectiveTimeoutError", "CommError", "SetupAbandoned",
    "Generations", "WorkerRemoved", "is_elastic", "pending_update", "StoreComm", "Segment", "alive",
    "wait_until", "hosted_tcp_store", "node_of", "connect_ranks", "interface_addresses", "OPS", "Op",
    "DTYPES", "DType",
]
