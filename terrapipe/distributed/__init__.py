"""terrapipe.distributed: the ``"terrapipe"`` backend of torch.distributed (imports comm).

Once terrapipe is installed, ``import torch`` registers the backend's name (the
``torch.backends`` entry point, :mod:`terrapipe.torch_backend`), so a script changes one word::

    dist.init_process_group(backend="terrapipe")   # under torchrun, or any init_method
    model = DDP(model)

Importing this package registers it too (where torch's entry points are switched off with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

Under ``mpiexec`` or ``terrapipe run``, where torch's variables are not set,
:func:`init_process_group` finds the world from the MPI launcher and meets over ``tcp://``.
See NOTE [the terrapipe process group] in process_group.py for how calls are served.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from .. import launch_env
from ..comm import hosted_tcp_store
from ..torch_backend import BACKEND, register
from .process_group import ProcessGroupTerrapipe, create

__all__ = ["ProcessGroupTerrapipe", "BACKEND", "create", "register", "init_process_group"]


def init_process_group(backend: str = BACKEND, timeout: float = 300.0, mpi_comm=None) -> None:
    """``dist.init_process_group`` wherever the job was launched.

    torchrun / SLURM with MASTER_ADDR (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): torch's
    ``env://``. An MPI launcher (``mpiexec``, ``terrapipe run``): rank and size from MPI
    (``mpi_comm``, default ``MPI.COMM_WORLD``); rank 0 binds a free port on its host and
    broadcasts ``tcp://host:port`` over MPI. A lone process: a world of one. backend: any
    torch.distributed backend name ("terrapipe", "gloo", ...); timeout: seconds per collective.
    """
    td = datetime.timedelta(seconds=float(timeout))
    if launch_env.torch_launched():
        dist.init_process_group(backend, timeout=td)
        return
    if mpi_comm is None and not launch_env.mpi_launched():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
        return
    if mpi_comm is None:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    store = hosted_tcp_store(rank, size, lambda where: mpi_comm.bcast(where, root=0), timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=td)


register()
