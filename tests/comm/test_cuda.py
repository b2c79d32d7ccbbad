"""Collectives on CUDA tensors: pinned staging for jit_allreduce (NOTE [staging streams]) and
NCCL for comm's collectives. Run for real where there is a GPU; skipped elsewhere (the staging
protocol itself is checked on the host in test_staging_gate.py)."""

import os

import numpy as np
import pytest
import torch

import terrapipe.comm as comm
from terrapipe.comm.transports import nccl

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")

SHAPES = [(3,), (1000, 17), (2_100_000,), (5, 7)]  # the third spans several pieces and chunks


def _host(rank: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _device() -> torch.device:
    return torch.device("cuda", comm.local_rank() % torch.cuda.device_count())


def _mean(p: int, dtype=torch.float32) -> list[torch.Tensor]:
    per_rank = [_host(q, dtype) for q in range(p)]
    return [sum(h[i].double() for h in per_rank) / p for i in range(len(SHAPES))]


@cuda
def test_lone_process_jit_allreduce_keeps_cuda_tensors_and_rounds_compressed():
    g = comm.Group(None)
    dev = torch.device("cuda")
    ts = [h.to(dev) for h in _host(0)]
    assert comm.jit_allreduce(ts, "avg", group=g) is ts
    for t, h in zip(ts, _host(0), strict=True):
        assert t.is_cuda and torch.equal(t.cpu(), h)
    comm.jit_allreduce(ts, "sum", compression="bf16", group=g)
    for t, h in zip(ts, _host(0), strict=True):
        assert torch.equal(t.cpu(), h.bfloat16().float())


@cuda
@pytest.mark.mpi(ranks=(1, 2), timeout=300)
def test_jit_allreduce_of_cuda_tensors_produced_on_a_side_stream(mpi_comm):
    os.environ["TERRAPIPE_CUDA_COMM"] = "staged"  # one GPU may serve every rank
    comm.init(timeout=120)
    r, p = comm.rank(), comm.size()
    dev = _device()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        # Produced by a kernel on the side stream, right before the call: the downloads must
        # wait for it (the producer event), and reading after the call must see the result.
        ts = [(h.to(dev) * 2.0) * 0.5 for h in _host(r)]
        ts[1] = ts[1].t()  # not contiguous
        cpu_member = torch.ones(11) * r  # host tensors may ride along in the same dtype group
        comm.jit_allreduce([ts[0], ts[1], cpu_member, ts[2], ts[3]], op="avg")
        got = [t.cpu() for t in ts]
    want = _mean(p)
    want[1] = want[1].t()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert torch.equal(cpu_member, torch.full((11,), (p - 1) / 2))


@cuda
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_cuda_async_handles_compression_and_16_bit(mpi_comm):
    os.environ["TERRAPIPE_CUDA_COMM"] = "staged"
    comm.init(timeout=120)
    r, p = comm.rank(), comm.size()
    dev = _device()
    a = [h.to(dev) for h in _host(r)]
    b = [h.to(dev) for h in _host(r, torch.bfloat16)]
    c = [h.to(dev) for h in _host(r)]
    handles = [comm.jit_allreduce(a, "avg", async_op=True),
               comm.jit_allreduce(b, "avg", async_op=True),
               comm.jit_allreduce(c, "avg", compression="fp16", async_op=True)]
    for h in handles:
        h.wait()
    for x, y, z, ref in zip(a, b, c, _mean(p), strict=True):
        np.testing.assert_allclose(x.cpu().numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y.float().cpu().numpy(), ref.numpy(), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(z.cpu().numpy(), ref.numpy(), rtol=2e-3, atol=2e-3)
    pool = comm.world().staging_pool
    assert pool is not None and all(buf.is_pinned() for buf in pool.buffers.values())
    # comm's collectives on CUDA tensors, staged: results stay on the device.
    x = torch.full((1000,), float(r), device=dev)
    assert comm.allreduce(x, "sum") is x and torch.equal(x.cpu(), torch.full((1000,), p * (p - 1) / 2))
    gathered = comm.allgather(torch.full((3,), float(r), device=dev))
    assert gathered.is_cuda and torch.equal(gathered[:, 0].cpu(), torch.arange(p, dtype=torch.float32))
    y = torch.arange(5.0, device=dev) * (r == 1)
    comm.broadcast(y, root=1)
    assert torch.equal(y.cpu(), torch.arange(5.0))


@cuda
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_cuda_tensors_on_different_devices_are_refused(mpi_comm):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    comm.init(timeout=60)
    with pytest.raises(ValueError, match=r"tensors\[1\]: on cuda:1"):
        comm.jit_allreduce([torch.zeros(3, device="cuda:0"), torch.zeros(3, device="cuda:1")])


@cuda
@two_gpus
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_nccl_collectives_on_cuda_tensors(mpi_comm):
    os.environ["TERRAPIPE_CUDA_COMM"] = "nccl"
    g = comm.init(timeout=120)
    r, p = comm.rank(), comm.size()
    dev = _device()
    for dtype, op in ((torch.float32, "sum"), (torch.float32, "avg"), (torch.bfloat16, "max"),
                      (torch.int64, "avg"), (torch.float16, "prod")):
        x = (torch.arange(12, device=dev).reshape(3, 4) + r).to(dtype)
        comm.allreduce(x, op)
        xs = torch.stack([torch.arange(12).reshape(3, 4) + q for q in range(p)]).double()
        ref = {"sum": xs.sum(0), "avg": xs.sum(0) / p, "max": xs.max(0).values, "prod": xs.prod(0)}[op]
        if dtype == torch.int64:
            ref = torch.div(xs.sum(0), p, rounding_mode="floor")
        torch.testing.assert_close(x.double().cpu(), ref, rtol=1e-2, atol=1e-2)
    assert g.nccl not in (None, False)
    y = torch.arange(6.0, device=dev).reshape(2, 3).t() * (r == 0)  # not contiguous
    comm.broadcast(y, root=0)
    assert torch.equal(y.cpu(), torch.arange(6.0).reshape(2, 3).t())
    out = comm.allgather(torch.full((2,), float(r), device=dev))
    assert out.is_cuda and torch.equal(out.cpu(), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    flat = torch.full((4,), -1.0, device=dev)
    assert comm.allgather(torch.full((2,), float(r), device=dev), out=flat) is flat
    assert torch.equal(flat.cpu(), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    x = torch.full((2, 3), float(r + 1), device=dev)
    out = torch.empty_like(x)
    assert comm.allreduce(x, "sum", out=out) is out
    assert torch.equal(out.cpu(), torch.full((2, 3), float(p * (p + 1) // 2)))
    assert torch.equal(x.cpu(), torch.full((2, 3), float(r + 1)))  # out of place leaves x alone
    h = comm.allreduce(torch.ones(5, device=dev), "sum", async_op=True)
    assert torch.equal(h.wait().cpu(), torch.full((5,), float(p)))
    # A rank that calls the staged path while the other calls NCCL: a mismatch, not a hang.
    with pytest.raises(comm.CollectiveMismatchError, match="nccl_allreduce"):
        if r == 0:
            comm.allreduce(torch.ones(4, device=dev))
        else:
            comm.allreduce(np.ones(4, np.float32))


@cuda
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_allgather_and_reduce_scatter_of_cuda_tensors_into_out(mpi_comm, monkeypatch):
    # out= on the device (staged through host memory, which two ranks on one GPU take): the
    # caller's tensor is written and returned, strided too; a host tensor for a CUDA x is refused.
    monkeypatch.setenv("TERRAPIPE_CUDA_COMM", "staged")
    g = comm.init(timeout=120)
    r, p = g.rank, g.size
    dev = _device()
    for n in (3, 300_001):
        x = torch.arange(n, dtype=torch.float32, device=dev) + 1000 * r
        want = torch.stack([torch.arange(n, dtype=torch.float32) + 1000 * q for q in range(p)])
        out = torch.full((p, n), -1.0, device=dev)
        assert comm.allgather(x, out=out) is out
        assert torch.equal(out.cpu(), want)
        wide = torch.full((p * n, 2), -1.0, device=dev)
        assert comm.allgather(x, out=wide[:, 1]) is not None
        assert torch.equal(wide[:, 1].cpu(), want.reshape(-1)) and torch.all(wide[:, 0] == -1)
        part = torch.empty(len(np.array_split(np.empty(n), p)[r]), device=dev)
        assert comm.reduce_scatter(x, "sum", out=part) is part
        full = want.sum(0)
        assert torch.equal(part.cpu(), torch.from_numpy(np.array_split(full.numpy(), p)[r]))
    with pytest.raises(ValueError, match="allgather: out must be torch.float32 of 6 elements on cuda"):
        comm.allgather(torch.zeros(3, device=dev), out=torch.empty(6))


def test_cuda_comm_setting_is_checked(monkeypatch):
    group = comm.Group(None)
    group.size = 2  # wanted() looks at the size only: a stand-in for a two-rank group
    monkeypatch.setenv("TERRAPIPE_CUDA_COMM", "fast")
    with pytest.raises(ValueError, match="TERRAPIPE_CUDA_COMM"):
        nccl.wanted(group)
    monkeypatch.setenv("TERRAPIPE_CUDA_COMM", "staged")
    assert not nccl.wanted(group)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TERRAPIPE_CUDA_COMM", "nccl")
        with pytest.raises(RuntimeError, match="no CUDA device"):
            nccl.wanted(group)
