"""The "terrapipe" torch.distributed backend on CUDA tensors: NCCL where every rank has its own
GPU, else staged through pinned host memory (comm/transports/nccl.py decides, together). Run for real where
there is a GPU (two ranks may share one: then they stage); skipped elsewhere. Results are
checked against Gloo's on host copies of the same tensors."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.test_backend import _close, _ddp_equals_one_process, _init

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


@cuda
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_collectives_of_cuda_tensors_equal_gloos_on_the_host(mpi_comm):
    tp, gloo = _init(mpi_comm, timeout=120)
    r, n = dist.get_rank(), dist.get_world_size()
    dev = _device(r)
    g = torch.Generator().manual_seed(50 + r)
    # across the host paths' thresholds: one-shot, chunked segment, single copy
    for numel in (5, 70_000, 1_200_000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            host = (torch.randn(numel, generator=g) * 8).to(dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                if dtype == torch.bfloat16 and op == dist.ReduceOp.SUM:
                    continue  # Gloo adds bf16 in bf16 (test_backend checks it against float64)
                t, ref = host.to(dev), host.clone()
                w = dist.all_reduce(t, op=op, async_op=True)
                dist.all_reduce(ref, op=op, group=gloo)
                w.wait()
                assert t.is_cuda and t.device == dev
                torch.testing.assert_close(t.cpu(), ref, rtol=2e-5, atol=2e-5)
        x = torch.randn(numel, generator=g)
        t = x.to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        s = x.clone()
        dist.all_reduce(s, group=gloo)
        torch.testing.assert_close(t.cpu(), s / n, rtol=2e-5, atol=2e-6)
        # broadcast, allgather (list and tensor forms), reduce-scatter
        b = (x * 0 + r).to(dev)
        dist.broadcast(b, src=n - 1)
        assert torch.equal(b.cpu(), torch.full((numel,), float(n - 1)))
        outs = [torch.empty(numel, device=dev) for _ in range(n)]
        dist.all_gather(outs, t * (r + 1))
        for q, o in enumerate(outs):
            torch.testing.assert_close(o.cpu(), (s / n) * (q + 1), rtol=2e-5, atol=2e-6)
        flat = torch.empty(n * numel, device=dev)
        dist.all_gather_into_tensor(flat, b + r)
        assert torch.equal(flat.cpu().view(n, numel)[:, 0], torch.arange(n, dtype=torch.float32) + n - 1)
        m = numel - numel % n
        rs_in = torch.randn(m, generator=g)
        rs_ref = torch.empty(m // n)
        dist.reduce_scatter_tensor(rs_ref, rs_in.clone(), group=gloo)
        rs = torch.empty(m // n, device=dev)
        dist.reduce_scatter_tensor(rs, rs_in.to(dev))
        torch.testing.assert_close(rs.cpu(), rs_ref, rtol=2e-5, atol=2e-5)
    assert tp.served["terrapipe"] > 0
    _close()


@cuda
@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_ddp_on_cuda_equals_one_process_on_the_union_batch(mpi_comm):
    _init(mpi_comm, timeout=120)
    n = dist.get_world_size()
    dev = _device(dist.get_rank())

    def model():
        torch.manual_seed(0)
        # 1.3M parameters: DDP's 1 MiB first bucket, then one past the single-copy threshold
        return torch.nn.Sequential(torch.nn.Linear(256, 1200), torch.nn.ReLU(), torch.nn.Linear(1200, 800),
                                   torch.nn.ReLU(), torch.nn.Linear(800, 10))

    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(4 * n, 256, generator=g), torch.randint(0, 10, (4 * n,), generator=g))
               for _ in range(3)]
    _ddp_equals_one_process(model, batches, [{"device_ids": [dev.index]}], {"lr": 0.05, "momentum": 0.9},
                            device=dev, rtol=1e-4, atol=1e-5)
    _close()
