"""hvd.DistributedOptimizer, broadcast_parameters / broadcast_optimizer_state and SyncBatchNorm
at 1, 2 and 4 ranks, against a single process that sees every rank's data."""

import warnings

import pytest
import torch

import terrapipe.horovod as hvd
from terrapipe.horovod import sparse_allreduce_async

from .misuse import check_out_of_order_use_is_refused


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.unused = torch.nn.Linear(2, 2)  # never in the graph: zero gradients on every rank

    def forward(self, x):
        return self.body(x)


def _model(seed):
    torch.manual_seed(seed)
    return _Net()


def _batch(r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _check_distributed_optimizer_equals_one_process():
    r, n = hvd.rank(), hvd.size()
    for opts in ({}, {"num_groups": 2}, {"backward_passes_per_step": 2},
                 {"compression": hvd.Compression.fp16}, {"op": hvd.Sum},
                 {"gradient_predivide_factor": 2.0}):
        passes = opts.get("backward_passes_per_step", 1)
        model, ref = _model(r), _model(0)  # different start on every rank: broadcast fixes it
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        pairs = zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **opts)
        assert isinstance(opt, torch.optim.SGD) and opt.param_groups is base.param_groups
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for k in range(passes):
                x, y = _batch(r, 10 * step + k)
                torch.nn.functional.mse_loss(model(x), y).backward()
                for q in range(n):
                    x, y = _batch(q, 10 * step + k)
                    loss = torch.nn.functional.mse_loss(ref(x), y)
                    (loss if opts.get("op") == hvd.Sum else loss / n).backward()
            opt.step()
            ref_opt.step()
        tol = 2e-3 if "compression" in opts else 1e-5
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=f"{opts}: {name}")
    # Horovod's errors and warnings
    model = _model(0)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: w"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[:1])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
    x, y = _batch(r, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    check_out_of_order_use_is_refused(opt, lambda: torch.nn.functional.mse_loss(model(x), y).backward())
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with opt.skip_synchronize(), warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def _sparse_rows(q, rows=10, dim=3):
    """Rank ``q``'s sparse (rows, dim) tensor: a few random rows, none at all on rank 1."""
    g = torch.Generator().manual_seed(7 + q)
    dense = torch.zeros(rows, dim)
    if q != 1:
        picked = torch.randperm(rows, generator=g)[:3 + q % 3]
        dense[picked] = torch.randn(len(picked), dim, generator=g)
    return dense.to_sparse()


def _embedding_batch(q, step):
    g = torch.Generator().manual_seed(1000 * step + q)
    return torch.randint(0, 12, (2, 3 + q % 2), generator=g)  # ranks' batches differ in size


def _check_sparse_gradients_as_horovod_reduces_them():
    r, n = hvd.rank(), hvd.size()
    # sparse_allreduce_async: every rank's entries, uncoalesced; their sum is the dense reduction
    mine = _sparse_rows(r)
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        out = sparse_allreduce_async(mine, f"sparse.{op}", op)()
        assert out.is_sparse and out.shape == mine.shape
        assert out._nnz() == sum(_sparse_rows(q)._nnz() for q in range(n))
        want = sum(_sparse_rows(q).to_dense() for q in range(n)) * scale
        torch.testing.assert_close(out.to_dense(), want)
    with pytest.raises(ValueError, match="sparse COO"):
        sparse_allreduce_async(mine.to_dense(), "dense", hvd.Sum)
    # DistributedOptimizer over a sparse embedding, both of Horovod's ways, against one process
    # on the union batch; the optimizer (SparseAdam) accepts only sparse gradients.
    for sparse_as_dense, passes in ((False, 1), (False, 2), (True, 1)):
        torch.manual_seed(0)
        emb, ref = torch.nn.Embedding(12, 4, sparse=True), torch.nn.Embedding(12, 4, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=sparse_as_dense, backward_passes_per_step=passes)
        assert opt._parameter_names == {emb.weight: "weight"}
        ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for k in range(passes):
                (emb(_embedding_batch(r, 10 * step + k)) ** 2).sum().backward()
                for q in range(n):
                    ((ref(_embedding_batch(q, 10 * step + k)) ** 2).sum() / n).backward()
            opt.step()
            ref_opt.step()
            assert emb.weight.grad.is_sparse
        torch.testing.assert_close(emb.weight, ref.weight, rtol=1e-5, atol=1e-5,
                                   msg=f"sparse_as_dense={sparse_as_dense}, passes={passes}")
        # after the first step the sparse parameter left the buckets (no zeros travel for it)
        if n > 1:  # (one rank: no reduction at all)
            in_buckets = any(q is emb.weight for b in opt._hvd_grads.buckets for q in b)
            assert in_buckets == sparse_as_dense
    # A sparse embedding beside a dense layer, and a step where rank 1 does not use the
    # embedding: its share goes empty (before, the other ranks waited for it and timed out).
    for sparse_as_dense in (False, True):
        model, ref = _SparseNet(), _SparseNet()
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(4):
            opt.zero_grad()
            ref_opt.zero_grad()
            (model(_embedding_batch(r, step), use_embedding=(r, step) != (1, 2)) ** 2).sum().backward()
            for q in range(n):
                out = ref(_embedding_batch(q, step), use_embedding=(q, step) != (1, 2))
                ((out ** 2).sum() / n).backward()
            opt.step()
            ref_opt.step()
            assert model.emb.weight.grad.is_sparse and not model.head.weight.grad.is_sparse
        for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5,
                                       msg=f"{name}, sparse_as_dense={sparse_as_dense}")


