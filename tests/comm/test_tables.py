"""The one op table and the one dtype table (comm/ops.py, comm/dtypes.py) against what they
describe: the kernels, the libraries' op names, and the dtypes a collective moves or reduces."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import terrapipe.comm as comm
from terrapipe.kernels import reduce as kreduce


def test_every_kernel_op_has_one_row_naming_ops_every_library_has():
    assert sorted(op.name for op in comm.OPS) == sorted(kreduce.OPS)
    assert len({op.code for op in comm.OPS}) == len(comm.OPS)
    for op in comm.OPS:
        assert isinstance(getattr(MPI, op.mpi), MPI.Op), op
        assert getattr(dist.ReduceOp, op.torch) is not None and getattr(dist.ReduceOp, op.gloo)
    # Horovod's ReduceOp values (horovod/common/basics.py): Average 0, Sum 1, Min 3, Max 4, Product 5.
    assert {op.name: op.horovod for op in comm.OPS} == {"avg": 0, "sum": 1, "min": 3, "max": 4,
                                                         "prod": 5}


def test_codes_are_unique_and_every_dtype_moves_and_reduces_as_its_row_says():
    assert len({d.code for d in comm.DTYPES}) == len({d.name for d in comm.DTYPES}) == len(comm.DTYPES)
    for d in comm.DTYPES:
        x = torch.ones(6, dtype=getattr(torch, d.name)) if d.name == "bfloat16" else \
            np.ones(6, d.name)
        # A lone process runs every collective locally: a dtype moves if broadcast takes it.
        comm.broadcast(x, 0, group=comm.Group(None))
        if d.reduced:
            comm.allreduce(x, "max", group=comm.Group(None))
        else:
            with pytest.raises(TypeError, match="unsupported dtype"):
                kreduce.kernel_dtype(np.ones(6, d.name))
    with pytest.raises(TypeError, match="complex64"):
        comm.broadcast(np.ones(3, np.complex64), 0, group=comm.Group(None))
