"""Collectives of CUDA tensors through comm/select.py's one path (NOTE [algorithm selection] 1),
on a GPU shared by every rank, so through pinned host memory ("staged"): every collective over
every host algorithm that can run it, over the world, a split and a duplicate, at sizes on both
sides of each selection threshold, against NumPy; then many jit_allreduces outstanding at once.
Skipped where there is no CUDA device; run for real where there is one (the NCCL half, a GPU per
rank, is test_cuda.py's)."""

import os

import numpy as np
import pytest
import torch

import terrapipe.comm as comm
from terrapipe.comm import select
from terrapipe.comm.select import Request

from . import stress
from .test_matrix import _sizes, _x

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reduce_scatter")


def _device() -> torch.device:
    return torch.device("cuda", comm.local_rank() % torch.cuda.device_count())


def _on(a: np.ndarray, dev) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dev)


def _check(coll: str, g, n: int, dev, label: str) -> None:
    """``coll`` of this rank's CUDA operand of ``n`` float32 elements: the result is a CUDA
    tensor equal to NumPy's."""
    r, p = g.rank, g.size
    root = p - 1
    xs = [_x(q, n, "float32") for q in range(p)]
    total = np.sum(xs, axis=0, dtype=np.float32)
    x = _on(xs[r], dev)
    what = f"{label}: {coll} of {n} float32 on {dev}"

    def same(got, want) -> None:
        assert isinstance(got, torch.Tensor) and got.device == dev, (what, got)
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=what)

    if coll == "allreduce":
        got = comm.allreduce(x, "sum", group=g)
        assert got is x, what
        same(got, total)
    elif coll == "reduce":
        comm.reduce(x, "sum", root=root, group=g)
        same(x, total if r == root else xs[r])
    elif coll == "broadcast":
        same(comm.broadcast(x, root=root, group=g), xs[root])
    elif coll == "allgather":
        same(comm.allgather(x, group=g), np.stack(xs))
    elif coll == "gather":
        got = comm.gather(x, root=root, group=g)
        if r == root:
            same(got, np.stack(xs))
        else:
            assert got is None, what
    elif coll == "scatter":
        full = np.stack([_x(q + 7, n, "float32") for q in range(p)])
        if r != root:
            full = np.zeros_like(full)
        same(comm.scatter(_on(full, dev), root=root, group=g), _x(r + 7, n, "float32"))
    elif coll == "reduce_scatter":
        same(comm.reduce_scatter(x, "sum", group=g), np.array_split(total, p)[r])


@cuda
@pytest.mark.mpi(ranks=(2, 4), timeout=600, ci_ranks=(2,))
def test_every_collective_of_cuda_tensors_over_every_algorithm_that_can_run_it(mpi_comm):
    os.environ["TERRAPIPE_CUDA_COMM"] = "staged"  # one GPU serves every rank: NCCL refuses that
    world = comm.init(timeout=120)
    dev = _device()
    torch.cuda.set_device(dev)
    for label, g in stress.groups_under_test(world).items():
        assert comm.cuda_collectives(g) == "staged", label
        log = g.record_algorithms()
        for n in _sizes(g, 4):
            nbytes = 4 * n
            for coll in COLLECTIVES:
                # A CUDA request selects "staged"; the host request then selects as for host
                # memory, pinned algorithms included.
                assert select.select(g, Request(coll, nbytes, cuda=True)) == "staged"
                algorithms = select.able(g, Request(coll, nbytes)) if g.size > 1 else []
                for algorithm in [*algorithms, None]:
                    g.use_algorithm(coll, algorithm)
                    del log[:]
                    _check(coll, g, n, dev, f"{label} by {algorithm or 'selection'}")
                    if g.size == 1:
                        continue
                    want = algorithm or select.select(g, Request(coll, nbytes))
                    assert [a for _, a, _ in log] == [want], (label, coll, n, log)
            for coll in COLLECTIVES:
                g.use_algorithm(coll, None)
        comm.barrier(group=g)


@cuda
@pytest.mark.mpi(ranks=(2, 4), timeout=600, ci_ranks=(2,))
def test_hundreds_of_cuda_jit_allreduces_outstanding_across_every_threshold(mpi_comm):
    """Async jit_allreduces of CUDA tensors, up to 24 outstanding, sizes cycling across every
    threshold of selection and of staging (pieces of ``PIECE_BYTES``), mixed dtypes and
    compression, each produced by a kernel right before its call: every result exact (or within
    the 16-bit rounding), none lost, none hung."""
    from terrapipe.comm.staging import PIECE_BYTES

    os.environ["TERRAPIPE_CUDA_COMM"] = "staged"
    world = comm.init(timeout=120)
    r, p = world.rank, world.size
    dev = _device()
    torch.cuda.set_device(dev)
    counts = sorted({*_sizes(world, 4), PIECE_BYTES // 4 - 1, PIECE_BYTES // 4 + 1, 3 * PIECE_BYTES // 4 + 5})
    pending: list = []

    def settle(keep: int) -> None:
        while len(pending) > keep:
            handle, ts, wants, tol, what = pending.pop(0)
            handle.wait()
            for t, want in zip(ts, wants, strict=True):
                np.testing.assert_allclose(t.float().cpu().numpy(), want, rtol=tol, atol=tol, err_msg=what)

    for i in range(300):
        n = counts[(i * 7) % len(counts)]
        dtype, compression, tol = ((torch.float32, None, 0.0), (torch.bfloat16, None, 1e-2),
                                   (torch.float32, "bf16", 1e-2))[i % 3]
        # Two tensors per call, one of them not contiguous; values exact in 16 bits.
        base = [torch.arange(n, device=dev) % 13, torch.arange(2 * 3, device=dev).reshape(2, 3) % 5]
        ts = [(b + r + i % 4).to(dtype) for b in base]
        ts[1] = ts[1].t()
        wants = [(b.cpu().double() * p + p * (p - 1) / 2 + p * (i % 4)).numpy() / p for b in base]
        wants[1] = wants[1].T
        handle = comm.jit_allreduce(ts, "avg", compression=compression, async_op=True)
        what = f"call {i}: {n} elements of {dtype}, compression {compression}"
        pending.append((handle, ts, wants, tol, what))
        settle(24)
    settle(0)
