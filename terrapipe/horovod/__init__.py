"""terrapipe.horovod: horovod.torch's API (0.28) on terrapipe's comm and engine.

    import terrapipe.horovod as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Run with ``terrapipe run -np 4 python train.py`` (or mpiexec); ``terrapipe run --horovod`` makes
an unmodified ``import horovod.torch as hvd`` resolve to this module. Collectives are matched by
name across ranks as Horovod matches them (NOTE [name negotiation] in negotiation.py). Elastic
training: ``hvd.elastic`` under ``terrapipe run --horovod --min-np ...``. ``op=hvd.Adasum``
reduces by Adasum (comm.adasum_allreduce; DistributedOptimizer's delta optimizer). Not
supported: TensorFlow/Keras/MXNet.
"""

from . import elastic  # noqa: E402 (needs the names above)
from .basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
)
from .compression import Compression
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "ProcessSet", "add_process_set", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "global_process_set", "init", "is_homogeneous", "is_initialized",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
    "remove_process_set", "rocm_built", "shutdown", "size",
    "Compression", "HorovodInternalError", "HostsUpdatedInterrupt",
    "Adasum", "Average", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "join", "poll",
    "reducescatter", "reducescatter_async", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "synchronize",
    "DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters", "SyncBatchNorm", "elastic",
]
