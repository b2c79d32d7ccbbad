"""Elastic jobs end to end: ``terrapipe run --horovod --min-np ...`` (terrapipe/engine/elastic.py)
with workers of tests/horovod/elastic_worker.py killed, added and removed; each run checks that
every sample of an epoch was trained on once and that nothing outlived the job (processes,
shared memory, the rendezvous port)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.elastic_jobs import ROOT, epochs_covered_once, run_job, wait_for
from tests.leftovers import marked

WORKER = str(ROOT / "tests" / "horovod" / "elastic_worker.py")
TWO_HOSTS = "localhost:1,127.0.0.1:1"  # two one-slot hosts, both this machine


def _job(*flags, worker_args=(), timeout=180, during=None):
    return run_job(["--horovod", *flags], WORKER, worker_args, timeout, during)


def test_a_killed_worker_is_survived_and_no_sample_is_lost():
    code, records, err = _job("-np", "2", "--min-np", "1", "-H", TWO_HOSTS,
                              worker_args=["--kill-rank", "1", "--kill-step", "5"])
    assert code == 0, err[-3000:]
    assert "generation 2: 1 workers" in err and "exited with -9" in err, err[-3000:]
    steps = [r for r in records if "step" in r]
    assert {r["size"] for r in steps if r["generation"] == 1} == {2}
    after = [r for r in steps if r["generation"] == 2]
    assert after and {r["size"] for r in after} == {1}
    # the survivor went on from the last commit: step 5 (both ranks got through its allreduce)
    # or step 4 (rank 1 died inside it), never from the start
    assert min(r["step"] for r in after) in (5, 6)
    epochs_covered_once(records, 2, 256)
    final = [r["final"] for r in records if "final" in r]
    assert len(final) == 1 and final[0] < 0.05 * steps[0]["loss"], (final, steps[0])


@pytest.mark.full  # make test-full (CI time: the kill test above covers the failure path)
def test_too_few_workers_end_the_job_naming_why():
    code, records, err = _job("-np", "2", "--min-np", "2", "-H", TWO_HOSTS,
                              worker_args=["--kill-rank", "1", "--kill-step", "3"])
    assert code == 1, err[-3000:]
    assert "fewer than --min-np 2" in err and "127.0.0.1" in err, err[-3000:]
    assert not any("final" in r for r in records)


@pytest.mark.full
def test_workers_join_and_leave_as_discovery_says(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)

    def grow_then_shrink(proc, records):
        wait_for(records, lambda rs: len(rs) >= 5)  # the first worker trains alone for a while
        hosts.write_text("localhost:1\n127.0.0.1:1\n")
        wait_for(records, lambda rs: sum(r["size"] == 2 for r in rs) >= 10)
        hosts.write_text("127.0.0.1:1\n")

    code, records, err = _job("-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                              str(script), worker_args=["--sleep", "0.1", "--epochs", "3"],
                              during=grow_then_shrink)
    assert code == 0, err[-3000:]
    assert "slots added on ['127.0.0.1']" in err and "host localhost left" in err, err[-3000:]
    sizes = [r["size"] for r in records if "step" in r]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1, sizes
    epochs_covered_once(records, 3, 256)
    # the worker that joined started from the others' step, not from the beginning
    joined = [r for r in records if "step" in r and r["size"] == 2]
    assert joined[0]["step"] > 1


@pytest.mark.full
def test_a_failed_hosts_cooldown_passes_and_it_takes_a_worker_again():
    code, records, err = _job("-np", "2", "--min-np", "1", "-H", TWO_HOSTS, "--blacklist-cooldown-range", "1",
                              "2", worker_args=["--kill-rank", "1", "--kill-step", "5", "--sleep", "0.1",
                                                "--epochs", "4"])
    assert code == 0, err[-3000:]
    assert "host 127.0.0.1 blacklisted for" in err and "slots added on ['127.0.0.1']" in err, err[-3000:]
    sizes = [r["size"] for r in records if "step" in r]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    epochs_covered_once(records, 4, 256)


def test_the_launchers_death_stops_every_worker_and_leaves_nothing_behind():
    # NOTE [a launcher that dies] in comm/rendezvous.py: the launcher SIGKILLed (no chance to
    # stop anyone) while its workers sleep after step 3, talking to neither their peers nor the
    # store: each must notice by itself, say so, and end, leaving no process and no shared
    # memory (run_job checks both, within 10 s of the launcher's end).
    def kill_the_launcher(proc, records):
        wait_for(records, lambda rs: sum(r["step"] == 3 for r in rs) == 2)
        proc.kill()
        proc.wait()

    code, records, err = _job("-np", "2", "--min-np", "1", "-H", TWO_HOSTS, worker_args=["--hang-step", "3"],
                              during=kill_the_launcher)
    assert code == -signal.SIGKILL
    for worker in ("localhost:1", "127.0.0.1:2"):
        assert f"worker {worker}: the elastic job's launcher" in err and "is gone" in err, err[-3000:]
    assert max(r["step"] for r in records if "step" in r) == 3


@pytest.mark.full
def test_ctrl_c_stops_every_worker():
    def interrupt(proc, records):
        wait_for(records, lambda rs: len(rs) >= 4)
        os.killpg(proc.pid, signal.SIGINT)

    code, _, err = _job("-np", "2", "--min-np", "1", "-H", TWO_HOSTS, worker_args=["--sleep", "0.2"],
                        during=interrupt)
    assert code == 128 + signal.SIGINT, err[-3000:]


def test_the_launcher_refuses_what_it_cannot_do():
    def run(*flags):
        cmd = [sys.executable, "-m", "terrapipe.cli", "run", "--horovod", *flags, sys.executable, "-c", "0"]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)

    # a host whose workers cannot start (here the launch command fails) is blacklisted, and
    # the job ends naming why once fewer than --min-np are left
    r = run("-np", "1", "--min-np", "1", "-H", "elsewhere.invalid:1", "--launcher-exec", "false")
    assert r.returncode == 1 and "worker elsewhere.invalid:1 exited with 1" in r.stderr, r.stderr
    assert "fewer than --min-np 1" in r.stderr, r.stderr
    r = run("-np", "2", "--min-np", "3", "--max-np", "2", "-H", TWO_HOSTS)
    assert r.returncode != 0 and "--max-np 2 is below --min-np 3" in r.stderr
    r = run("-np", "2", "--min-np", "1")
    assert r.returncode != 0 and "--hosts or --host-discovery-script" in r.stderr


# -- Horovod's own files, unchanged (HOROVOD_SRC: a checkout of github.com/horovod/horovod) ------
HOROVOD_SRC = os.environ.get("HOROVOD_SRC")
needs_horovod_src = pytest.mark.skipif(not HOROVOD_SRC, reason="HOROVOD_SRC (a Horovod checkout) not set")


@needs_horovod_src
def test_horovods_elastic_unit_tests_pass_unchanged():
    test = Path(HOROVOD_SRC) / "test" / "single" / "test_torch_elastic.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "terrapipe" / "horovod" / "compat"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@needs_horovod_src
def test_horovods_elastic_example_survives_a_sigkill(tmp_path):
    example = Path(HOROVOD_SRC, "examples", "elastic", "pytorch", "pytorch_synthetic_benchmark_elastic.py")
    # The example builds torchvision's resnet50 by name; a small stand-in keeps it to seconds on
    # two cores (what is under test is the job surviving, not the model).
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("from . import models\n")
    (tmp_path / "torchvision" / "models.py").write_text(
        "import torch\n\n\ndef resnet50():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=4), torch.nn.ReLU(),\n"
        "        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(128, 1000))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "--horovod", "-np", "2", "--min-np", "1",
           "-H", TWO_HOSTS, sys.executable, str(example), "--batch-size", "8", "--num-iters", "12",
           "--num-batches-per-iter", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, killed_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed_at is None and line.startswith("Iter #3"):
                victims = [pid for pid in marked("TERRAPIPE_ELASTIC_WORKER=127.0.0.1")]
                assert len(victims) == 1, victims
                os.kill(victims[0], signal.SIGKILL)
                killed_at = len(lines)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    after = [x for x in lines[killed_at:] if x.startswith("Iter #")]
    assert after and "Total img/sec on 1 CPU(s)" in out, out[-3000:]
