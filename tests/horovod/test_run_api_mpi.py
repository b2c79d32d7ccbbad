"""``horovod.run`` through mpiexec (the first lane: these start MPI jobs, NOTE [two lanes] in
tests/lanes.py); tests/horovod/test_run_api.py has the rest, over Gloo."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from terrapipe.horovod.runner import run

ROOT = Path(__file__).resolve().parents[2]


def test_results_by_rank_through_mpiexec_as_horovods_own_test_asks():
    # Horovod's test/integration/test_interactiverun.py, test_happy_run, with use_mpi
    def fn(a, b, c, d):
        import horovod.torch as hvd  # the job's PYTHONPATH has terrapipe run --horovod's package

        hvd.init()
        rank = hvd.rank()
        res = hvd.allgather(torch.tensor([rank, a + b + c + d])).tolist()
        return res if rank == 0 else ("ret_val_of_rank_1" if rank == 1 else None)

    assert run(fn, (1, 20), {"c": 300, "d": 4000}, num_proc=3, use_mpi=True) == \
        [[0, 4321, 1, 4321, 2, 4321], "ret_val_of_rank_1", None]


@pytest.mark.full  # make test-full (CI time): CI fails a rank over Gloo (test_run_api.py)
def test_a_failing_rank_stops_the_mpi_job_and_is_named():
    def fn():
        import horovod.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise RuntimeError("rank 1 gives up")
        time.sleep(120)

    start = time.monotonic()
    words = r"mpirun failed with exit code 1: rank 1: RuntimeError: rank 1 gives up"
    with pytest.raises(RuntimeError, match=words):
        run(fn, num_proc=2)
    assert time.monotonic() - start < 60


@pytest.mark.full  # make test-full (CI time): one job inside another
def test_a_driver_that_is_itself_a_rank_starts_a_job_of_its_own(tmp_path):
    # horovod.run from a script under `terrapipe run --horovod -np 1` (how `import horovod`
    # resolves for a plain Horovod driver): the enclosing job's variables stay behind.
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import os
        import horovod

        def fn(x):
            import horovod.torch as hvd
            hvd.init()
            return hvd.rank(), hvd.size(), x * 2

        if __name__ == "__main__":
            print("RESULT", horovod.run(fn, args=(21,), num_proc=2), flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    for launcher in ([], ["--gloo"]):
        cmd = [sys.executable, "-m", "terrapipe.cli", "run", "--horovod", *launcher, "-np", "1",
               sys.executable, str(driver)]
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "RESULT [(0, 2, 42), (1, 2, 42)]" in p.stdout, p.stdout


HOROVOD_SRC = os.environ.get("HOROVOD_SRC")


@pytest.mark.skipif(not HOROVOD_SRC, reason="HOROVOD_SRC (a Horovod checkout) not set")
def test_horovods_interactive_run_tests_pass_unchanged():
    # Horovod's test/integration/test_interactiverun.py: run() over Gloo and MPI (here, in
    # the lane that starts MPI jobs: NOTE [two lanes] in tests/lanes.py), a failing rank
    # named, and an elastic command job from a _HorovodArgs built by hand (make horovod-suite).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    test = os.path.join(HOROVOD_SRC, "test", "integration", "test_interactiverun.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(root, "terrapipe", "horovod", "compat"), root, os.path.join(HOROVOD_SRC, "test"),
         os.path.join(HOROVOD_SRC, "test", "utils")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=root,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
