"""The multi-rank harness itself: real ranks, real failures, real hangs."""

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


def _inner_project(pytester, body: str):
    pytester.makeconftest('pytest_plugins = ["tests.mpi_plugin"]\n')
    pytester.makepyfile(test_inner=textwrap.dedent(body))


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
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 0 of 2 never reported (timed out after 8s)" in out
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
