"""How each kind of hvd collective moves its data, on a coordinator's thread (negotiation.py).

Every runner is ``run(group, entry, meta) -> result``: ``entry.args`` holds the tensors of the
rank that issued it; ``entry`` is None on a rank that joined (NOTE [name negotiation] 3d), which
takes part in allreduce (zeros built from ``meta``) and barrier only. CUDA tensors are copied to
host memory and back (Horovod's CPU operations; NCCL comes with the GPU issue). Reductions of
int8/uint8/int16/bool run widened to int64 and are cast back.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import comm

__all__ = ["RUNNERS", "AVERAGE", "SUM", "ADASUM", "MIN", "MAX", "PRODUCT", "OP_NAMES",
           "split_rows"]

# horovod.common ReduceOp values
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
OP_NAMES = {AVERAGE: "Average", SUM: "Sum", ADASUM: "Adasum", MIN: "Min", MAX: "Max", PRODUCT: "Product"}
# Horovod's ops as terrapipe.comm's; an average is a sum here, scaled around it as Horovod does.
_COMM_OP = {**{op.horovod: op.name for op in comm.OPS}, AVERAGE: "sum"}
# Integer dtypes terrapipe.comm moves but does not reduce: reduced as int64, then narrowed back.
_WIDEN = tuple(getattr(torch, d.name) for d in comm.DTYPES if not d.reduced and hasattr(torch, d.name))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def split_rows(d0: int, n: int) -> list[int]:
    """Rows of a reducescatter's result on each of ``n`` ranks: the first ``d0 % n`` get one more."""
    q, rem = divmod(d0, n)
    return [q + (1 if r < rem else 0) for r in range(n)]


def _scale(w: torch.Tensor, factor: float) -> None:
    """``w *= factor`` as Horovod scales: float32/64 in their own precision, 16-bit floats in
    float32, integers in float64 and truncated back."""
    if factor == 1.0:
        return
    if w.dtype in (torch.float32, torch.float64):
        w.mul_(factor)
    elif w.dtype.is_floating_point:
        w.copy_(w.float().mul_(factor))
    else:
        w.copy_(w.double().mul_(factor))


def _postscale(w: torch.Tensor, op: int, n: int, post: float) -> None:
    """The sum ``w`` of ``n`` ranks made the result: divided by ``n`` for Average, then scaled
    by ``post``. Integers take Horovod's single float64 factor ``post / n``, truncated toward
    zero as its C++ core converts it back (-3 averaged over 2 ranks is -1, not floor's -2)."""
    if op == AVERAGE:
        if w.dtype.is_floating_point:
            w.div_(n)
        else:
            post = post / n
    _scale(w, post)


