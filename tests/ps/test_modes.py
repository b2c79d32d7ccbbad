"""Training modes on the parameter server: exact bookkeeping, each mode learns, averaging every
step equals synchronous data parallelism, and the asynchronous modes outrun a straggler."""

import time

import numpy as np
import pytest
import torch
from torch import nn

import terrapipe.comm as comm
from terrapipe import ps
from terrapipe.comm import Group


class AddRank(torch.optim.Optimizer):
    """A step adds ``rank + 1`` to every parameter: integer-valued floats, so any update lost or
    counted twice shows as an exact mismatch."""

    def __init__(self, params, rank):
        super().__init__(params, {})
        self.rank = rank

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(self.rank + 1)


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=240, ci_ranks=(2,))
def test_downpour_counts_every_update_exactly_once(mpi_comm):
    for node_size in (None, 1):
        g = Group(mpi_comm.Dup(), 60, node_size=node_size)
        torch.manual_seed(g.rank)  # different starts: the broadcast makes them rank 0's
        model = nn.Linear(30, 20)
        with torch.no_grad():  # integers: every sum below is exact in float32
            for p in model.parameters():
                p.copy_(torch.randint(-50, 50, p.shape))
        start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        comm.broadcast(start, 0, group=g)
        opt = ps.Downpour(AddRank(model.parameters(), g.rank), n_push=3, n_pull=2, group=g,
                          chunk_bytes=256)
        rng = np.random.default_rng(g.rank)
        steps = 40
        for _ in range(steps):
            opt.step()
            time.sleep(float(rng.uniform(0, 0.004)))  # ranks drift apart
        opt.consolidate()
        got = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        total = steps * g.size * (g.size + 1) / 2
        assert torch.equal(got, start + total), (node_size, (got - start)[:4], total)
        opt.close()
        g.close()


def test_easgd_moves_both_sides_by_alpha_times_the_difference():
    g = Group(None, 60)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = ps.EASGD(torch.optim.SGD(model.parameters(), lr=0.5), alpha=0.25, tau=2, group=g)
    model.weight.grad = torch.full((1, 4), 2.0)
    opt.step()  # x = 1 - 0.5 * 2 = 0; no elastic step yet (tau=2)
    assert torch.all(model.weight == 0.0)
    opt.step()  # x = -1, c = 1: d = 0.25 * (-2) = -0.5; x = -0.5, c = 0.5
    assert torch.all(model.weight == -0.5)
    assert torch.all(opt.center.pull().wait() == 0.5)
    opt.consolidate()
    assert torch.all(model.weight == 0.5)
    opt.close()
    with pytest.raises(ValueError, match="alpha must be in"):
        ps.EASGD(torch.optim.SGD(model.parameters(), lr=0.5), alpha=1.5, group=g)
    with pytest.raises(ValueError, match="n_push must be at least 1"):
        ps.Downpour(torch.optim.SGD(model.parameters(), lr=0.5), n_push=0, group=g)


def _mode(mode, sgd, g, n_push, n_pull, tau, k):
    """The wrapper of ``mode`` ("sync" is averaging every step) around ``sgd`` over ``g``."""
    if mode == "downpour":
        return ps.Downpour(sgd, n_push=n_push, n_pull=n_pull, group=g)
    if mode == "easgd":
        return ps.EASGD(sgd, tau=tau, group=g)
    return ps.ModelAveraging(sgd, k=1 if mode == "sync" else k, group=g)


def _regression(rank, n=4000, d=16):
    w = torch.randn(d, 1, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, d, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=g)


@pytest.mark.mpi(ranks=(1, 2), timeout=120)
def test_model_averaging_every_step_with_sgd_is_synchronous_data_parallelism(mpi_comm):
    g = Group(mpi_comm.Dup(), 60)
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    reference = nn.Linear(16, 1)
    reference.load_state_dict(model.state_dict())
    opt = ps.ModelAveraging(torch.optim.SGD(model.parameters(), lr=0.05), k=1, group=g)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    data = [_regression(q, n=640) for q in range(g.size)]
    for step in range(20):
        sl = slice(32 * step, 32 * (step + 1))
        x, y = data[g.rank]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        # The reference: one process, the mean of every rank's gradient.
        ref_opt.zero_grad()
        sum(nn.functional.mse_loss(reference(xq[sl]), yq[sl]) for xq, yq in data).div(g.size).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    g.close()


