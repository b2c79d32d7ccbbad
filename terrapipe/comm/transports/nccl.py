"""The NCCL transport for CUDA tensors: a torch.distributed NCCL process group beside a Group's
host transports.

``comm.allreduce``, ``broadcast`` and ``allgather`` of CUDA tensors run on NCCL when every rank
of the group can (:func:`wanted`, then :func:`process_group` decides); otherwise, and always for
``jit_allreduce``, CUDA tensors are staged through host memory. Ranks first agree on the
collective's signature over the group's own transport (its ``nccl_*`` collective names differ
from the staged ones, so a rank that stages while another uses NCCL gets CollectiveMismatchError,
not a hang); then the NCCL call is queued on the caller's current stream and this returns at once
(the stream waits, the host does not).

The NCCL group is made on the first NCCL collective, by every rank of the group at once (they
have just agreed on that collective): under torch.distributed (torchrun) a ``new_group`` with
backend NCCL; under MPI a torch.distributed world over TCP whose address rank 0 broadcasts over
MPI, as Horovod bootstraps NCCL. Whether NCCL is used is decided then, collectively, and kept:
it needs CUDA and NCCL on every rank, each rank of a node on its own GPU, and the group to be
the whole world (a split group stages). ``TERRAPIPE_CUDA_COMM=staged`` turns NCCL off; ``nccl``
makes its absence an error.
"""

from __future__ import annotations

import datetime
import socket

from ... import settings
from .. import ops
from ..store import hosted_tcp_store

__all__ = ["wanted", "process_group", "reduce_op", "NcclTransport"]


def _setting() -> str:
    return settings.get("TERRAPIPE_CUDA_COMM")


def _locally_possible() -> bool:
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()


def wanted(group) -> bool:
    """Whether this rank asks for NCCL for a CUDA collective on ``group`` (local; the collective
    decision is :func:`process_group`'s, which stands once made)."""
    if group.size == 1:
        return False
    decided = group.nccl
    if decided is not None:
        return decided is not False
    setting = _setting()
    if setting == "staged":
        return False
    possible = _locally_possible()
    if setting == "nccl" and not possible:
        raise RuntimeError("TERRAPIPE_CUDA_COMM=nccl, but this process has no CUDA device or "
                           "torch has no NCCL")
    return possible


def process_group(group, device) -> NcclTransport | None:
    """The NCCL transport of ``group`` (made on first use, see the module docstring), or None
    when the ranks decided to stage instead. Every rank of ``group`` calls this at the same
    point (right after agreeing on an ``nccl_*`` signature)."""
    decided = group.nccl
    if decided is not None:
        return decided or None
    me = (socket.gethostname(), device.index if device.index is not None else 0,
          _locally_possible(), group.whole_world)
    everyone = group.exchange_objects(me)
    gpus = [(host, dev) for host, dev, _, _ in everyone]
    ok = all(poss and whole for _, _, poss, whole in everyone) and len(set(gpus)) == len(gpus)
    if not ok:
        if _setting() == "nccl":
            raise RuntimeError(f"TERRAPIPE_CUDA_COMM=nccl, but NCCL cannot run this group: (host, GPU, "
                               f"NCCL usable, whole world) per rank: {everyone}")
        group.nccl = False
        return None
    group.nccl = NcclTransport(group, device)
    return group.nccl


class NcclTransport:
    """Allreduce, broadcast and allgather of CUDA tensors over a torch.distributed NCCL group
    (the device-memory member of the transports listed in comm/transports/base.py: its operands are
    tensors on the caller's current stream, not host arrays). Made by :func:`process_group`:
    under torch.distributed a ``new_group`` over its world; under MPI a torch.distributed
    world over TCP whose address rank 0 hands out (``owns_world``: torn down at close)."""

    name = "nccl"

    def __init__(self, group, device) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self.size = group.size
        self.owns_world = False
        timeout = datetime.timedelta(seconds=group.timeout)
        torch.cuda.set_device(device)
        if dist.is_initialized():
            # torchrun's world (or one the user made): a NCCL group over all of its ranks.
            self.pg = dist.new_group(backend="nccl", timeout=timeout)
            return
        store = hosted_tcp_store(group.rank, group.size,
                                 lambda where: group.exchange_objects(where)[0], group.timeout)
        dist.init_process_group("nccl", store=store, rank=group.rank, world_size=group.size,
                                timeout=timeout)
        self.owns_world = True
        self.pg = dist.group.WORLD

    def allreduce(self, x, out, op: int):
        """Reduce ``x`` (in place, or into ``out`` leaving ``x`` as it was); returns the result."""
        target = x
        if out is not None:
            target = out.detach()
            target.copy_(x)
        work = target if target.is_contiguous() else target.contiguous()
        rop, floor = reduce_op(op, work.is_floating_point())
        self._dist.all_reduce(work, op=rop, group=self.pg)
        if floor:
            work.floor_divide_(self.size)
        if work is not target:
            target.copy_(work)
        return target

    def broadcast(self, x, root: int) -> None:
        work = x if x.is_contiguous() else x.contiguous()
        self._dist.broadcast(work, src=root, group=self.pg)
        if work is not x:
            x.copy_(work)

    def allgather(self, x):
        """A new (size, *x.shape) tensor of every rank's ``x``."""
        out = x.new_empty((self.size, *x.shape))
        self._dist.all_gather_into_tensor(out, x.contiguous(), group=self.pg)
        return out

    def close(self) -> None:
        if self.owns_world and self._dist.is_initialized():
            self._dist.destroy_process_group()
        self.owns_world = False


def reduce_op(op: int, is_float: bool):
    """The torch.distributed op for a kernels.reduce op code (and whether an integer ``avg``
    still needs its floor division after a sum)."""
    import torch.distributed as dist

    from ...kernels import reduce as kreduce

    R = dist.ReduceOp
    if op == kreduce.AVG:
        return (R.AVG, False) if is_float else (R.SUM, True)
    return getattr(R, ops.by_code(op).torch), False
