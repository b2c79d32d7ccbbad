"""comm.adasum_allreduce at 1, 2 and 4 ranks against a NumPy tree of pairwise Adasums of every
rank's inputs, over the world, a split and a duplicate (the same body on each, as mpi4py's
suite runs); under load (a loop of hundreds with many outstanding); and its errors."""

import numpy as np
import pytest
import torch

import terrapipe.comm as comm
from terrapipe.comm.algorithms import adasum as adasum_algorithm

TINY = np.sqrt(np.finfo(np.float64).tiny)
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64}


def _pair(a, b):
    d = a @ b
    ca = 1 - d / (2 * (a @ a)) if a @ a >= TINY else 1.0
    cb = 1 - d / (2 * (b @ b)) if b @ b >= TINY else 1.0
    return ca * a + cb * b


def _tree(xs):
    """Adasum's definition (NOTE [adasum by halves] 1): pairs, then pairs of pairs."""
    xs = [np.asarray(x, np.float64) for x in xs]
    while len(xs) > 1:
        xs = [_pair(xs[i], xs[i + 1]) for i in range(0, len(xs), 2)]
    return xs[0]


def _groups(world):
    return {"world": world, "split": world.split(world.rank % 2), "duplicate": world.split(0)}


def _inputs(seed, q, sizes, dtype):
    """Rank ``q``'s tensors (float64 values exactly representable in ``dtype``)."""
    g = np.random.default_rng([seed, q])
    return [torch.from_numpy(g.normal(size=s) * (q + 1)).to(TORCH[dtype]).double().numpy() for s in sizes]


def _as(x, dtype, kind):
    t = torch.from_numpy(x.copy()).to(TORCH[dtype])  # never the reference input itself
    return t if kind == "torch" or dtype == "bfloat16" else t.numpy()


def _check(g, seed, sizes, dtype, kind="torch", async_op=False):
    """Issue one Adasum of tensors of ``sizes``; returns a function that waits and checks it."""
    ins = [_inputs(seed, q, sizes, dtype) for q in range(g.size)]  # by rank of g
    mine = [_as(x, dtype, kind) for x in ins[g.rank]]
    h = comm.adasum_allreduce(mine, async_op=async_op, group=g)

    def finish():
        if async_op:
            assert h.wait() is mine
        for t, s in enumerate(sizes):
            want = _tree([ins[q][t] for q in range(g.size)])
            got = torch.as_tensor(mine[t]).double().numpy()
            tol = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-6, "float64": 1e-13}[dtype]
            scale = np.abs(want).max() if s else 1.0
            np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale * g.size,
                                       err_msg=f"tensor {t} of {sizes} ({dtype}) at {g.size} ranks")
        # Every element is computed by one rank (clause 4): the same bits everywhere.
        for t in mine:
            bits = torch.as_tensor(t).contiguous().view(-1)
            bits = bits.view(torch.int16) if bits.element_size() == 2 else bits
            every = comm.allgather(bits, group=g)
            assert bool((every == every[0]).all()), "ranks hold different results"

    return finish


@pytest.fixture
def world(mpi_comm):
    return comm.init(timeout=60)


