"""A rank killed with SIGKILL never leaves the others hanging, and no segment outlives a job."""

import os
import subprocess
import sys
import textwrap
import time

from terrapipe import launch_env
from tests.leftovers import left_behind, segments
from tests.mpi_plugin import mpiexec

KILLED = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    import terrapipe.comm as comm
    comm.init(timeout=60)
    x = np.ones(1 << 20, np.float32)
    comm.allreduce(x)
    if comm.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            comm.allreduce(x)
    except comm.CollectiveTimeoutError as e:
        print("RANK0 SAW:", e, flush=True)
        sys.exit(3)
    """
)


REPORTING = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import terrapipe.comm as comm
    from terrapipe.comm import collectives

    comm.init(timeout=2)
    abort = collectives._abort

    def traced_abort(MPI):  # when rank 0's exit hook ends the job
        with open(sys.argv[1] + ".abort", "w") as f:
            f.write(repr(time.time()))
        abort(MPI)

    collectives._abort = traced_abort
    x = np.ones(1024, np.float32)
    if comm.rank() == 0:
        try:
            comm.allreduce(x)  # rank 1 never joins: a timeout, kept as the process's failure
        except comm.CollectiveTimeoutError:
            pass
        sys.exit(0)  # at once: the exit hook ends the job with MPI_Abort
    time.sleep(4)  # still busy with its own report when rank 0 leaves
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    """
)


def test_kill_9_of_one_rank_ends_the_job_promptly(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    before = segments()
    start, wall = time.monotonic(), time.time()
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - start
    # Plain mpiexec, no terrapipe run: MPICH's node file of the killed job is this test's to sweep.
    launch_env.remove_orphaned_mpi_files(wall)
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f}s: {proc.stdout}{proc.stderr}"
    # Either the launcher tears the job down, or the survivor sees the death on the board.
    assert "RANK0 SAW" not in proc.stdout or "rank 1 (pid" in proc.stdout
    assert not left_behind(before)  # the segment was unlinked right after mapping


def test_the_exit_hook_lets_a_node_peer_finish_before_it_ends_the_job(tmp_path):
    """NOTE [collective ordering] 7, a regression test: rank 0's MPI_Abort at exit killed its
    node peer while that one was still writing its own report (1 run in 5 of the cluster's
    link-down test lost a report)."""
    script, report = tmp_path / "reporting.py", tmp_path / "report"
    script.write_text(REPORTING)
    wall = time.time()
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(report)],
                          capture_output=True, text=True, timeout=120)
    launch_env.remove_orphaned_mpi_files(wall)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out  # the job was still aborted
    reported = float(report.read_text())
    aborted = float((tmp_path / "report.abort").read_text())
    assert aborted >= reported, f"rank 0 aborted {reported - aborted:.1f}s before rank 1 reported: {out}"


def test_stale_segments_of_dead_jobs_are_removed_at_init(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/terrapipe_{os.getuid()}_{dead.pid}_1"
    live = f"/dev/shm/terrapipe_{os.getuid()}_{os.getpid()}_999"
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"\\0" * 4096)
    try:
        code = "import terrapipe.comm as c; c.init(); print(c.size())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("PMI")})
        assert out.stdout.strip() == "1"
        assert not os.path.exists(stale)
        assert os.path.exists(live)  # its creator (this process) is alive
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_board_names_a_dead_peer_without_waiting_for_the_timeout():
    import numpy as np
    import pytest

    from terrapipe.comm import CollectiveTimeoutError
    from terrapipe.comm.transports.board import Board

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    words = np.zeros(Board.nbytes(3) // 8, np.int64)
    peers = [Board(words, 3, i, [10, 11, 12]) for i in range(3)]
    peers[1].pids[1] = dead.pid  # local rank 1 (world rank 11) died before arriving
    peers[2].publish()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=f"rank 11 \\(pid {dead.pid}\\) died") as e:
        peers[0].barrier(timeout=60, what="allreduce")
    assert e.value.ranks == [11] and time.monotonic() - start < 10
    peers[1].pids[1] = os.getpid()  # alive but absent: a timeout naming it
    with pytest.raises(CollectiveTimeoutError, match="Timed out after 0.2s waiting for rank 11"):
        peers[0].wait(peers[0].step, timeout=0.2, what="allreduce")
