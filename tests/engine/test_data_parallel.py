"""Data-parallel SGD at 1, 2 and 4 ranks equals one process on the union of the batches."""

import glob
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import terrapipe.comm as comm
from terrapipe.engine import (
    DistributedGradients,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)


class Net(nn.Module):
    """A small convnet with a tied layer (used twice) and a branch only some ranks use."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3)
        self.tied = nn.Linear(16, 16)
        self.proj = nn.Linear(8 * 6 * 6, 16)
        self.head = nn.Linear(16, 10)
        self.extra = nn.Linear(16, 16)

    def forward(self, x, use_extra=False):
        h = F.relu(self.proj(F.relu(self.conv(x)).flatten(1)))
        h = torch.tanh(self.tied(torch.tanh(self.tied(h))))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def _batch(step, n):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _close(a: nn.Module, b: nn.Module, tol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


CONFIGS = [
    dict(bucket_mb=1e-6),                      # every parameter its own bucket (smaller than one)
    dict(bucket_mb=25, first_bucket_mb=0.001),
    dict(compression="bf16"),
]


def _steps_match_single_process(cfg: dict, device: str = "cpu") -> DistributedOptimizer:
    r, p, b = comm.rank(), comm.size(), 4
    ref = Net(seed=1).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = Net(seed=1 + r).to(device)  # different on purpose: broadcast_parameters makes them equal
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, **cfg)
    broadcast_parameters(model, root=0)
    broadcast_optimizer_state(opt, root=0)
    for step in range(4):
        x, y = (t.to(device) for t in _batch(step, b * p))
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        opt.step()
    _close(model, ref, 3e-2 if cfg.get("compression") else (1e-4 if device != "cpu" else 1e-5))
    return opt


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=300)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["tiny-buckets", "default", "bf16"])
def test_steps_match_single_process_on_the_union_batch(mpi_comm, cfg):
    comm.init(timeout=60)
    opt = _steps_match_single_process(cfg)
    assert opt.gradients.backend == "jit"  # host parameters: the CPU-staged path


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.mpi(ranks=(1, 2), timeout=300)
@pytest.mark.parametrize("backend", ["jit", "nccl"])
@pytest.mark.parametrize("compression", [None, "bf16"])
def test_cuda_model_steps_match_single_process(mpi_comm, backend, compression):
    if backend == "nccl" and torch.cuda.device_count() < mpi_comm.Get_size():
        pytest.skip("NCCL needs a GPU per rank")
    comm.init(timeout=120)
    torch.cuda.set_device(comm.local_rank() % torch.cuda.device_count())
    cfg = dict(bucket_mb=0.01, first_bucket_mb=0.001, backend=backend, compression=compression)
    opt = _steps_match_single_process(cfg, device="cuda")
    assert opt.gradients.backend == backend


def test_backend_argument_is_checked():
    model = Net(seed=0)
    g = comm.Group(None)
    with pytest.raises(ValueError, match="backend must be"):
        DistributedGradients(model, backend="mpi", group=g)
    with pytest.raises(ValueError, match="backend='nccl' needs every parameter on a CUDA device"):
        DistributedGradients(model, backend="nccl", group=g)
    with pytest.raises(ValueError, match="compression"):
        DistributedGradients(model, compression="int8", group=g)
    assert DistributedGradients(model, group=g).backend == "jit"


@pytest.mark.mpi(ranks=(1, 2), timeout=300)
@pytest.mark.parametrize("mode", ["no_sync", "passes_per_step"])
def test_gradient_accumulation(mpi_comm, mode):
    comm.init(timeout=60)
    r, p, b = comm.rank(), comm.size(), 3
    ref = Net(seed=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = Net(seed=2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, bucket_mb=0.01,
                               backward_passes_per_step=2 if mode == "passes_per_step" else 1)
    for step in range(3):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(10 * step + micro, b * p)
            F.cross_entropy(ref(x), y).backward()
            loss = F.cross_entropy(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b])
            if mode == "no_sync" and micro == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        ref_opt.step()
        opt.step()
    _close(model, ref, 1e-5)


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_parameter_unused_on_one_rank_and_zero_grad_in_flight(mpi_comm):
    comm.init(timeout=60)
    r = comm.rank()
    model = Net(seed=3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=0.001)
    x, y = _batch(0, 4)
    F.cross_entropy(model(x, use_extra=(r == 0)), y).backward()
    if r == 0:
        # Rank 0 launched buckets during backward. Rank 1 launched none: its first bucket
        # (`extra`, registered last) never completed, so it holds nothing in flight.
        assert opt.gradients.in_flight()
        with pytest.raises(RuntimeError, match="in flight"):
            opt.zero_grad()
    else:
        assert not opt.gradients.in_flight()
    opt.step()  # rank 1 contributes zeros for `extra`; nobody hangs
    gathered = comm.allgather(torch.cat([q.detach().reshape(-1) for q in model.parameters()]))
    assert torch.equal(gathered[0], gathered[1])  # every rank took the same step
    opt.zero_grad()


def test_argument_errors():
    model = Net(seed=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedGradients(model, bucket_mb=0, group=comm.Group(None))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedGradients(model, backward_passes_per_step=0, group=comm.Group(None))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters"):
        DistributedGradients(frozen, group=comm.Group(None))


FAILING = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import terrapipe.comm as comm
    from terrapipe.engine import DistributedOptimizer
    comm.init(timeout=60)
    model = torch.nn.Linear(10, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(100):
        if comm.rank() == 1 and step == 3:
            raise ValueError("bad batch on rank one")
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 10)), torch.zeros(4, 2)).backward()
        opt.step()
    """
)


