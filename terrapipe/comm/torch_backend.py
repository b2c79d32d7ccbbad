"""The torch.distributed backend: the same Group interface for scripts launched by torchrun or
SLURM (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), over Gloo.

Signatures are agreed with an all_gather of the same 24-word record the shared-memory board uses,
so mismatches raise CollectiveMismatchError on every rank here too; Gloo's own timeout (the
``timeout`` given to :func:`terrapipe.comm.init`) becomes CollectiveTimeoutError. float16 and
bfloat16 reductions are all-gathered and reduced with the kernels in float32, as on MPI.
"""

from __future__ import annotations

import datetime
import os

import numpy as np

from ..kernels import reduce as kreduce
from .buffers import Buffer
from .errors import CollectiveTimeoutError, CommError
from .group import NO_GATE, Group, _Fused

__all__ = ["TorchGroup", "torch_env"]


def torch_env() -> bool:
    """True when the environment describes a torch.distributed job (torchrun, or SLURM with a
    MASTER_ADDR); SLURM's variables are mapped onto RANK / WORLD_SIZE / LOCAL_RANK."""
    if "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ and "RANK" not in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_PORT", "29500")
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) \
        and int(os.environ["WORLD_SIZE"]) > 1


class TorchGroup(Group):
    """A Group whose collectives run on torch.distributed (Gloo for host memory)."""

    def __init__(self, timeout: float = 300.0, pg=None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self._owns_init = pg is None and not dist.is_initialized()
        if self._owns_init:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        self._init_execution(timeout)
        self.pg = pg
        self.comm = None
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0)) if pg is None else self.rank
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if pg is None else self.size
        self.nnodes = max(1, self.size // max(self.local_size, 1))
        self.uniform = True
        self.world_ranks = list(range(self.size))
        self._acc = np.empty(kreduce.TILE, np.float32)

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.pg, **kwargs)
        except RuntimeError as e:
            text = str(e)
            if "imed out" in text or "timeout" in text.lower():
                raise CollectiveTimeoutError(
                    f"{what}: timed out after {self.timeout:g}s waiting for another rank (gloo): {text}",
                    []) from e
            if "Connection closed" in text or "Connection reset" in text:
                raise CollectiveTimeoutError(f"{what}: a rank exited or died (gloo): {text}", []) from e
            raise CommError(f"{what}: {text}") from e

    def _t(self, arr: np.ndarray):
        # Gloo has no 16-bit integer types: bit patterns travel as float16, which gather,
        # broadcast and scatter copy bit for bit (they are only reduced by our kernels).
        return self._torch.from_numpy(arr.view(np.float16) if arr.dtype == np.uint16 else arr)

    def _agree(self, coll: str, op: int = 0, buf: Buffer | None = None, root: int = -1) -> None:
        if self.size == 1:
            return
        sig = self._t(np.array(self._signature(coll, op, buf, root)))
        sigs = self._torch.empty((self.size, sig.shape[0]), dtype=sig.dtype)
        self._call(coll, self._dist.all_gather, list(sigs.unbind(0)), sig)
        all_sigs = sigs.numpy()
        if not (all_sigs == all_sigs[0]).all():
            self._mismatch(coll, all_sigs, list(range(self.size)))

    def _reduce_host(self, flat: np.ndarray, op: int, kind: int, what: str) -> None:
        if kind:
            gathered = np.empty((self.size, flat.shape[0]), flat.dtype)
            self._call(what, self._dist.all_gather, list(self._t(gathered).unbind(0)), self._t(flat))
            kreduce.reduce_many_16(flat, gathered, op, 0, flat.shape[0], kind, self._acc)
        else:
            R = self._dist.ReduceOp
            rop = {kreduce.SUM: R.SUM, kreduce.AVG: R.SUM, kreduce.PROD: R.PRODUCT,
                   kreduce.MIN: R.MIN, kreduce.MAX: R.MAX}[op]
            self._call(what, self._dist.all_reduce, self._t(flat), op=rop)
        if op == kreduce.AVG:
            self._divide(flat, kind)

    # -- collective bodies ----------------------------------------------------------------------
    def allreduce_views(self, srcs, dsts, op, kind, ckind=0, coll="allreduce", sig_buf=None,
                        gate=NO_GATE) -> None:
        if self.size == 1:
            return super().allreduce_views(srcs, dsts, op, kind, ckind, coll, sig_buf, gate)
        self._agree(coll, op, sig_buf)
        fs, fd = _Fused(srcs), _Fused(dsts)
        rkind = ckind or kind
        flat = np.empty(fs.n, np.uint16 if rkind else srcs[0].dtype)
        gate.ready(fs.n)
        fs.read(0, fs.n, flat, ckind)
        self._reduce_host(flat, op, rkind, coll)
        fd.write(0, flat, ckind)
        gate.wrote(fs.n)

    # The entry points (one-rank shortcut, agreement) are Group's; these move the data.
    def _broadcast(self, buf: Buffer, root: int) -> None:
        self._call("broadcast", self._dist.broadcast, self._t(buf.flat), src=root)

    def _allgather(self, buf: Buffer, out: np.ndarray, root: int, coll: str) -> None:
        rows = list(self._t(out).unbind(0))
        if root >= 0:
            self._call(coll, self._dist.gather, self._t(buf.flat),
                       gather_list=rows if self.rank == root else None, dst=root)
        else:
            self._call(coll, self._dist.all_gather, rows, self._t(buf.flat))

    def _scatter(self, full: Buffer, out: np.ndarray, root: int) -> None:
        n = out.shape[0]
        parts = list(self._t(full.flat.reshape(self.size, n)).unbind(0)) if self.rank == root else None
        self._call("scatter", self._dist.scatter, self._t(out), scatter_list=parts, src=root)

    def _reduce_scatter(self, buf: Buffer, out: np.ndarray, op: int) -> None:
        tmp = buf.flat.copy()
        self._reduce_host(tmp, op, buf.kind, "reduce_scatter")
        q, r = divmod(buf.size, self.size)
        lo = self.rank * q + min(self.rank, r)
        out[...] = tmp[lo:lo + out.shape[0]]

    def _reduce(self, buf: Buffer, op: int, root: int) -> None:
        tmp = buf.flat.copy()
        self._reduce_host(tmp, op, buf.kind, "reduce")
        if self.rank == root:
            buf.flat[...] = tmp

    def _barrier(self) -> None:
        pass  # the agreement (an allgather of signatures) was the barrier

    def send(self, buf: Buffer, dest: int, tag: int) -> None:
        self._call(f"send to rank {dest}", self._dist.send, self._t(buf.flat), dst=dest, tag=tag)

    def recv(self, buf: Buffer, source: int, tag: int) -> None:
        self._call(f"recv from rank {source}", self._dist.recv, self._t(buf.flat), src=source, tag=tag)

    def split(self, color: int, key: int | None = None) -> Group:
        pairs = [None] * self.size
        self._call("split", self._dist.all_gather_object, pairs,
                   (int(color), self.rank if key is None else int(key), self.rank))
        mine = None
        for c in sorted({p[0] for p in pairs}):
            members = [p[2] for p in sorted((q for q in pairs if q[0] == c), key=lambda q: (q[1], q[2]))]
            pg = self._dist.new_group(members)  # every rank takes part in every new_group
            if c == color:
                mine = TorchGroup(self.timeout, pg)
        return mine

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._owns_init and self._dist.is_initialized():
            # Torn down here, not by the interpreter's exit: process groups destroyed during
            # shutdown (split() subgroups included) can abort in C++ ("terminate called ...").
            self._dist.destroy_process_group()
            self._owns_init = False

