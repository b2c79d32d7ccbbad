"""terrapipe.comm under torchrun on one machine: the same collectives and errors over the
machine's segment, which the world has there (NOTE [machines over Gloo] 9 in comm/group.py), and
over Gloo's own (every collective pinned to it: what the world ran before, and what a group whose
ranks span machines of unequal counts still runs)."""

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.torchrun import clean_env, standalone

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np, torch
    import terrapipe.comm as comm

    g = comm.init(timeout=float(sys.argv[1]))
    assert g.gloo is not None and g.shm is not None and g.mpi is None, g.transport
    assert g.transport is g.shm and (g.local_size, g.nnodes) == (g.size, 1)
    if sys.argv[4] == "gloo":
        for coll in ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter",
                     "reduce_scatter", "barrier"):
            g.use_algorithm(coll, "gloo")
    log = g.record_algorithms()
    r, n = comm.rank(), comm.size()
    if sys.argv[2] == "timeout":
        import os
        mark = os.path.join(sys.argv[3], "timed_out")
        if r == 0:
            try:
                comm.allreduce(np.zeros(10))
            except comm.CollectiveTimeoutError as e:
                assert e.ranks == [1] and "waiting for rank 1" in str(e), (e.ranks, str(e))
                print("TIMEOUT OK", e, flush=True)
            finally:
                open(mark, "w").close()
        else:  # absent until rank 0's 3 s timeout has passed, however slow the machine
            deadline = time.monotonic() + 120
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.05)
        sys.exit(0)
    for dtype in (np.float32, np.float64, np.int64):
        for op, ref in (("sum", n * (n + 1) / 2), ("max", n), ("min", 1), ("avg", (n + 1) / 2)):
            x = np.full(1001, r + 1, dtype)
            comm.allreduce(x, op)
            want = np.floor(ref) if (op == "avg" and dtype == np.int64) else ref
            assert np.all(x == want), (dtype, op, x[:3])
    bf = torch.full((300,), float(r + 1), dtype=torch.bfloat16)
    comm.allreduce(bf, "sum")
    assert torch.all(bf == n * (n + 1) / 2)
    ts = [torch.full((5,), float(r)), torch.full((3, 3), 2.0)]
    comm.jit_allreduce(ts, compression="bf16")
    assert torch.equal(ts[0], torch.full((5,), (n - 1) / 2)) and torch.equal(ts[1], torch.full((3, 3), 2.0))
    b = np.arange(5.0) if r == n - 1 else np.zeros(5)
    comm.broadcast(b, n - 1)
    assert np.all(b == np.arange(5.0))
    assert comm.allgather(np.array([r])).ravel().tolist() == list(range(n))
    part = comm.reduce_scatter(np.arange(7.0))
    assert part.tolist() == np.array_split(np.arange(7.0) * n, n)[r].tolist()
    h = comm.allreduce(np.ones(4), async_op=True)
    assert h.wait().tolist() == [n] * 4
    try:
        comm.allreduce(np.zeros(2 + r))
        raise AssertionError("no mismatch raised")
    except comm.CollectiveMismatchError as e:
        assert "rank 0: float64 (2,)" in str(e) and "rank 1: float64 (3,)" in str(e)
    sub = g.split(r % 2)
    y = np.ones(3)
    comm.allreduce(y, group=sub)
    assert np.all(y == sub.size)
    ways = {a for _, a, _ in log}
    assert ways == {"gloo"} if sys.argv[4] == "gloo" else "gloo" not in ways, ways
    open(f"{sys.argv[3]}/rank{r}.ok", "w").close()
    """
)


def _torchrun(tmp_path: Path, n: int, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run([*standalone(n, tmp_path / "torchrun"), str(script), *args],
                          capture_output=True, text=True, timeout=240, env=clean_env())


@pytest.mark.parametrize("way", ["segment", "gloo"])
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.full)])  # 4: make test-full (CI time)
def test_collectives_under_torchrun(tmp_path, n, way):
    out = _torchrun(tmp_path, n, "60", "all", str(tmp_path), way)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == [f"rank{r}.ok" for r in range(n)]


def test_missing_rank_times_out_under_torchrun(tmp_path):
    out = _torchrun(tmp_path, 2, "3", "timeout", str(tmp_path), "segment")
    assert "TIMEOUT OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
