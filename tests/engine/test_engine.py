"""Engine: hook order, metrics averaged across ranks, rank-0 checkpoints resumed everywhere."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import terrapipe.comm as comm
from terrapipe import FastLoader
from terrapipe.engine import HOOKS, CheckpointError, DistributedOptimizer, Engine, broadcast_parameters
from terrapipe.pipeline import ArrayDataset, Normalize

ROOT = Path(__file__).resolve().parents[2]


def _data(n, seed):
    """4 classes told apart by which colour channel dominates (plus noise): learnable in a few
    epochs by a linear model."""
    g = np.random.default_rng(seed)
    labels = g.integers(0, 4, n)
    base = np.full((n, 8, 8, 3), 100.0)
    for c in range(3):
        base[labels == c, :, :, c] += 90
    imgs = np.clip(base + g.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
    return ArrayDataset(imgs, labels)


def _engine(ckpt, epochs_done=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    broadcast_parameters(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    tf = [Normalize((0.5,) * 3, (0.25,) * 3)]
    train = FastLoader(_data(256, 0), tf, batch_size=16, shuffle=True)
    val = FastLoader(_data(64, 1), tf, batch_size=32)
    return Engine(model, nn.functional.cross_entropy, opt, train, val, checkpoint_dir=ckpt, progress=False)


@pytest.mark.mpi(ranks=(1, 2), timeout=240)
def test_hooks_metrics_checkpoints_and_resume(mpi_comm):
    comm.init(timeout=60)
    ckpt = Path(comm.broadcast_object(tempfile.mkdtemp() if comm.rank() == 0 else None))
    engine = _engine(ckpt)
    assert engine.train_loader.world_size == comm.size()  # sharded by the world it joined
    calls = []
    for name in HOOKS:
        engine.hooks[name] = lambda state, name=name: calls.append((name, state["epoch"]))
    history = engine.train(epochs=2)
    steps = len(engine.train_loader)
    assert [c for c, _ in calls].count("on_update") == 2 * steps
    assert calls[0] == ("on_start", 0) and calls[-1] == ("on_end", 1)
    first_batch = [c for c, _ in calls[1:5]]
    assert first_batch == ["on_batch", "on_forward", "on_backward", "on_update"]
    assert [e for c, e in calls if c == "on_epoch_end"] == [0, 1]
    assert len(history) == 2 and history[-1]["val_accuracy"] > 0.6  # chance is 0.25
    assert history[-1]["train_samples"] == 256 + (256 % comm.size())
    # Every rank reports the same, rank-averaged metrics.
    losses = comm.allgather(np.array([history[-1]["train_loss"], history[-1]["val_loss"]]))
    assert np.all(losses == losses[0])
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch0000.pt", "epoch0001.pt"]  # no .tmp
    # A new engine resumes after the last checkpoint on every rank: only epoch 2 runs.
    again = _engine(ckpt)
    starts = []
    again.hooks["on_start"] = lambda state: starts.append(state["epoch"])
    history = again.train(epochs=3)
    assert starts == [2] and [m["epoch"] for m in history] == [0, 1, 2]
    saved = torch.load(ckpt / "epoch0002.pt", weights_only=True)  # nothing but tensors and containers
    for k, v in again.model.state_dict().items():
        assert torch.equal(saved["model"][k], v)
    assert saved["loader"]["epoch"] == 2


def test_unknown_hook_name_is_rejected(tmp_path):
    engine = _engine(None)
    engine.hooks["on_batch_end"] = lambda state: None
    engine.hooks["on_start"] = lambda state: engine._hook("on_batch_end", state)
    with pytest.raises(ValueError, match="unknown hook 'on_batch_end'"):
        engine.train(1)


def test_example_trains_at_two_ranks_well_above_chance(tmp_path):
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "-n", "2", sys.executable,
           str(ROOT / "examples" / "train_synthetic.py"), "--data", str(tmp_path / "data"),
           "--epochs", "4", "--per-class", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    accs = [float(a) for a in re.findall(r"val loss [\d.]+ acc ([\d.]+)", out.stdout)]
    assert len(accs) == 4 and accs[-1] > 0.5, out.stdout


def test_amp_on_cpu_trains_in_bfloat16_autocast():
    engine = _engine(None)
    engine.amp = True
    seen = []
    engine.hooks["on_forward"] = lambda state: seen.append(state["output"].dtype)
    history = engine.train(epochs=2)
    assert set(seen) == {torch.bfloat16}  # the linear layer ran under autocast
    assert np.isfinite(history[-1]["train_loss"]) and history[-1]["val_accuracy"] > 0.5


@pytest.mark.full  # make test-full: CI time (examples/ddp_train.py covers torchrun in make test)
def test_example_runs_unchanged_under_torchrun(tmp_path):
    from tests.torchrun import clean_env, standalone

    cmd = [*standalone(2, tmp_path / "torchrun"), str(ROOT / "examples" / "train_synthetic.py"),
           "--data", str(tmp_path / "data"), "--epochs", "4", "--per-class", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert out.returncode == 0, out.stderr[-3000:]
    accs = [float(a) for a in re.findall(r"val loss [\d.]+ acc ([\d.]+)", out.stdout)]
    assert len(accs) == 4 and accs[-1] > 0.5 and "over 2 ranks" in out.stdout


class _Marker:
    """Unpickling this creates a file: what a tampered checkpoint would do with a real payload."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_tampered_checkpoint_is_refused_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "code-ran"
    engine = _engine(ckpt)
    payload = {"epoch": 0, "model": engine.model.state_dict(), "optimizer": {}, "loader": None,
               "history": [], "extra": _Marker(marker)}
    torch.save(payload, ckpt / "epoch0000.pt")
    with pytest.raises(CheckpointError, match=r"epoch0000\.pt: refused to load it"):
        engine.train(epochs=2)
    assert not marker.exists()  # nothing in the file ran
    torch.save({"weights": torch.zeros(3)}, ckpt / "epoch0001.pt")  # loadable, but not a checkpoint
    with pytest.raises(CheckpointError, match=r"epoch0001\.pt: not an Engine checkpoint"):
        _engine(ckpt).train(epochs=3)


