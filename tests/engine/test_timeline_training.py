"""A training run's timeline at two ranks: every layer present, valid, on one clock."""

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import terrapipe.comm as comm
from terrapipe import FastLoader, timeline
from terrapipe.engine import DistributedOptimizer, Engine, broadcast_parameters
from terrapipe.pipeline import ImageFolder, Normalize, RandomResizedCrop
from terrapipe.timeline_summary import summarize
from tests.test_timeline import check_nesting


def _jpegs(folder: Path, n: int = 48) -> None:
    g = np.random.default_rng(0)
    for k in range(n):
        label = k % 2
        (folder / f"c{label}").mkdir(parents=True, exist_ok=True)
        base = np.full((24, 32, 3), 60 + 120 * label, np.uint8)
        img = np.clip(base + g.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(folder / f"c{label}" / f"{k}.jpg", quality=90)


def _rows(events, pid, prefix):
    return {e["tid"] for e in events if e.get("name") == "thread_name" and e["pid"] == pid
            and e["args"]["name"].startswith(prefix)}


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_training_trace_has_loader_comm_and_engine_rows_on_every_rank(mpi_comm):
    folder = Path(mpi_comm.bcast(tempfile.mkdtemp() if mpi_comm.rank == 0 else None))
    if mpi_comm.rank == 0:
        _jpegs(folder / "data")
    mpi_comm.Barrier()
    path = folder / "trace.json"
    comm.init()
    timeline.start(str(path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 1024), nn.ReLU(), nn.Linear(1024, 2))
    broadcast_parameters(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model,
                               bucket_mb=0.01, first_bucket_mb=0.001)
    tf = [RandomResizedCrop(16), Normalize((0.5,) * 3, (0.25,) * 3)]
    loader = FastLoader(ImageFolder(str(folder / "data")), tf, batch_size=8, shuffle=True, num_threads=2)
    epochs = 2
    Engine(model, nn.functional.cross_entropy, opt, loader, progress=False).train(epochs)
    mpi_comm.Barrier()
    timeline.stop()
    loader.close()
    mpi_comm.Barrier()
    if mpi_comm.rank == 0:
        timeline.merge(str(path))
        events = timeline.load(str(path))
        check_nesting(events)
        for pid in (0, 1):
            mine = [e for e in events if e.get("pid") == pid and e["ph"] in "Xibe"]
            workers = _rows(events, pid, "terrapipe-loader")
            comm_threads = _rows(events, pid, "terrapipe-comm")
            on = {(e["cat"], e["name"]) for e in mine if e["ph"] == "X"}
            # loader: the consumer's wait, and read / decode / kernel per sample on the workers
            assert ("loader", "wait batch") in on
            per_sample = {e["name"] for e in mine if e["tid"] in workers and e["ph"] == "X"}
            assert {"read", "kernel"} <= per_sample and per_sample & {"decode region", "decode"}
            # comm: each bucket's allreduce on the comm thread, with its phases, issue to completion
            on_comm = {e["name"] for e in mine if e["tid"] in comm_threads and e["ph"] == "X"}
            # small buckets take the one-shot (across nodes: the one-shot across nodes);
            # the 3 MiB one agrees, then is reduced in place in the node-shared array the buckets
            # live in, in one pass (NOTE [shared arrays] 3 in comm/algorithms/shared.py), where
            # the node has several ranks
            small = ("one-shot (agreement + reduce)" if comm.world().nnodes == 1
                     else "one-shot across nodes (agreement + reduce)")
            assert {"jit_allreduce", small, "agreement"} <= on_comm, on_comm
            if comm.world().local_size > 1:
                assert {"reduce (shared)", "wait for peers"} <= on_comm, on_comm
            else:  # nodes of one rank: a ring of the whole group (NOTE [algorithm selection] 6)
                assert "ring allreduce" in on_comm, on_comm
            begins = sorted(e["id"] for e in mine if e["ph"] == "b")
            assert begins and begins == sorted(e["id"] for e in mine if e["ph"] == "e")
            # engine
            assert {("engine", n) for n in ("forward", "backward", "optimizer step")} <= on
            assert ("comm", "wait gradients") in on
            marks = [e["name"] for e in mine if e["ph"] == "i" and e["cat"] == "engine"]
            assert [m for m in marks if m.startswith("epoch")] == ["epoch 0", "epoch 1"]
        steps = summarize(events)
        assert sorted(steps) == [0, 1]
        for s in steps.values():
            assert len(s.total) == epochs * len(loader)
            f = s.fractions(skip=1)
            assert abs(sum(f.values()) - 1) < 1e-6 and min(f.values()) >= 0
        import shutil

        shutil.rmtree(folder)


@pytest.mark.mpi(ranks=(2,), timeout=120)
def test_ranks_share_one_clock_across_nodes(mpi_comm):
    """Two emulated nodes: comm.init measures each rank's offset to rank 0. Both run on this
    machine's one monotonic clock, so the measured offset must be within its own bound of 0;
    and instants each rank records as it leaves a barrier land within the bounds plus the
    barrier's exit spread (stated: 20 ms on a loaded two-core machine) at least once in five."""
    os.environ["TERRAPIPE_NODE_SIZE"] = "1"
    folder = Path(mpi_comm.bcast(tempfile.mkdtemp() if mpi_comm.rank == 0 else None))
    path = folder / "clock.json"
    g = comm.init()
    assert g.nnodes == 2
    offset, bound = comm.clock_alignment()
    if mpi_comm.rank == 0:
        assert (offset, bound) == (0, 0)
    else:
        assert abs(offset) <= bound < 5_000_000, (offset, bound)
    timeline.start(str(path))
    for k in range(5):
        comm.barrier()
        timeline.instant("engine", f"mark {k}")
    timeline.stop()
    bounds = mpi_comm.gather(bound)
    mpi_comm.Barrier()
    if mpi_comm.rank == 0:
        timeline.merge(str(path))
        events = timeline.load(str(path))
        gaps = []
        for k in range(5):
            ts = [e["ts"] for e in events if e.get("name") == f"mark {k}"]
            assert len(ts) == 2
            gaps.append(abs(ts[0] - ts[1]) * 1000)
        # A clock offset would shift every mark; a rank descheduled after one barrier shifts
        # only that one: the closest of the five must be within the bounds plus 20 ms.
        assert min(gaps) <= sum(bounds) + 20_000_000, gaps
        import shutil

        shutil.rmtree(folder)


@pytest.mark.full  # make test-full (CI time): the in-process run above covers the same events
def test_terrapipe_run_timeline_then_summary(tmp_path):
    """The user's path: `terrapipe run --timeline` (TERRAPIPE_TIMELINE in every rank, parts
    merged at the end), then `terrapipe timeline summary` with its PNG."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    trace = tmp_path / "job.json"
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "-n", "2", "--timeline", str(trace), sys.executable,
           "examples/train_synthetic.py", "--data", str(tmp_path / "data"), "--epochs", "1",
           "--per-class", "24"]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(tmp_path.glob("job.json.rank*"))
    events = json.loads(trace.read_text())
    check_nesting(events)
    assert {e["pid"] for e in events} == {0, 1}
    png = tmp_path / "summary.png"
    r = subprocess.run([sys.executable, "-m", "terrapipe.cli", "timeline", "summary", str(trace), "--json",
                        "--png", str(png)], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert sorted(summary["ranks"]) == ["0", "1"] and png.stat().st_size > 1000
    for rank in summary["ranks"].values():
        assert rank["steps"] >= 2
        assert abs(rank["data"] + rank["compute"] + rank["comm"] - 1) < 1e-6


# mpiexec and torchrun in make test-full (CI time): their ranks end the trace as terrapipe run's do.
@pytest.mark.parametrize("launcher", ["terrapipe run", pytest.param("mpiexec", marks=pytest.mark.full),
                                      pytest.param("torchrun", marks=pytest.mark.full)])
def test_the_variable_alone_ends_with_one_trace_of_every_rank(tmp_path, launcher):
    """NOTE [one trace per job] in terrapipe/timeline.py: ``TERRAPIPE_TIMELINE=job.json`` (a
    path relative to the job's folder) and no flag, under each launcher a user has, ends with
    one Chrome trace holding both ranks' loader, comm and engine events, and nothing beside it."""
    import json
    import subprocess
    import sys

    from tests.mpi_plugin import mpiexec
    from tests.torchrun import clean_env, standalone

    root = Path(__file__).resolve().parents[2]
    script = [str(root / "examples" / "train_synthetic.py"), "--data", str(tmp_path / "data"),
              "--epochs", "1", "--per-class", "16"]
    cmd = {"terrapipe run": [sys.executable, "-m", "terrapipe.cli", "run", "-n", "2", sys.executable],
           "mpiexec": [mpiexec(), "-n", "2", sys.executable],
           # torchrun's folder beside tmp_path, which must hold only what the job wrote
           "torchrun": standalone(2, tmp_path.with_name(f"{tmp_path.name}-torchrun")),
           }[launcher] + script
    env = clean_env(TERRAPIPE_TIMELINE="job.json", PYTHONPATH=str(root))
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "job.json"]  # no parts, no marks
    events = json.loads((tmp_path / "job.json").read_text())
    check_nesting(events)
    for pid in (0, 1):
        cats = {e["cat"] for e in events if e.get("pid") == pid and e["ph"] in "Xibe"}
        assert {"loader", "comm", "engine"} <= cats, (pid, cats)
    assert {e["pid"] for e in events} == {0, 1}
