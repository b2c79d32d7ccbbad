"""``out=`` for allgather and reduce_scatter: the result written into the caller's array or
tensor (any shape with the result's number of elements, as torch's ``all_gather_into_tensor``
and ``reduce_scatter_tensor`` take it), never a new one. One body over the world, a split and a
duplicate; sizes on the latency path, the segment's chunks and beyond a row; NumPy and torch,
strided outputs, async calls in a loop; against NumPy; refusals on every rank."""

import numpy as np
import pytest
import torch

import terrapipe.comm as comm

# one element; under half a row (the one-shot); several of the segment's chunks
SIZES = [1, 1000, 3 * (1 << 20) // 4 + 5]


@pytest.fixture
def groups(mpi_comm):
    world = comm.init(timeout=60)
    return {"world": world, "split": world.split(world.rank % 2), "duplicate": world.split(0)}


def _rows(g, n, dtype, seed):
    """Every rank's input of group ``g``: distinct integers, exact in every dtype here."""
    return [np.random.default_rng([seed, q]).integers(-50, 50, n).astype(dtype) for q in range(g.size)]


def _part(full: np.ndarray, g) -> np.ndarray:
    return np.array_split(full, g.size)[g.rank]


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_allgather_and_reduce_scatter_write_into_out_on_every_path(groups):
    for name, g in groups.items():
        for n in SIZES:
            for dtype in ("float32", "int64", "float16"):
                rows = _rows(g, n, dtype, n)
                x = rows[g.rank].copy()
                # NumPy, flat: the same memory comes back, filled
                out = np.full(g.size * n, -7, dtype)
                got = comm.allgather(x, out=out, group=g)
                assert got is out, (name, n, dtype)
                np.testing.assert_array_equal(out.reshape(g.size, n), np.stack(rows),
                                              err_msg=f"{name} {n} {dtype}")
                # a torch tensor stacked as (size, n), and one strided (every other element)
                t = torch.from_numpy(x)
                stacked = torch.full((g.size, n), -7, dtype=t.dtype)
                assert comm.allgather(t, out=stacked, group=g) is stacked
                assert np.array_equal(stacked.numpy(), np.stack(rows)), (name, n, dtype)
                wide = torch.full((g.size * n, 2), -7, dtype=t.dtype)
                strided = wide[:, 0]
                assert comm.allgather(t, out=strided, group=g) is strided
                assert np.array_equal(strided.numpy(), np.concatenate(rows)), (name, n, dtype)
                assert torch.all(wide[:, 1] == -7)  # the elements between were not touched
                # reduce_scatter: this rank's part of the sum
                want = _part(np.sum(np.stack(rows), 0, dtype=dtype), g)
                part = np.full(want.size, -7, dtype)
                assert comm.reduce_scatter(x, "sum", out=part, group=g) is part
                np.testing.assert_array_equal(part, want, err_msg=f"{name} {n} {dtype}")
                tpart = torch.full((want.size,), -7, dtype=t.dtype)
                assert comm.reduce_scatter(t, "sum", out=tpart, group=g) is tpart
                assert np.array_equal(tpart.numpy(), want), (name, n, dtype)
        # bfloat16, which has no NumPy view: through the general path
        xb = torch.arange(5, dtype=torch.bfloat16) + g.rank
        ob = torch.empty(g.size * 5, dtype=torch.bfloat16)
        assert comm.allgather(xb, out=ob, group=g) is ob
        assert torch.equal(ob.view(g.size, 5), torch.arange(5, dtype=torch.bfloat16) + torch.arange(
            g.size, dtype=torch.bfloat16)[:, None])


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_the_same_out_reused_in_a_loop_sync_and_async(groups):
    # 300 calls: sync and async mixed, up to 6 outstanding, each into its own reused output;
    # every value checked after its wait, and the outputs' memory is the same throughout.
    for name, g in groups.items():
        sizes = [7, 4096, 70_000, 300_000]
        outs = {n: np.empty(g.size * n, np.float32) for n in sizes}
        parts = {n: np.empty(_part(np.empty(n), g).size, np.float32) for n in sizes}
        where = {n: (outs[n].ctypes.data, parts[n].ctypes.data) for n in sizes}
        pending = []
        for i in range(300 if name == "world" else 100):
            n = sizes[i % len(sizes)]
            x = np.full(n, float(g.rank + i), np.float32)
            ag = comm.allgather(x, out=outs[n], async_op=i % 3 == 0, group=g)
            if i % 3 == 0:
                pending.append((i, n, ag))
                if len(pending) > 6:
                    j, m, h = pending.pop(0)
                    assert h.wait() is outs[m]
            else:
                assert ag is outs[n]
                assert np.array_equal(outs[n].reshape(g.size, n)[:, 0], np.arange(g.size) + i), (name, i)
            if i % 5 == 0:
                rs = comm.reduce_scatter(x, "max", out=parts[n], group=g)
                assert rs is parts[n] and np.all(parts[n] == g.size - 1 + i), (name, i)
        for _, m, h in pending:
            assert h.wait() is outs[m]
        assert where == {n: (outs[n].ctypes.data, parts[n].ctypes.data) for n in sizes}


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_an_out_that_cannot_take_the_result_is_refused_naming_it(groups):
    g = groups["world"]
    x = np.arange(10, dtype=np.float32)
    bad = {
        "wrong dtype": (np.empty(g.size * 10, np.float64), ValueError, "out must be float32 of"),
        "too few elements": (np.empty(g.size * 10 - 1, np.float32), ValueError, "out must be float32 of"),
        "a tensor for an array": (torch.empty(g.size * 10), TypeError, "out must be a numpy array"),
    }
    ro = np.empty(g.size * 10, np.float32)
    ro.flags.writeable = False
    bad["read-only"] = (ro, ValueError, "out is read-only")
    for out, err, msg in bad.values():
        with pytest.raises(err, match=f"allgather: {msg}"):
            comm.allgather(x, out=out)
    with pytest.raises(ValueError, match="reduce_scatter: out must be float32 of 5 elements"):
        comm.reduce_scatter(x, "sum", out=np.empty(6, np.float32))
    with pytest.raises(TypeError, match="out must be a tensor like x"):
        comm.reduce_scatter(torch.from_numpy(x), "sum", out=np.empty(5, np.float32))
    # the refusals before the call sent nothing, and the read-only out took part in its call on
    # every rank (NOTE [a read-only array a collective writes]): the next calls agree and are right
    np.testing.assert_array_equal(comm.allgather(x).reshape(-1), np.tile(x, g.size))


@pytest.mark.mpi(ranks=(2, 4), timeout=300, ci_ranks=(2,))  # 4: make test-full (CI time)
def test_an_input_inside_out_in_place_as_fsdp_passes_it_on_every_algorithm(groups):
    # FSDP2's all-gather passes its input as this rank's block of the output (an in-place
    # allgather); MPI refuses aliased buffers ("Buffers must not be aliased": the cluster run of
    # FSDP2 failed so before the input was copied). A reduce-scatter into the start of its own
    # input reads every part before it writes its own. Every algorithm that can take the call.
    g = groups["world"]
    pinned = g.split(0)
    for algorithm in (None, "oneshot", "segment", "single_copy", "mpi"):
        pinned.use_algorithm("allgather", algorithm)
        pinned.use_algorithm("reduce_scatter", algorithm)
        for n in (3, 1000, 300_000):
            if algorithm == "oneshot" and 4 * n * g.size > 1 << 20:
                continue  # beyond the one-shot's half row
            if algorithm in ("segment", "single_copy", "oneshot") and g.nnodes > 1:
                continue  # one node's algorithms
            rows = _rows(g, n, "float32", 7 + n)
            out = np.zeros(g.size * n, np.float32)
            mine = out[g.rank * n:(g.rank + 1) * n]
            mine[:] = rows[g.rank]
            assert comm.allgather(mine, out=out, group=pinned) is out
            np.testing.assert_array_equal(out, np.concatenate(rows), err_msg=f"{algorithm} {n}")
            t = torch.from_numpy(np.concatenate(rows))  # every rank the same: sums are exact
            part = len(_part(np.empty(g.size * n), g))
            head = t[:part]
            assert comm.reduce_scatter(t, "sum", out=head, group=pinned) is head
            want = _part(np.concatenate(rows) * g.size, g)
            assert np.array_equal(head.numpy(), want), (algorithm, n)
    pinned.close()