@pytest.fixture(params=["halves", "one_gather"])
def path(request, monkeypatch):
    """Each way a call may go (NOTE [adasum by halves] 8), forced alike on every rank."""
    monkeypatch.setattr(adasum_algorithm, "GATHER_BYTES", 0 if request.param == "halves" else 1 << 40)
    return request.param


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=300, ci_ranks=(1, 2))  # 4: make test-full (CI time)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_adasum_is_the_pairwise_tree_over_world_split_and_duplicate(world, dtype, path):
    # Lengths around every halving's parity and below the rank count; several tensors fused,
    # each with its own coefficients; NumPy arrays and tensors.
    cases = [[0], [1], [3], [7, 0, 5], [1000], [999, 1, 2], [4097, 33]]
    for g in _groups(world).values():
        for seed, sizes in enumerate(cases):
            _check(g, seed, sizes, dtype, kind="numpy" if seed % 2 else "torch")()
        if g is not world:
            g.close()


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2, 4))
def test_orthogonal_gradients_add_and_parallel_ones_average(world, path):
    r, n = comm.rank(), comm.size()
    q, _ = np.linalg.qr(np.random.default_rng(2).normal(size=(1003, n)))
    x = torch.from_numpy(q[:, r].copy())
    comm.adasum_allreduce(x)
    np.testing.assert_allclose(x.numpy(), q.sum(axis=1), atol=1e-12)
    v = np.random.default_rng(3).normal(size=999)
    scale = np.random.default_rng(4).uniform(0.1, 3, n)
    y = v * scale[r]
    comm.adasum_allreduce(y)
    np.testing.assert_allclose(y, v * scale.mean(), rtol=1e-12)
    # A rank with nothing (a zero gradient) leaves the others' combination as it is.
    z = np.zeros(64) if r == 0 else np.full(64, float(r))
    comm.adasum_allreduce(z)
    want = _tree([np.zeros(64)] + [np.full(64, float(p)) for p in range(1, n)])
    np.testing.assert_allclose(z, want, rtol=1e-12)


@pytest.mark.mpi(ranks=(2, 4), timeout=600, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_many_outstanding_in_a_loop_across_sizes(world):
    """Hundreds of calls, up to 8 async ones in flight between sync ones, sizes across the
    shared-memory paths' thresholds (to 3 MiB a rank's half), mixed with plain allreduces."""
    sizes = [1, 17, 4096, 16_385, 262_147, 1_500_001]
    pending = []
    rounds = 240
    for i in range(rounds):
        n = sizes[i % len(sizes)] if i % 40 else sizes[-1]
        dtype = ("float32", "bfloat16", "float64")[i % 3]
        if i % 5 == 4:  # a plain collective between them, in issue order
            x = np.full(1000, float(comm.rank() + i), np.float32)
            comm.allreduce(x, async_op=bool(i % 2)).wait() if i % 2 else comm.allreduce(x)
            assert x[0] == sum(q + i for q in range(comm.size()))
            continue
        pending.append(_check(world, 1000 + i, [n, 3], dtype, async_op=i % 3 != 0))
        if len(pending) >= 8 or i == rounds - 1:
            for finish in pending:
                finish()
            pending.clear()


@pytest.mark.mpi(ranks=(2, 4), timeout=120, ci_ranks=(2, 4))
def test_errors_name_the_tensor_and_every_rank_raises_a_mismatch(world):
    r, n = comm.rank(), comm.size()
    with pytest.raises(TypeError, match=r"tensors\[1\] is int64"):
        comm.adasum_allreduce([np.zeros(3), np.zeros(3, np.int64)])
    with pytest.raises(ValueError, match="no tensors"):
        comm.adasum_allreduce([])
    with pytest.raises(comm.CollectiveMismatchError, match=r"rank 1: float64 \(11,\)"):
        comm.adasum_allreduce(np.ones(11 if r == 1 else 10))
    # The same total length, split differently: each tensor's own length is agreed on.
    with pytest.raises(comm.CollectiveMismatchError, match=r"rank 0: float64 \(4, 6\)"):
        comm.adasum_allreduce([np.ones(4), np.ones(6)] if r == 0 else [np.ones(6), np.ones(4)])
    x = np.arange(8.0) * (r + 1)  # the group works on after those
    comm.adasum_allreduce(x)
    np.testing.assert_allclose(x, _tree([np.arange(8.0) * (q + 1) for q in range(n)]))
    if n == 4:  # three ranks: not a power of two (Horovod's rule)
        sub = world.split(int(r == 3))
        if r < 3:
            with pytest.raises(ValueError, match="power of two of ranks; this group has 3"):
                comm.adasum_allreduce(np.ones(4), group=sub)
        sub.close()