def _work(t: torch.Tensor) -> torch.Tensor:
    """A host tensor to reduce in, holding ``t``'s values (``t`` itself when it can be)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    if t.dtype in _WIDEN:
        return t.to(torch.int64)
    return t


def _finish(work: torch.Tensor, out: torch.Tensor) -> None:
    if work.data_ptr() != out.data_ptr() or work.dtype != out.dtype:
        with torch.no_grad():
            out.copy_(work.to(out.dtype) if out.dtype != torch.bool else work != 0)


def _run_allreduce(g: comm.Group, entry, meta: list):
    _, op, pre, post, wire, _device, specs = meta
    if entry is None:
        ins = [torch.zeros(shape, dtype=_dtype(d)) for d, shape in specs]
        outs = ins
    else:
        ins, outs = entry.args
    works = []
    with torch.no_grad():
        for t, o in zip(ins, outs, strict=True):
            if o is not t and o.device.type == "cpu" and o.dtype not in _WIDEN:
                o.copy_(t)
                w = o
            else:
                w = _work(t)
                if w is t and o is not t:
                    w = t.clone()
            _scale(w, pre)
            works.append(w)
        if op == ADASUM:
            _adasum(g, works, wire)
        else:
            comm.jit_allreduce(works, _COMM_OP[op], compression=wire or None, group=g)
        for w, o in zip(works, outs, strict=True):
            _postscale(w, op, g.size, post)
            _finish(w, o)
    return outs


_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _adasum(g: comm.Group, works: list[torch.Tensor], wire: str) -> None:
    """Adasum of ``works`` in place; with a 16-bit wire format (Compression.fp16) the vectors
    are combined in it, as Horovod combines the compressed tensors."""
    if not wire:
        comm.adasum_allreduce(works, group=g)
        return
    narrow = [w.to(_WIRE_DTYPES[wire]) if w.dtype == torch.float32 else w for w in works]
    comm.adasum_allreduce(narrow, group=g)
    for w, n in zip(works, narrow, strict=True):
        if n is not w:
            w.copy_(n)


def _run_allgather(g: comm.Group, entry, meta: list):
    ins = entry.args
    hosts = [t.detach().cpu().contiguous() for t in ins]
    dims = np.array([h.shape[0] for h in hosts], np.int64)
    all_dims = comm.allgather(dims, group=g)  # (ranks, tensors)
    outs = []
    for i, h in enumerate(hosts):
        rows = [int(r) for r in all_dims[:, i]]
        padded = h.new_zeros((max(rows), *h.shape[1:]))
        padded[:h.shape[0]] = h
        gathered = comm.allgather(padded, group=g)
        out = torch.cat([gathered[r, :rows[r]] for r in range(g.size)])
        outs.append(out.to(ins[i].device) if ins[i].device.type != "cpu" else out)
    return outs


def _run_broadcast(g: comm.Group, entry, meta: list):
    root = meta[1]
    ins, outs = entry.args
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ins):
        by_dtype.setdefault(t.dtype, []).append(i)
    with torch.no_grad():
        for idx in by_dtype.values():
            flat = torch.cat([ins[i].detach().reshape(-1).cpu() for i in idx])
            comm.broadcast(flat, root, group=g)
            o = 0
            for i in idx:
                n = ins[i].numel()
                outs[i].copy_(flat[o:o + n].view(outs[i].shape))
                o += n
    return outs


def _run_alltoall(g: comm.Group, entry, meta: list):
    rest = meta[3][1:]
    n, me = g.size, g.rank
    t, splits = entry.args
    host = t.detach().cpu().contiguous()
    table = comm.allgather(np.asarray(splits, np.int64), group=g)  # table[src, dst]: rows sent
    recv = table[:, me]
    out = host.new_empty((int(recv.sum()), *rest))
    row_bytes = host.element_size() * int(np.prod(rest, dtype=np.int64))
    src = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
    dst = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
    if g.comm is not None:
        from mpi4py import MPI

        scount = (table[me] * row_bytes).astype(np.int64)
        rcount = (recv * row_bytes).astype(np.int64)
        sdisp = np.concatenate([[0], np.cumsum(scount)[:-1]])
        rdisp = np.concatenate([[0], np.cumsum(rcount)[:-1]])
        g.comm.Alltoallv([src, scount.tolist(), sdisp.tolist(), MPI.BYTE],
                         [dst, rcount.tolist(), rdisp.tolist(), MPI.BYTE])
    else:  # no MPI in this group (Gloo): every block through one padded allgather
        width = int(table.max()) * row_bytes
        send = np.zeros((n, max(width, 1)), np.uint8)
        o = 0
        for d in range(n):
            nb = int(table[me, d]) * row_bytes
            send[d, :nb] = src[o:o + nb]
            o += nb
        gathered = comm.allgather(send, group=g)  # (src, dst, bytes)
        o = 0
        for s in range(n):
            nb = int(recv[s]) * row_bytes
            dst[o:o + nb] = gathered[s, me, :nb]
            o += nb
    received = torch.from_numpy(recv.astype(np.int32))
    return (out.to(t.device) if t.device.type != "cpu" else out), received


def _run_reducescatter(g: comm.Group, entry, meta: list):
    _, op, pre, post, _device, _specs = meta
    ins = entry.args
    outs = []
    with torch.no_grad():
        for t in ins:
            w = _work(t)
            w = w.clone() if w is t else w
            _scale(w, pre)
            counts = split_rows(w.shape[0], g.size)
            start = sum(counts[:g.rank])
            if len(set(counts)) == 1:  # equal parts: np.array_split's split of the flat buffer
                part = comm.reduce_scatter(w.reshape(-1), _COMM_OP[op], group=g)
                part = part.view(counts[g.rank], *w.shape[1:])
            else:  # uneven rows: reduce the whole, keep this rank's rows
                part = comm.allreduce(w, _COMM_OP[op], group=g)[start:start + counts[g.rank]]
            part = part.clone()
            _postscale(part, op, g.size, post)
            out = part.to(t.dtype) if t.dtype != torch.bool else part != 0
            outs.append(out.to(t.device) if t.device.type != "cpu" else out)
    return outs


def _run_barrier(g: comm.Group, entry, meta: list):
    comm.barrier(group=g)


RUNNERS = {"allreduce": _run_allreduce, "allgather": _run_allgather, "broadcast": _run_broadcast,
           "alltoall": _run_alltoall, "reducescatter": _run_reducescatter, "barrier": _run_barrier}
