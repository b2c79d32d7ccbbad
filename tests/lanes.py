"""Run the suite as two pytest processes side by side, one per core (``make test``).

    python -m tests.lanes -m "not full" --durations=20

NOTE [two lanes]

  1. The suite alone keeps 1.4 of two cores busy: its multi-rank jobs wait on each other, on
     timeouts they test and on emulated links, and the kernel and loader tests compile and
     decode on one core. So the kernel and loader tests (``LANE``) run in a second pytest
     process beside the rest: they use no MPI and touch nothing outside their own process
     that the rest looks at (their shared-memory files carry their own pid or prefix, their
     thread checks are per process), and nothing in the rest looks at theirs.
  2. The first lane prints as it runs; the second lane's report follows it, whole. The run
     fails if either lane fails. A lane that selects no test (``-k`` narrowing to the other
     lane's tests) is not a failure unless neither selects any (pytest's exit code 5).
  3. Both lanes are in the caller's process group, so Ctrl-C reaches each pytest, which stops
     as it would alone; a SIGINT sent to this process only is passed on to both. Neither lane
     outlives this process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

LANE = ("tests/kernels", "tests/pipeline")  # clause 1
_NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def _wait(*procs: subprocess.Popen) -> None:
    """Wait for every process; on Ctrl-C pass SIGINT on to those still running and go on
    waiting (clause 3)."""
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
    """The run's exit status from its lanes' (clause 2): the first lane's failure, else the
    second's; 0 where one lane selected no test and the other passed; 5 where neither
    selected any."""
    if {first, second} <= {0, _NO_TESTS}:
        return _NO_TESTS if first == second == _NO_TESTS else 0
    return first if first not in (0, _NO_TESTS) else second


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
