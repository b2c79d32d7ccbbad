"""Run the suite as two pytest processes side by side, one per core (``make test``).

    python -m tests.lanes -m "not full" --durations=20

NOTE [two lanes]

  1. The suite alone keeps 1.4 of two cores busy: its multi-rank jobs wait on each other, on
     timeouts they test and on emulated links, and the kernel and loader tests compile and
     decode on one core. So the tests that start no MPI process (``LANE``: the kernel and
     loader tests, and the jobs launched by torchrun, by a store, by ``terrapipe run``'s
     elastic mode or by ``horovod.run(use_gloo=True)``, all over Gloo and shared memory) run
     in a second pytest process beside the rest, about half the suite's time each.
  2. Why the lanes cannot disturb each other. Only the first lane starts MPI jobs, so only its
     own jobs make MPICH's and hydra's files, which its tests count and sweep
     (``launch_env.remove_orphaned_mpi_files``) as no other program's. terrapipe's
     shared-memory files carry their creator's pid, and the tests that look for leftovers
     count only files of their own processes or of dead ones (tests/leftovers.py); a live
     group's files are unlinked once its ranks mapped them. Thread checks are per process.
     ``tests/test_lanes.py`` refuses a test module in ``LANE`` that names an MPI job.
  3. The first lane prints as it runs; the second lane's report follows it, whole. The run
     fails if either lane fails. A lane that selects no test (``-k`` narrowing to the other
     lane's tests) is not a failure unless neither selects any (pytest's exit code 5).
  4. Both lanes are in the caller's process group, so Ctrl-C reaches each pytest, which stops
     as it would alone; a SIGINT sent to this process only is passed on to both. Neither lane
     outlives this process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

# clause 1: the compiled kernels and the loader, then the jobs that meet without MPI
LANE = ("tests/kernels", "tests/pipeline",
        "tests/comm/test_rendezvous.py", "tests/comm/test_torch_backend.py",
        "tests/distributed/test_torchrun.py",
        "tests/distributed/test_torchrun_restarts.py", "tests/horovod/test_elastic_job.py",
        "tests/horovod/test_run_api.py",
        "tests/test_layers.py", "tests/test_settings.py", "tests/test_timeline.py")
_NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def _wait(*procs: subprocess.Popen) -> None:
    """Wait for every process; on Ctrl-C pass SIGINT on to those still running and go on
    waiting (clause 4)."""
    while True:
        try:
            for p in procs:
                p.wait()
            return
        except KeyboardInterrupt:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", *argv]
    with tempfile.TemporaryFile() as log:
        second = subprocess.Popen([*pytest, *LANE], stdout=log, stderr=subprocess.STDOUT)
        try:
            first = subprocess.Popen([*pytest, *(f"--ignore={path}" for path in LANE)])
        except BaseException:
            second.send_signal(signal.SIGINT)
            _wait(second)
            raise
        _wait(first, second)
        sys.stdout.flush()
        log.seek(0)
        print(f"===== the second lane: {' '.join(LANE)}", flush=True)
        sys.stdout.buffer.write(log.read())
        sys.stdout.flush()
    return exit_code(first.returncode, second.returncode)


def exit_code(first: int, second: int) -> int:
    """The run's exit status from its lanes' (clause 3): the first lane's failure, else the
    second's; 0 where one lane selected no test and the other passed; 5 where neither
    selected any."""
    if {first, second} <= {0, _NO_TESTS}:
        return _NO_TESTS if first == second == _NO_TESTS else 0
    return first if first not in (0, _NO_TESTS) else second


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