def _mpich_files():
    return set(glob.glob("/dev/shm/mpich_shm_*"))


def test_exception_on_one_rank_ends_every_rank(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    before = _mpich_files()
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "-n", "2", sys.executable, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    # Named in the launcher's summary: the rank's own traceback may be cut short by the abort.
    assert "rank 1 failed first, with exit code 1: ValueError: bad batch on rank one" in out.stderr
    # Regression: the aborted job's ranks never reached MPI_Finalize, and MPICH's node file
    # stayed in /dev/shm after every failed run.
    assert _mpich_files() <= before


def test_launcher_reports_the_first_failing_rank_and_its_code():
    code = "import os, sys; sys.exit(5 if os.environ['PMI_RANK'] == '2' else 0)"
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "-n", "3", "--", sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 5
    assert "terrapipe run: " in out.stderr and "mpiexec -n 3" in out.stderr
    assert "rank 2 failed first, with exit code 5" in out.stderr
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "-n", "2", sys.executable, "-c", "pass"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0


@pytest.mark.mpi(ranks=(1, 2), timeout=120)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_of_one_flat_buffer_per_bucket(mpi_comm, set_to_none):
    comm.init(timeout=60)
    r, p, b = comm.rank(), comm.size(), 3
    ref = Net(seed=4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = Net(seed=4)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=0.01)
    grads = opt.gradients
    for step in range(3):
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        x, y = _batch(step, b * p)
        F.cross_entropy(ref(x), y).backward()
        F.cross_entropy(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        opt.step()
        ref_opt.step()
        for bucket, flat in zip(grads.buckets, grads._bucket_flats, strict=True):
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            for q in bucket:
                assert lo <= q.grad.data_ptr() < hi, "a .grad is not a view of its bucket's buffer"
    _close(model, ref, 1e-5)


class Swapped(nn.Module):
    """Registered in the opposite order to its use: reverse registration puts the gradients
    backward produces last into the first bucket."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.late = nn.Linear(64, 10)
        self.early = nn.Linear(16, 64)

    def forward(self, x):
        return self.late(torch.relu(self.early(x)))


@pytest.mark.mpi(ranks=(1, 2), timeout=120)
def test_buckets_follow_the_order_gradients_arrive_in(mpi_comm):
    """NOTE [bucket launch order] 1: after the first step the buckets are cut along backward's
    order, so the first ones are reduced while backward still runs."""
    comm.init(timeout=60)
    r, p, b = comm.rank(), comm.size(), 4
    ref, model = Swapped(), Swapped()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    launched_before_last = []  # buckets in flight as early's first gradient arrives (before
    model.early.bias.register_post_accumulate_grad_hook(  # the engine's hook, registered later)
        lambda _p: launched_before_last.append(len(grads._handles)))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=1e-6,
                               first_bucket_mb=1e-6)  # a bucket per parameter
    grads = opt.gradients
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(b * p, 16, generator=g), torch.randint(0, 10, (b * p,), generator=g)
        for m, o, xs, ys in ((ref, ref_opt, x, y), (model, opt, x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])):
            o.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            o.step()
    late = {id(model.late.weight), id(model.late.bias)}
    assert {id(q) for q in grads.buckets[0]} <= late and {id(q) for q in grads.buckets[1]} <= late
    # step 0 in registration order: nothing could start before early's gradients; then late's
    # two buckets are in flight by the time early's last gradient arrives
    assert launched_before_last[0] == 0 and launched_before_last[1:] == [2, 2], launched_before_last
    _close(model, ref, 1e-5)


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))
def test_buckets_in_shared_memory_match_single_process(mpi_comm):
    """Buckets beyond the one-shot live in one node-shared array and are reduced in place
    (NOTE [gradients as bucket views] 4); results equal one process, through a rebucket."""
    comm.init(timeout=60)
    r, p, b = comm.rank(), comm.size(), 4

    def mlp():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(64, 1100), nn.ReLU(), nn.Linear(1100, 1100), nn.ReLU(),
                             nn.Linear(1100, 10))  # 1.2M parameters: a 4.8 MB bucket

    ref, model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    grads = opt.gradients
    assert grads.shared, "a one-node group's host buckets belong in shared memory"
    for step in range(6):
        if step == 3:
            grads.rebucket(bucket_mb=2, first_bucket_mb=0.5)
            assert grads.shared and len(grads.buckets) > 2
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(b * p, 64, generator=g), torch.randint(0, 10, (b * p,), generator=g)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        F.cross_entropy(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        opt.step()
    _close(model, ref, 1e-5)
    grads.remove()
    assert not grads.shared


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_grad_scaler_in_horovods_order_skips_an_inf_on_one_rank_everywhere(mpi_comm):
    comm.init(timeout=60)
    r = comm.rank()
    model = Net(seed=5)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=0.001)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(step, 4)
        loss = F.cross_entropy(model(x), y)
        if step == 1 and r == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        start = [q.detach().clone() for q in model.parameters()]
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(a, q) for a, q in zip(start, model.parameters(), strict=True))
        assert moved == (step != 1), step  # the inf on rank 1 skipped step 1 on both ranks
        assert not opt.gradients.in_flight()
    assert scaler.get_scale() == 1024.0 * 0.5
    gathered = comm.allgather(torch.cat([q.detach().reshape(-1) for q in model.parameters()]))
    assert torch.equal(gathered[0], gathered[1])