@pytest.mark.mpi(ranks=(2,), timeout=180)
def test_each_mode_learns_a_regression(mpi_comm):
    for mode in ("downpour", "easgd", "averaging"):
        g = Group(mpi_comm.Dup(), 60, node_size=1 if mode == "easgd" else None)
        torch.manual_seed(g.rank)
        model = nn.Linear(16, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.02)
        opt = _mode(mode, sgd, g, n_push=2, n_pull=3, tau=2, k=4)
        x, y = _regression(g.rank)
        with torch.no_grad():
            before = nn.functional.mse_loss(model(x), y).item()
        for step in range(250):
            sl = slice((32 * step) % 4000, (32 * step) % 4000 + 32)
            opt.zero_grad()
            nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
            opt.step()
        opt.consolidate()
        with torch.no_grad():
            after = nn.functional.mse_loss(model(x), y).item()
        assert after < 1e-3 < before, (mode, before, after)
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
        everyone = g.comm.allgather(flat)
        assert all(np.array_equal(everyone[0], f) for f in everyone), f"{mode}: ranks left apart"
        opt.close()
        g.close()


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_asynchronous_modes_outrun_a_straggler(mpi_comm):
    # A job of a fixed number of samples; rank 1 sleeps 40 ms every step. Synchronous training
    # (averaging every step) holds every rank to the straggler's step count; Downpour and EASGD
    # let rank 0 take the samples rank 1 cannot, shared through a counter on the parameter
    # server. Measured in steps, not seconds: who did the work, whatever the machine's load.
    g = Group(mpi_comm.Dup(), 60)
    batch, total = 32, 32 * 60
    x, y = _regression(g.rank)
    steps = {}
    for mode in ("sync", "downpour", "easgd"):
        torch.manual_seed(0)
        model = nn.Linear(16, 1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = _mode(mode, sgd, g, n_push=1, n_pull=1, tau=1, k=1)
        counter = ps.ShardedTensor(np.zeros(1, np.int64), g)
        done, step = 0, 0
        while done < total:
            sl = slice((batch * step) % 4000, (batch * step) % 4000 + batch)
            opt.zero_grad()
            nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
            if g.rank == 1:
                time.sleep(0.04)
            opt.step()
            step += 1
            if mode == "sync":
                done = step * batch * g.size  # lockstep
            else:
                done = int(counter.push_pull(np.array([batch], np.int64)).wait()[0])
        opt.consolidate()
        steps[mode] = g.comm.allgather(step)
        counter.close()
        opt.close()
    assert steps["sync"] == [total // (batch * g.size)] * 2, steps
    for mode in ("downpour", "easgd"):
        fast, slow = steps[mode]
        assert (fast + slow) * batch >= total and fast >= 3 * slow, (mode, steps)
    g.close()


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_engine_trains_with_a_parameter_server_mode(mpi_comm):
    from terrapipe import FastLoader
    from terrapipe.engine import Engine
    from terrapipe.pipeline import ArrayDataset, Normalize

    comm.init(timeout=60)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 256)
    imgs = np.full((256, 8, 8, 3), 100.0)
    for c in range(3):
        imgs[labels == c, :, :, c] += 90
    imgs = np.clip(imgs + rng.normal(0, 30, imgs.shape), 0, 255).astype(np.uint8)
    torch.manual_seed(comm.rank())
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    opt = ps.Downpour(torch.optim.SGD(model.parameters(), lr=0.05), n_push=2, n_pull=2)
    tf = [Normalize((0.5,) * 3, (0.25,) * 3)]
    loader = FastLoader(ArrayDataset(imgs, labels), tf, batch_size=16, shuffle=True)
    history = Engine(model, nn.functional.cross_entropy, opt, loader, loader, progress=False).train(4)
    assert history[-1]["val_accuracy"] > 0.9 and history[-1]["train_loss"] < history[0]["train_loss"]
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    everyone = mpi_comm.allgather(flat)
    assert np.array_equal(everyone[0], everyone[1])  # the epoch ended on the server's model
    opt.close()
