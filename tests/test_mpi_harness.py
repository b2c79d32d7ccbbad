"""The multi-rank harness itself: real ranks, real failures, real hangs."""

import glob
import textwrap

import numpy as np
import pytest

pytest_plugins = ["pytester"]


@pytest.mark.mpi(ranks=(1, 2, 4), ci_ranks=(1, 2, 4))
def test_every_rank_runs_the_body(mpi_comm):
    # Each rank contributes its rank; a sum over ranks proves they all ran in one job.
    total = np.zeros(1, np.int64)
    mpi_comm.Allreduce(np.array([mpi_comm.rank + 1], np.int64), total)
    n = mpi_comm.size
    assert total[0] == n * (n + 1) // 2


def _inner_project(pytester, body: str, **more: str):
    """A project of ``test_inner.py`` (``body``) and a module per keyword (name: its body)."""
    pytester.makeconftest('pytest_plugins = ["tests.mpi_plugin"]\n')
    pytester.makepyfile(test_inner=textwrap.dedent(body), **{k: textwrap.dedent(v) for k, v in more.items()})


def _run(pytester, monkeypatch, *args):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", str(root))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_failing_rank_traceback_is_shown(pytester, monkeypatch):
    _inner_project(
        pytester,
        """
        import pytest

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_one_rank_fails(mpi_comm):
            assert mpi_comm.rank != 1, "deliberate failure on rank one"
        """,
    )
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 1 of 2 failed" in out
    assert "deliberate failure on rank one" in out
    assert "rank 0 of 2 failed" not in out


@pytest.mark.full  # make test-full: a check of the test harness itself, not of terrapipe (CI time)
def test_hung_rank_is_named_and_killed(pytester, monkeypatch):
    _inner_project(
        pytester,
        """
        import time
        import pytest

        @pytest.mark.mpi(ranks=(2,), timeout=8)
        def test_rank_hangs(mpi_comm):
            if mpi_comm.rank == 0:
                time.sleep(600)
        """,
    )
    files = ("/dev/shm/mpich_shm_*", "/tmp/hydra_hwloc_xmlfile_*")
    before = {pattern: set(glob.glob(pattern)) for pattern in files}
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 0 of 2 never reported (timed out after 8s)" in out
    # The killed job's ranks never reached MPI_Finalize and its proxy was killed: MPICH's node
    # file and hydra's topology file are removed for them.
    for pattern in files:
        assert set(glob.glob(pattern)) <= before[pattern], pattern
    assert "rank 1 of 2" not in out.split("never reported")[0].splitlines()[-1]


def test_crashed_rank_is_named(pytester, monkeypatch):
    _inner_project(
        pytester,
        """
        import os
        import pytest

        @pytest.mark.mpi(ranks=(2,), timeout=30)
        def test_rank_dies(mpi_comm):
            if mpi_comm.rank == 1:
                os._exit(3)
            mpi_comm.Barrier()
        """,
    )
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(failed=1)
    assert "rank 1 of 2 never reported" in result.stdout.str()


def test_skip_on_every_rank_skips_and_on_one_rank_fails(pytester, monkeypatch):
    # Regression: a condition only the ranks can see (a GPU per rank) skipped on every rank,
    # and the harness reported that as a failure.
    _inner_project(
        pytester,
        """
        import pytest

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_all_skip(mpi_comm):
            pytest.skip("needs a widget per rank")

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_one_skips(mpi_comm):
            if mpi_comm.rank == 1:
                pytest.skip("rank one has no widget")
        """,
    )
    result = _run(pytester, monkeypatch, "-rs")
    result.assert_outcomes(skipped=1, failed=1)
    out = result.stdout.str()
    assert "SKIPPED" in out and "needs a widget per rank" in out
    assert "rank 1 of 2 skipped" in out and "rank one has no widget" in out


