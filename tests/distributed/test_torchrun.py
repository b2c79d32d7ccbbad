"""The "terrapipe" torch.distributed backend under ``torchrun --standalone``: the ranks meet over
torch's store (no MPI; comm's shared-memory segment over the store, NOTE [machines over Gloo] 9
in comm/group.py), and a plain DDP script trains as it does on Gloo."""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.torchrun import clean_env, standalone

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(tmp_path: Path, ranks: int, *command: str,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node ranks command...`` (tests/torchrun.py), which
    must succeed."""
    r = subprocess.run([*standalone(ranks, tmp_path / "torchrun"), *command], capture_output=True,
                       text=True, timeout=300, env=clean_env(**(env or {})))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


TORCHRUN_BODY = """
import torch, torch.distributed as dist
import terrapipe.distributed
from terrapipe.comm import CollectiveMismatchError
terrapipe.distributed.init_process_group()          # env:// under torchrun
r, n = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
assert pg.group.mpi is None and pg.group.shm is not None, "torchrun: shared memory over the store"
for size in (5, 4096, 300_001, 3 << 20):
    t = torch.full((size,), float(r + 1))
    works = [dist.all_reduce(t, async_op=True), dist.all_reduce(torch.ones(7), async_op=True)]
    for w in works:
        w.wait()
    assert t[0].item() == t[-1].item() == n * (n + 1) / 2
    x = torch.full((size,), float(r))
    dist.broadcast(x, src=n - 1)
    assert x[0].item() == x[-1].item() == n - 1
    out = torch.empty(n * size)
    dist.all_gather_into_tensor(out, torch.full((size,), float(r)))
    assert out.view(n, size)[:, -1].tolist() == [float(k) for k in range(n)]
try:
    dist.all_reduce(torch.zeros(3 + r))
    raise SystemExit("no mismatch error")
except CollectiveMismatchError:
    pass
torch.manual_seed(0)
net = torch.nn.Linear(8, 3)
ddp = torch.nn.parallel.DistributedDataParallel(net)
ddp(torch.randn(4, 8) + r).sum().backward()
g = [torch.empty_like(net.weight.grad) for _ in range(n)]
dist.all_gather(g, net.weight.grad)
assert all(torch.equal(g[0], h) for h in g)
assert pg.served["terrapipe"] > 10
dist.destroy_process_group()
import os
open(os.path.join(os.environ["OK_DIR"], f"rank{r}"), "w").close()
"""



# make test-full (CI time): CI runs torchrun over the store in the DDP example's test below.
@pytest.mark.full
@pytest.mark.parametrize("ranks", [2, 4])
def test_under_torchrun_over_the_store(tmp_path, ranks):
    script = tmp_path / "body.py"
    script.write_text(TORCHRUN_BODY)
    _torchrun(tmp_path, ranks, str(script), env={"OK_DIR": str(tmp_path)})
    assert sorted(p.name for p in tmp_path.glob("rank*")) == [f"rank{k}" for k in range(ranks)]


def test_example_ddp_script_under_torchrun_trains_as_on_gloo(tmp_path):
    """examples/ddp_train.py, a plain DDP script that never imports terrapipe (the backend is
    found through the ``torch.backends`` entry point), under ``torchrun --standalone`` at 2
    ranks: with backend="terrapipe" it trains to the weights it reaches on Gloo (DDP's buckets are
    pre-divided sums of two ranks' gradients, which both backends add in either order to the
    same floats), and its loss falls."""
    script = ROOT / "examples" / "ddp_train.py"
    assert "terrapipe" not in "".join(ln for ln in script.read_text().splitlines()
                                      if ln.startswith(("import", "from")))
    weights, losses = {}, {}
    for backend in ("terrapipe", "gloo"):
        out = tmp_path / f"{backend}.pt"
        r = _torchrun(tmp_path, 2, str(script), "--backend", backend, "--out", str(out))
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
        assert len(lines) == 3 and all(f"({backend}, 2 ranks)" in ln for ln in lines), r.stdout
        losses[backend] = [float(ln.split("loss ")[1].split()[0]) for ln in lines]
        weights[backend] = torch.load(out, weights_only=True)
    assert losses["terrapipe"][-1] < 0.5 * losses["terrapipe"][0], losses
    assert weights["terrapipe"].keys() == weights["gloo"].keys()
    for k, w in weights["terrapipe"].items():
        torch.testing.assert_close(w, weights["gloo"][k], rtol=1e-6, atol=1e-7, msg=k)
    torch.testing.assert_close(torch.tensor(losses["terrapipe"]), torch.tensor(losses["gloo"]),
                               rtol=1e-5, atol=0)
