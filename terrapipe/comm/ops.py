"""The reduce ops: one table of each op's name and what each library calls it.

terrapipe names an op (``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"prod"``); the reduction
kernels take its code (``kernels.reduce.OPS`` defines names and codes). A transport that hands a
reduction to its library asks for the library's op by its name in this table (``getattr(MPI,
op.mpi)``, ``getattr(torch.distributed.ReduceOp, op.gloo)``); the Horovod and torch.distributed
front ends map their own op values through it. ``avg`` is a sum to MPI and Gloo (neither has an
average) and the caller divides once at the end (``message.divide``); NCCL averages floats.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import reduce as kreduce

__all__ = ["Op", "OPS", "by_code"]


@dataclass(frozen=True)
class Op:
    name: str     # terrapipe's name (a key of kernels.reduce.OPS)
    mpi: str      # mpi4py's MPI.<name>: the op MPI reduces by (a sum for avg)
    torch: str    # torch.distributed.ReduceOp.<name> with the same meaning
    gloo: str     # the ReduceOp Gloo reduces by (Gloo has no AVG: a sum for avg)
    horovod: int  # horovod.common's ReduceOp value

    @property
    def code(self) -> int:
        """The kernels' code (``kernels.reduce.SUM`` ...)."""
        return kreduce.OPS[self.name]


#    name    MPI     torch      Gloo       Horovod
OPS = (
    Op("sum", "SUM", "SUM", "SUM", 1),
    Op("avg", "SUM", "AVG", "SUM", 0),
    Op("prod", "PROD", "PRODUCT", "PRODUCT", 5),
    Op("min", "MIN", "MIN", "MIN", 3),
    Op("max", "MAX", "MAX", "MAX", 4),
)
_BY_CODE = {op.code: op for op in OPS}


def by_code(code: int) -> Op | None:
    """The op of kernel code ``code`` (``kernels.reduce.SUM`` ...), or None."""
    return _BY_CODE.get(code)