class _Poisonable(nn.Module):
    """A linear classifier whose output becomes inf on demand (an fp16 overflow on one rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3 * 8 * 8, 4)
        self.poison = False

    def forward(self, x):
        y = self.lin(x.flatten(1))
        return y * float("inf") if self.poison else y


@pytest.mark.mpi(ranks=(1, 2), timeout=240)
def test_float16_amp_skips_a_step_with_an_inf_on_one_rank_everywhere(mpi_comm):
    # GradScaler on CPU (float16 autocast): average, unscale, step, in that order. Before, the
    # scaler unscaled gradients still being reduced, and a skipped step left reductions pending
    # (the next zero_grad raised).
    comm.init(timeout=60)
    torch.manual_seed(0)
    model = _Poisonable()
    broadcast_parameters(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, bucket_mb=1e-4)
    train = FastLoader(_data(256, 0), [Normalize((0.5,) * 3, (0.25,) * 3)], batch_size=16, shuffle=True)
    engine = Engine(model, nn.functional.cross_entropy, opt, train, progress=False, amp=True,
                    amp_dtype=torch.float16)
    assert engine._scaler is not None
    before, scales = {}, []
    bad_step = 3

    def on_batch(state):
        model.poison = comm.rank() == comm.size() - 1 and state["step"] == bad_step
        before[state["step"]] = [p.detach().clone() for p in model.parameters()]
        scales.append(engine._scaler.get_scale())

    engine.hooks["on_batch"] = on_batch
    history = engine.train(epochs=2)
    # The poisoned step changed no parameter on any rank, and the scale backed off everywhere.
    after_bad = before[bad_step + 1]
    assert all(torch.equal(a, b) for a, b in zip(before[bad_step], after_bad, strict=True))
    assert scales[bad_step + 1] == scales[bad_step] * 0.5
    assert not opt.gradients.in_flight()
    assert np.isfinite(history[-1]["train_loss"])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = comm.allgather(flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # every rank took the same steps


def test_jit_allreduce_is_a_top_level_name():
    from terrapipe import jit_allreduce

    assert jit_allreduce is comm.jit_allreduce
