"""The "terrapipe" torch.distributed backend, at 2 and 4 ranks, checked against Gloo's results.

Each body runs under mpiexec (tests/mpi_plugin.py); the ranks rendezvous over ``tcp://`` as
torch does (``terrapipe.distributed.init_process_group`` under mpiexec), with a Gloo group of
the same ranks beside the terrapipe one for reference results.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import terrapipe.distributed
from terrapipe.distributed import ProcessGroupTerrapipe


def _init(mpi_comm, timeout=60):
    terrapipe.distributed.init_process_group("terrapipe", timeout, mpi_comm=mpi_comm)
    assert dist.get_rank() == mpi_comm.rank and dist.get_world_size() == mpi_comm.size
    return dist.group.WORLD, dist.new_group(backend="gloo")


def _close():
    dist.destroy_process_group()


# sizes on both sides of the shared-memory paths' thresholds (one-shot, chunked, odd lengths)
SIZES = [1, 7, 1000, 16 * 1024 + 3, 300_000, 1 << 21]


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_collectives_equal_gloos(mpi_comm):
    tp, gloo = _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    assert isinstance(tp, ProcessGroupTerrapipe) and dist.get_backend() == "terrapipe"
    assert tp.group.mpi is not None  # under mpiexec: the group is made over MPI
    g = torch.Generator().manual_seed(100 + r)

    def both(fn):
        """fn(group) -> tensors; the terrapipe and Gloo results must be equal."""
        a, b = fn(tp), fn(gloo)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.dtype.is_floating_point:
                # float sums in another order: the error bound is n ulps of the largest term
                tol = {torch.float32: 2e-5, torch.float64: 1e-13}.get(x.dtype, 0)
                torch.testing.assert_close(x, y, rtol=tol, atol=tol)
            else:
                assert torch.equal(x, y)

    for numel in SIZES:
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.int8):
            base = (torch.randn(numel, generator=g) * 4).to(dtype)
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
            if numel < 2000 and dtype.is_floating_point:
                ops.append(dist.ReduceOp.PRODUCT)
            for op in ops:
                if dtype == torch.bfloat16 and op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
                    # Gloo adds bf16 in bf16, rank after rank; terrapipe accumulates in float32 and
                    # rounds once: compare with the float64 result rounded to bf16 instead.
                    _bf16_against_float64(base, op, gloo, n)
                    continue
                both(lambda grp, op=op, base=base: [_ret(dist.all_reduce(t := base.clone(), op=op, group=grp),
                                                         t)])
        _copies_and_scatters(both, g, numel, n, r)
    # AVG is not a Gloo op: check it against SUM / n.
    x = torch.randn(1001, generator=g)
    a, s = x.clone(), x.clone()
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    dist.all_reduce(s, group=gloo)
    torch.testing.assert_close(a, s / n)
    # Gloo's own share: bitwise ops, gather/scatter, uneven all-to-all, point-to-point.
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        v = torch.randint(0, 1 << 20, (33,), generator=g)
        both(lambda grp, v=v, op=op: [_ret(dist.all_reduce(t := v.clone(), op=op, group=grp), t)])
    splits = [(r + k) % 3 + 1 for k in range(n)]  # what this rank sends to each rank
    recv_splits = [(k + r) % 3 + 1 for k in range(n)]
    src = torch.arange(sum(splits), dtype=torch.float32) + 100 * r
    both(lambda grp: [_ret(dist.all_to_all_single(o := torch.empty(sum(recv_splits)), src, recv_splits,
                                                  splits, group=grp), o)])
    both(lambda grp: _ret(dist.gather(x, [torch.empty_like(x) for _ in range(n)] if r == 0 else None, dst=0,
                                      group=grp), [x]))
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.empty(5)
    reqs = [dist.isend(torch.full((5,), float(r)), nxt), dist.irecv(got, prv)]
    for q in reqs:
        q.wait()
    assert got.tolist() == [float(prv)] * 5
    dist.barrier()
    assert tp.served["terrapipe"] > 0 and tp.served["gloo"] > 0
    _close()


def _ret(work, value):
    return value


def _bf16_against_float64(base, op, gloo, n):
    parts = [torch.empty(base.shape, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(parts, base.double(), group=gloo)
    ref = torch.stack(parts).sum(0) if op == dist.ReduceOp.SUM else torch.stack(parts).prod(0)
    ours = base.clone()
    dist.all_reduce(ours, op=op)
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    nnodes = n // node.size
    one_node = nnodes == 1
    node.Free()
    if one_node:
        # sum: exact in float32 for these magnitudes, then one rounding; product: float32 rounds too
        tol = 0 if op == dist.ReduceOp.SUM else 2.0**-8
        torch.testing.assert_close(ours, ref.to(torch.bfloat16), rtol=tol, atol=0)
    elif op == dist.ReduceOp.SUM:
        # Across nodes a result is rounded once per level: the node's partial (half a bf16 ulp of
        # it: at most 2**-8 of the node's absolute sum), then the total; the ring among more than
        # two nodes rounds its running partial at every hop, as NCCL's and Gloo's do: nnodes - 1
        # roundings, each of a partial no larger than the absolute sum.
        bound = 2.0**-8 * ((nnodes - 1) * torch.stack(parts).abs().sum(0) + ref.abs())
        assert ((ours.double() - ref).abs() <= bound).all(), (ours, ref)
    else:
        # Each node's partial product is rounded (at most 2**-8 relative), then the total.
        torch.testing.assert_close(ours.double(), ref, rtol=(1 + 2.0**-8) ** (nnodes + 1) - 1, atol=0)


def _copies_and_scatters(both, g, numel, n, r):
    x = torch.randn(numel, generator=g)
    big = torch.randn(n * numel, generator=g)
    both(lambda grp: [_ret(dist.broadcast(t := x.clone(), src=n - 1, group=grp), t)])
    both(lambda grp: _ret(dist.all_gather(o := [torch.empty(numel) for _ in range(n)], x, group=grp), o))
    both(lambda grp: [_ret(dist.all_gather_into_tensor(o := torch.empty(n * numel), x, group=grp), o)])
    both(lambda grp: [_ret(dist.reduce_scatter_tensor(o := torch.empty(numel), big, group=grp), o)])
    both(lambda grp: [_ret(dist.reduce_scatter(o := torch.empty(numel), list(big.chunk(n)), group=grp), o)])
    # reduce: only the destination's result is defined (Gloo uses the others' tensors as scratch)
    def reduce(grp):
        t = x.clone()
        dist.reduce(t, dst=1, group=grp)
        return [t] if r == 1 else []

    both(reduce)


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_a_synchronous_calls_work_is_done_and_holds_its_tensors(mpi_comm):
    """A synchronous allreduce's Work (NOTE [the terrapipe process group] 6), behind async calls
    still outstanding: done when returned, its future made on demand with the reduced tensor."""
    tp, _ = _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    for it in range(200):
        pending = [torch.full((s,), float(r + it)) for s in (1024, 300_001)[: 1 + it % 2]]
        works = [dist.all_reduce(t, async_op=True) for t in pending]
        t = torch.full((1024 if it % 3 else 5000,), float(r * it))
        if it % 4 == 3:  # what the script's call does: torch's wrapper waits and returns None
            assert dist.all_reduce(t) is None
            w = None
        else:
            w = tp.allreduce([t], opts)
        # in order after what is outstanding, and done when returned
        assert t[0].item() == it * sum(range(n)) and t[-1].item() == it * sum(range(n))
        if w is not None:
            assert w.is_completed() and w.is_success() and w.exception() is None
            fut = w.get_future()
            assert fut.done() and fut.value()[0] is t and w.get_future() is fut
            assert w.wait() is True
        for x, wk in zip(pending, works, strict=True):
            wk.wait()
            assert x[0].item() == n * it + sum(range(n)) and x[-1].item() == x[0].item()
    _close()


@pytest.mark.mpi(ranks=(2, 4), timeout=240, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_many_outstanding_async_allreduces(mpi_comm):
    tp, gloo = _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    for it in range(30):
        sizes = [4096, 1 << 20, 17, 300_001, 8 << 20][it % 5:] + [1000]
        ts = [torch.full((s,), float(r + it), dtype=torch.float32) for s in sizes]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        futs = [w.get_future() for w in works]
        for w in works:
            w.wait()
        want = sum(range(n)) + n * it
        for t, f in zip(ts, futs, strict=True):
            assert t[0].item() == want and t[-1].item() == want
            assert f.value()[0] is t  # the future's value is the reduced tensor
    _close()


@pytest.mark.mpi(ranks=(2, 4), timeout=240, ci_ranks=(2,))
def test_coalescing_manager_batches_equal_gloos(mpi_comm):
    """``dist._coalescing_manager``'s fast path: one fused collective per batch on terrapipe
    (``served`` counts one call), Gloo's results, sync and async, sizes across the paths."""
    tp, gloo = _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + r)
    for it in range(6):
        sizes = [1, 1000, 300_001, 17, 1 << 20][it % 3:]
        async_ops = bool(it % 2)
        op = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG)[it % 3]
        bases = [(torch.randn(k, generator=g) * 4).round() for k in sizes]  # exact sums
        results = {}
        for name, group in (("tp", tp), ("gloo", gloo)):
            ar = [b.clone() for b in bases]
            ag = [torch.empty(n * b.numel()) for b in bases]
            rs_in = [torch.cat([b * (q + 1) for q in range(n)]) for b in bases]
            rs = [torch.empty_like(b) for b in bases]
            before = tp.served["terrapipe"]
            for kind in ("allreduce", "allgather", "reduce_scatter"):
                with dist._coalescing_manager(group=group, async_ops=async_ops) as cm:
                    for k in range(len(bases)):
                        if kind == "allreduce":
                            dist.all_reduce(ar[k], op=op if op != dist.ReduceOp.AVG or name == "tp"
                                            else dist.ReduceOp.SUM, group=group)
                        elif kind == "allgather":
                            dist.all_gather_into_tensor(ag[k], bases[k], group=group)
                        else:
                            dist.reduce_scatter_tensor(rs[k], rs_in[k], group=group)
                if async_ops:
                    cm.wait()
            if name == "gloo" and op == dist.ReduceOp.AVG:  # Gloo has no AVG: its sum, divided
                ar = [t / n for t in ar]
            if name == "tp":
                assert tp.served["terrapipe"] - before == 3, "one fused call per batch"
            results[name] = ar + ag + rs
        for x, y in zip(results["tp"], results["gloo"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    _close()


def _ddp_equals_one_process(model, batches, variants, sgd: dict, device=None, rtol=1e-5, atol=1e-6):
    """Train ``model()`` in one process on each whole batch, and ``DDP(model(), **kw)`` for each
    ``kw`` in ``variants`` with every rank on its equal slice of it: DDP averages the ranks'
    gradients, so each variant's parameters must equal the one process's. sgd: SGD's keyword
    arguments; device: where the models and batches go (the CPU by default)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    dev = device if device is not None else torch.device("cpu")
    k = batches[0][0].shape[0] // n

    def train(net, part):
        opt = torch.optim.SGD(net.parameters(), **sgd)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(part(x).to(dev)), part(y).to(dev)).backward()
            opt.step()

    ref = model().to(dev)
    train(ref, lambda t: t)
    for kw in variants:
        net = model().to(dev)
        train(DDP(net, **kw), lambda t: t[r * k:(r + 1) * k])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        for a, b in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_ddp_equals_one_process_on_the_union_batch(mpi_comm):
    tp, _ = _init(mpi_comm)
    n = dist.get_world_size()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))

    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8 * n, 32, generator=g), torch.randint(0, 5, (8 * n,), generator=g))
               for _ in range(5)]
    # Small buckets: several allreduces per backward, launched while backward runs.
    _ddp_equals_one_process(model, batches, [{"bucket_cap_mb": 0.005, "static_graph": static}
                                             for static in (False, True)], {"lr": 0.1, "momentum": 0.9})
    assert tp.served["terrapipe"] >= 5 * 3
    _close()


@pytest.mark.mpi(ranks=(2, 4), timeout=240, ci_ranks=(2,))
def test_ddp_buckets_past_the_single_copy_threshold(mpi_comm):
    """DDP's default buckets of a 2.6M-parameter model (one of 1 MiB, then up to 25 MB) are
    private torch memory reduced single-copy (NOTE [single-copy allreduce] in
    comm/algorithms/single_copy.py); training equals one process on the union batch, both ways
    DDP hands them over."""
    from terrapipe.comm.algorithms import single_copy

    tp, _ = _init(mpi_comm)
    n = dist.get_world_size()
    shm = tp.group.shm
    log = tp.group.record_algorithms()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 1200), torch.nn.ReLU(), torch.nn.Linear(1200, 1500),
                                   torch.nn.ReLU(), torch.nn.Linear(1500, 10))

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4 * n, 256, generator=g), torch.randint(0, 10, (4 * n,), generator=g))
               for _ in range(3)]
    _ddp_equals_one_process(model, batches, [{"gradient_as_bucket_view": v} for v in (False, True)],
                            {"lr": 0.05})
    taken = [nbytes for coll, algorithm, nbytes in log if algorithm == "single_copy"]
    if shm.peers is not None:
        assert taken and max(taken) >= single_copy.MIN_BYTES, log
    _close()


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_comm_hooks_functional_collectives_and_fsdp2(mpi_comm):
    _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    import torch.distributed._functional_collectives as fc
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    t = torch.arange(6.0) * (r + 1)
    assert fc.all_reduce(t, "sum", dist.group.WORLD).tolist() == (torch.arange(6.0) * 3).tolist()
    assert fc.all_gather_tensor(t, 0, dist.group.WORLD).tolist() == torch.cat(
        [torch.arange(6.0), torch.arange(6.0) * 2]).tolist()
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4)
    ddp = DDP(net)
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    x = torch.randn(4, 16) + r
    ddp(x).sum().backward()
    grads = [torch.empty_like(net.weight.grad) for _ in range(n)]
    dist.all_gather(grads, net.weight.grad)
    assert torch.equal(grads[0], grads[1])  # every rank holds the same averaged gradient
    # FSDP2: shards parameters, all-gathers them forward, reduce-scatters gradients backward.
    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (n,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        xs = torch.randn(4 * n, 8, generator=g)
        model(xs[4 * r:4 * (r + 1)]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(xs).pow(2).mean().backward()
        ropt.step()
        ropt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    _close()


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_mismatch_raises_on_every_rank_and_subgroups(mpi_comm):
    _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(10 + (r == 1))
    with pytest.raises(Exception, match="ranks called it differently"):
        dist.all_reduce(t)
    # the group stays usable after a mismatch
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 3
    evens = dist.new_group([k for k in range(n) if k % 2 == 0])
    odds = dist.new_group([k for k in range(n) if k % 2 == 1])
    mine = evens if r % 2 == 0 else odds
    assert isinstance(mine, ProcessGroupTerrapipe)
    t = torch.full((5,), float(r))
    dist.all_reduce(t, group=mine)
    assert t[0].item() == float(sum(k for k in range(n) if k % 2 == r % 2))
    _close()


def test_registered_and_unused_without_init():
    assert "TERRAPIPE" in dist.Backend._plugins
    assert not dist.is_initialized()
    np.testing.assert_equal(dist.Backend("terrapipe"), "terrapipe")


def test_import_torch_registers_the_name_and_loads_no_terrapipe_layer():
    """The ``torch.backends`` entry point (pyproject.toml): ``import torch`` alone knows
    backend="terrapipe", and loads only the leaf that registers it; the backend (and comm) load
    when a group is made, and a lone process can make one with no terrapipe import."""
    import subprocess
    import sys

    code = """
import sys, torch, torch.distributed as dist
loaded = sorted(m for m in sys.modules if m.startswith("terrapipe"))
assert loaded == ["terrapipe", "terrapipe.torch_backend"], loaded
assert dist.Backend.backend_capability["terrapipe"] == ["cpu", "cuda"]
dist.init_process_group("terrapipe", store=dist.HashStore(), rank=0, world_size=1)
assert "terrapipe.comm" in sys.modules and dist.get_backend() == "terrapipe"
t = torch.arange(4.0)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
dist.destroy_process_group()
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_premul_sum_and_avg_of_integers(mpi_comm):
    _, gloo = _init(mpi_comm)
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.arange(5, dtype=torch.float32) + r
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5))
    assert t.tolist() == [2.5 * (2 * k + 1) for k in range(5)]
    # a tensor factor, as FSDP passes it
    t = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.5, dtype=torch.float64)))
    assert t.tolist() == [0.5 * n] * 3
    _close()


def test_a_lone_process_needs_no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE",
                "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD"):
        monkeypatch.delenv(var, raising=False)
    terrapipe.distributed.init_process_group()
    try:
        t = torch.arange(4.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and dist.get_backend() == "terrapipe"
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_a_rank_that_never_arrives_is_named_not_waited_for(mpi_comm):
    import time

    from terrapipe.comm import CollectiveTimeoutError, CommError

    _init(mpi_comm, timeout=3)
    r = dist.get_rank()
    t = torch.ones(100_000)
    if r == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="rank 1") as e:
            dist.all_reduce(t)
        assert time.monotonic() - start < 30, "the timeout bounds the wait"
        assert "allreduce" in str(e.value)
        # the step counters are out of step now: the group says so instead of mismatching data
        with pytest.raises(CommError, match="unusable after an earlier failure"):
            dist.all_reduce(torch.ones(3), async_op=True)
    mpi_comm.Barrier()  # rank 1 never called all_reduce; both leave together
