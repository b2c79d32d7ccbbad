"""Running elastic jobs in tests (tests/horovod/test_elastic_job.py, tests/engine/test_engine_elastic.py):
``terrapipe run`` with elastic flags over a worker script whose ranks print one JSON record per
step; after the job, no process with the job's mark and no new shared-memory segment may be
left."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.leftovers import left_behind, marked, segments

ROOT = Path(__file__).resolve().parents[1]


def run_job(flags, worker, worker_args=(), timeout=180, during=None):
    """``terrapipe run <flags> python <worker> <worker_args>``; returns (exit code, the workers'
    records, stderr). ``during(proc, records)``: called once the job started, while it runs,
    with the list the records are appended to as they come."""
    mark = uuid.uuid4().hex
    # A fatal signal makes each worker print every thread's stack (what a hung job shows).
    env = dict(os.environ, ELASTIC_TEST_MARK=mark, PYTHONFAULTHANDLER="1")
    before = segments()
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", *flags, sys.executable, str(worker), *worker_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    records: list[dict] = []
    errors: list[str] = []
    readers = [threading.Thread(target=lambda: records.extend(
                   json.loads(line) for line in proc.stdout if line.startswith("{")), daemon=True),
               threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        if during is not None:
            during(proc, records)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job hung for {timeout} s; its processes' stacks:\n"
                                 + _stacks(proc, mark, errors)) from None
        for t in readers:
            t.join(10)
        err = "".join(errors)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked(mark), f"processes outlived the job: {marked(mark)}"
    assert not left_behind(before), f"shared memory left behind: {left_behind(before)}"
    return proc.returncode, records, err


def _stacks(proc, mark: str, errors: list[str]) -> str:
    """SIGABRT to every process of the job but the launcher (each prints its threads' stacks,
    PYTHONFAULTHANDLER), then the end of the job's stderr."""
    for pid in marked(mark):
        if pid != proc.pid:
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
    time.sleep(3)
    return "".join(errors)[-20000:]


def wait_for(records, what, timeout=120):
    """Until ``what(step records so far)`` is true."""
    end = time.monotonic() + timeout
    while not what([r for r in list(records) if "step" in r]):
        assert time.monotonic() < end, "the job never got there"
        time.sleep(0.05)


def epochs_covered_once(records, epochs, n):
    """Every sample of every epoch trained on exactly once, counting for each (epoch, step) the
    records of the newest generation that ran it (steps rolled back by a restore ran again)."""
    steps = [r for r in records if "step" in r]
    newest: dict[tuple[int, int], int] = {}
    for r in steps:
        key = (r["epoch"], r["step"])
        newest[key] = max(newest.get(key, 0), r["generation"])
    for e in range(epochs):
        seen = sorted(i for r in steps if r["epoch"] == e and newest[(e, r["step"])] == r["generation"]
                      for i in r["indices"])
        assert seen == list(range(n)), f"epoch {e}: {len(seen)} samples, {len(set(seen))} distinct"