@pytest.mark.full  # make test-full: a check of the test harness itself, not of terrapipe (CI time)
def test_modules_share_one_job_and_a_broken_test_breaks_only_itself(pytester, monkeypatch):
    # NOTE [one job per rank count] in tests/mpi_plugin.py: every test at one rank count runs in
    # the same rank processes, across modules, one at a time; a test of its own job (clause 5)
    # leaves that job running; a hang, a crash or a one-rank failure ends it, and the next test
    # gets a new one. The bodies record their pids to show which is which.
    record = """
        import os, time
        import pytest

        def record(mpi_comm, name):
            with open(f"{os.environ['PIDS_DIR']}/{name}.{mpi_comm.rank}", "w") as f:
                f.write(str(os.getpid()))
        """
    _inner_project(
        pytester,
        record + """
        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_a_first(mpi_comm):
            record(mpi_comm, "a")

        @pytest.mark.mpi(ranks=(2,), timeout=60, own_job=True)
        def test_a_own_job(mpi_comm):
            record(mpi_comm, "own")

        def test_a_single_process():
            time.sleep(1.5)  # past a held rank's first second (clause 1)
        """,
        test_inner_b=record + """
        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_b_second(mpi_comm):
            record(mpi_comm, "b")
            mpi_comm.Barrier()

        @pytest.mark.skipif(True, reason="skipped by the parent")
        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_c_skipped_in_the_parent(mpi_comm):
            raise AssertionError("a test the parent skipped ran")

        @pytest.mark.mpi(ranks=(2,), timeout=6)
        def test_d_hangs(mpi_comm):
            record(mpi_comm, "d")
            if mpi_comm.rank == 0:
                time.sleep(600)

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_e_fails_on_one_rank_while_the_other_waits(mpi_comm):
            record(mpi_comm, "e")
            assert mpi_comm.rank == 0, "deliberate failure on rank one"
            mpi_comm.Barrier()

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_f_after_the_failures(mpi_comm):
            record(mpi_comm, "f")
            mpi_comm.Barrier()
        """,
    )
    pids = pytester.mkdir("pids")
    monkeypatch.setenv("PIDS_DIR", str(pids))
    monkeypatch.setenv("TERRAPIPE_TEST_MPI_FAILED_GRACE", "3")
    result = _run(pytester, monkeypatch, "-rs")
    result.assert_outcomes(passed=5, failed=2, skipped=1)
    out = result.stdout.str()
    assert "rank 0 of 2 never reported (timed out after 6s)" in out
    assert "rank 1 of 2 failed" in out and "deliberate failure on rank one" in out
    assert "rank 0 of 2 never reported (still running 3s after another rank failed)" in out
    pid = {p.name: p.read_text() for p in pids.iterdir()}
    assert pid["a.0"] == pid["b.0"] == pid["d.0"] and pid["a.1"] == pid["b.1"] == pid["d.1"]  # across modules
    assert pid["own.0"] not in (pid["a.0"], pid["b.0"])
    assert len({pid["d.0"], pid["e.0"], pid["f.0"]}) == 3  # a new job after each broken one
    assert len({pid["a.0"], pid["a.1"]}) == 2


@pytest.mark.full  # make test-full: a check of the test harness itself, not of terrapipe (CI time)
def test_each_test_starts_without_the_last_ones_world(pytester, monkeypatch):
    # Clause 2: a test that leaves terrapipe.comm initialised (with its timeout), Horovod running
    # or a variable set does not hand them to the next test of its job.
    _inner_project(
        pytester,
        """
        import os
        import pytest
        import terrapipe.comm as comm
        import terrapipe.horovod.basics as hvd

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_leaves_everything_up(mpi_comm):
            os.environ["TERRAPIPE_NODE_SIZE"] = "1"  # read by comm.init: emulates two nodes
            comm.init(timeout=7)
            hvd.init()
            assert comm.is_initialized() and hvd.is_initialized()

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_finds_nothing_up(mpi_comm):
            assert not comm.is_initialized() and not hvd.is_initialized()
            assert "TERRAPIPE_NODE_SIZE" not in os.environ
            g = comm.init(timeout=9)
            assert g.timeout == 9 and g.nnodes == 1
        """,
    )
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=2)


@pytest.mark.full  # make test-full: a check of the test harness itself, not of terrapipe (CI time)
def test_a_rank_that_cannot_exit_fails_the_jobs_last_test(pytester, monkeypatch):
    # Clause 4: a thread left running keeps a rank from exiting; the job's last test says so.
    _inner_project(
        pytester,
        """
        import threading, time
        import pytest

        @pytest.mark.mpi(ranks=(2,), timeout=60)
        def test_leaves_a_thread(mpi_comm):
            threading.Thread(target=time.sleep, args=(600,)).start()
        """,
    )
    monkeypatch.setenv("TERRAPIPE_TEST_MPI_EXIT_TIMEOUT", "5")
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(failed=1)
    assert "mpiexec did not exit within 5s after every rank passed its last test" in \
        result.stdout.str()
