"""hvd's ``op=hvd.Adasum`` at 1, 2 and 4 ranks: the collectives (plain, grouped, async, autograd,
compressed) against a NumPy tree of pairwise Adasums of every rank's inputs, Horovod's refusals,
and DistributedOptimizer's delta optimizer against one process that takes every rank's step."""

import numpy as np
import pytest
import torch

import terrapipe.horovod as hvd

from .misuse import check_out_of_order_use_is_refused

TINY = np.sqrt(np.finfo(np.float64).tiny)


def _tree(xs):
    """Adasum's definition: pairs of ranks, then pairs of pairs (NOTE [adasum by halves] 1)."""
    xs = [np.asarray(x, np.float64).ravel() for x in xs]
    while len(xs) > 1:
        nxt = []
        for a, b in zip(xs[::2], xs[1::2], strict=True):
            d = a @ b
            ca = 1 - d / (2 * (a @ a)) if a @ a >= TINY else 1.0
            cb = 1 - d / (2 * (b @ b)) if b @ b >= TINY else 1.0
            nxt.append(ca * a + cb * b)
        xs = nxt
    return xs[0]


def _input(q, shape, salt=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + q)) * (q + 1)


def _check_collectives():
    r, n = hvd.rank(), hvd.size()
    for salt, (shape, dtype) in enumerate([((17,), torch.float32), ((5, 7), torch.float64),
                                           ((3, 4, 5), torch.float16), ((9,), torch.bfloat16)]):
        x = _input(r, shape, salt).to(dtype)
        want = _tree([_input(q, shape, salt).to(dtype).double() for q in range(n)])
        tol = {torch.float16: 5e-3, torch.bfloat16: 4e-2}.get(dtype, 1e-5) * n * np.abs(want).max()
        out = hvd.allreduce(x, op=hvd.Adasum, name=f"adasum.{salt}")
        assert out.dtype == dtype and out.shape == x.shape and out is not x
        np.testing.assert_allclose(out.double().numpy().ravel(), want, atol=tol)
        # prescale and postscale around it, in place, async
        y = x.clone()
        h = hvd.allreduce_async_(y, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
        assert hvd.synchronize(h) is y
        np.testing.assert_allclose(y.double().numpy().ravel(), want * 0.5, atol=tol)
    # grouped: each tensor its own coefficients (one orthogonal pair, one parallel)
    basis = torch.eye(n, dtype=torch.float64)
    outs = hvd.grouped_allreduce([basis[r] * 3.0, torch.full((6,), float(r + 1), dtype=torch.float64)],
                                 op=hvd.Adasum)
    torch.testing.assert_close(outs[0], torch.full((n,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(outs[1], torch.full((6,), (n + 1) / 2, dtype=torch.float64))
    # many outstanding, each named, then awaited out of order
    hs = [hvd.allreduce_async(_input(r, (100 + i,), i), op=hvd.Adasum, name=f"many.{i}") for i in range(24)]
    for i in reversed(range(24)):
        want = _tree([_input(q, (100 + i,), i) for q in range(n)])
        np.testing.assert_allclose(hvd.synchronize(hs[i]).numpy(), want, atol=1e-5 * n * np.abs(want).max())
    # FP16 compression combines the float16 values
    z = hvd.allreduce(_input(r, (33,), 5), op=hvd.Adasum, compression=hvd.Compression.fp16)
    want = _tree([_input(q, (33,), 5).half().double() for q in range(n)])
    assert z.dtype == torch.float32
    np.testing.assert_allclose(z.numpy(), want, atol=5e-3 * n * np.abs(want).max())
    # autograd: the backward of Adasum is the Adasum of the output gradients (Horovod's)
    w = _input(r, (8,), 6).requires_grad_()
    (hvd.allreduce(w, op=hvd.Adasum) * (r + 1)).sum().backward()
    want = _tree([np.full(8, q + 1.0) for q in range(n)])
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-6)
    # Horovod's refusals
    with pytest.raises(RuntimeError):
        hvd.reducescatter(torch.ones(4 * n), op=hvd.Adasum)
    with pytest.raises(RuntimeError, match="int32"):
        hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.Adasum)
    if n > 1:
        ps = hvd.add_process_set([0])
        with pytest.raises(NotImplementedError, match="non-global process sets"):
            hvd.allreduce(torch.ones(4), op=hvd.Adasum, process_set=ps)
        hvd.remove_process_set(ps)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)

    def forward(self, x):
        return self.body(x)


def _batch(q, step):
    g = torch.Generator().manual_seed(100 * step + q)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _check_delta_optimizer_equals_each_ranks_step_combined():
    """Each step: every rank's own update (its optimizer's, from the same start), combined per
    parameter by the tree, added to the start; the optimizer's state stays each rank's own."""
    r, n = hvd.rank(), hvd.size()
    for make, passes in ((lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
                         (lambda p: torch.optim.Adam(p, lr=0.01), 1),
                         (lambda p: torch.optim.SGD(p, lr=0.1), 2)):
        model = _Net()
        opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                       op=hvd.Adasum, backward_passes_per_step=passes)
        assert isinstance(opt, torch.optim.Optimizer) and type(opt).__mro__[1] is type(make([torch.zeros(1)]))
        # One process holding every rank's model and optimizer (state per rank, as on each rank).
        refs = [_Net() for _ in range(n)]
        ref_opts = [make(m.parameters()) for m in refs]
        for step in range(3):
            opt.zero_grad()
            for k in range(passes):
                x, y = _batch(r, 10 * step + k)
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            starts = [p.detach().clone() for p in refs[0].parameters()]
            deltas = []
            for q in range(n):
                ref_opts[q].zero_grad()
                for k in range(passes):
                    x, y = _batch(q, 10 * step + k)
                    torch.nn.functional.mse_loss(refs[q](x), y).backward()
                ref_opts[q].step()
                deltas.append([(p.detach() - s).double().numpy() for p, s in
                               zip(refs[q].parameters(), starts, strict=True)])
            with torch.no_grad():
                for t, s in enumerate(starts):
                    combined = torch.from_numpy(_tree([deltas[q][t] for q in range(n)]).reshape(s.shape))
                    for m in refs:
                        list(m.parameters())[t].copy_(s + combined.float())
            for (name, p), q in zip(model.named_parameters(), refs[0].parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    # Horovod's rules for it
    model = _Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x, y = _batch(r, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    check_out_of_order_use_is_refused(opt, lambda: torch.nn.functional.mse_loss(model(x), y).backward())
    if n > 1:
        with pytest.raises(AssertionError, match="not supported when using Adasum"):
            with opt.skip_synchronize():
                pass
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=300)
def test_adasum_collectives_and_delta_optimizer(mpi_comm):
    """One launch per rank count for both bodies (CI time)."""
    hvd.init()
    try:
        _check_collectives()
        _check_delta_optimizer_equals_each_ranks_step_combined()
    finally:
        hvd.shutdown()


@pytest.mark.mpi(ranks=(4,), timeout=120)
def test_adasum_refuses_three_ranks_as_horovod_does(mpi_comm):
    hvd.init(comm=[0, 1, 2] if mpi_comm.rank < 3 else [3])
    try:
        if hvd.size() == 3:
            with pytest.raises(NotImplementedError, match="non-power of 2"):
                hvd.allreduce(torch.ones(4), op=hvd.Adasum)
    finally:
        hvd.shutdown()