class _SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(12, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, idx, use_embedding=True):
        h = self.emb(idx).sum(1) if use_embedding else torch.ones(idx.shape[0], 4)
        return self.head(h)


@pytest.mark.mpi(ranks=(1, 2), timeout=240)
def test_broadcast_optimizer_state(mpi_comm):
    hvd.init()
    try:
        r = hvd.rank()
        for make in (lambda p: torch.optim.Adam(p, lr=0.01 * (r + 1)),
                     lambda p: torch.optim.SGD(p, lr=0.1 * (r + 1), momentum=0.5, weight_decay=0.1),
                     lambda p: torch.optim.RMSprop(p, lr=0.01 * (r + 1)),
                     lambda p: torch.optim.LBFGS(p, lr=0.1 * (r + 1))):
            model = _model(0)
            before = [p.detach().clone() for p in model.parameters()]
            opt = make(model.parameters())
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            root_lr = make([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] / (r + 1)
            assert opt.param_groups[0]["lr"] == root_lr
            # state created where the optimizer has one, without moving the parameters
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            if not isinstance(opt, torch.optim.LBFGS):
                assert len(opt.state_dict()["state"]) == len(before)
                # Horovod leaves zero gradients behind (its test_broadcast_state_no_grad reads them)
                assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
            else:
                assert all(p.grad is None for p in model.parameters())
    finally:
        hvd.shutdown()


def _check_sync_batch_norm_equals_batch_norm_on_the_whole_batch():
    r, n = hvd.rank(), hvd.size()
    xs = [torch.randn(3 + q, 4, 5, generator=torch.Generator().manual_seed(q)) * (q + 1)
          for q in range(n)]
    sync, ref = hvd.SyncBatchNorm(4), torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        sync.weight.copy_(torch.arange(4.0) + 1)
        ref.weight.copy_(torch.arange(4.0) + 1)
    x = xs[r].clone().requires_grad_()
    full = torch.cat(xs).requires_grad_()
    y, want = sync(x), ref(full)
    start = sum(len(v) for v in xs[:r])
    torch.testing.assert_close(y, want[start:start + len(xs[r])], rtol=1e-5, atol=1e-5)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(99))
    (y * w[start:start + len(xs[r])]).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(x.grad, full.grad[start:start + len(xs[r])], rtol=1e-4, atol=1e-5)
    grads = hvd.allreduce(torch.cat([sync.weight.grad, sync.bias.grad]), op=hvd.Sum)
    torch.testing.assert_close(grads, torch.cat([ref.weight.grad, ref.bias.grad]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync.running_mean, ref.running_mean)
    torch.testing.assert_close(sync.running_var, ref.running_var)
    sync.eval()
    ref.eval()
    torch.testing.assert_close(sync(xs[r]), ref(xs[r]))


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=300)
def test_distributed_optimizer_and_sync_batch_norm(mpi_comm):
    """One launch per rank count for both bodies (CI time)."""
    hvd.init()
    try:
        _check_distributed_optimizer_equals_one_process()
        _check_sparse_gradients_as_horovod_reduces_them()
        _check_sync_batch_norm_equals_batch_norm_on_the_whole_batch()
    finally:
        hvd.shutdown()
