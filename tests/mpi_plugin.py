"""Run a test body at several rank counts under ``mpiexec``, the way mpi4py's suite runs.

    @pytest.mark.mpi(ranks=(1, 2, 4), timeout=120)
    def test_allreduce(mpi_comm):
        ...

The test is parametrized over ``ranks``. At 1 rank it runs in the pytest process. At N > 1 the
pytest process launches ``mpiexec -n N python -m pytest <that one test>``; every rank runs the
body, writes its own report, and the parent fails with the traceback of each failing rank
(``rank 1 of 2 failed: ...``), or names the ranks that never reported (crashed or hung) once the
timeout passes, after killing the whole job. No orphaned ranks survive a parent that times out.

The ``mpi_comm`` fixture is ``MPI.COMM_WORLD`` of the rank running the body.

Rank counts above 2 are marked ``full`` (``make test-full``; ``make test`` deselects them to
keep CI within its budget on two cores) unless the test names them in ``ci_ranks``: the load
and topology tests do, so every ``make test`` still runs the comm core under load at 4 ranks.

    @pytest.mark.mpi(ranks=(2, 4), ci_ranks=(2, 4))
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from terrapipe import launch_env

_CHILD_ENV = "TERRAPIPE_TEST_MPI_CHILD"  # set in every rank: the report directory
_DEFAULT_TIMEOUT = 120.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mpi(ranks=(1, 2), timeout=120, ci_ranks=None): run the test body under mpiexec at each "
        "rank count",
    )
    config.addinivalue_line(
        "markers", "full: runs in `make test-full` only (a rank count above 2 not in ci_ranks)")


def _marker_ranks(marker: pytest.Mark) -> tuple[int, ...]:
    ranks = marker.kwargs.get("ranks", marker.args[0] if marker.args else (1, 2))
    if isinstance(ranks, int):
        ranks = (ranks,)
    return tuple(int(r) for r in ranks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("mpi")
    if marker is None:
        return
    ranks = _marker_ranks(marker)
    ci = marker.kwargs.get("ci_ranks")
    ci = tuple(r for r in ranks if r <= 2) if ci is None else tuple(int(r) for r in ci)
    metafunc.fixturenames.append("_mpi_ranks")
    metafunc.parametrize("_mpi_ranks", [
        pytest.param(n, id=f"np{n}", marks=() if n in ci else (pytest.mark.full,)) for n in ranks])


def mpiexec() -> str:
    """The mpiexec beside this interpreter (the MPI wheel's), else the one on PATH."""
    found = launch_env.mpiexec_path()
    if found is None:
        raise RuntimeError("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    return found


def _run_ranks(item: pytest.Item, nranks: int, timeout: float) -> None:
    report_dir = Path(tempfile.mkdtemp(prefix="terrapipe-mpitest-"))
    try:
        env = dict(os.environ)
        env[_CHILD_ENV] = str(report_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [
            mpiexec(), "-n", str(nranks),
            sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "--rootdir", str(item.config.rootpath), item.nodeid,
        ]
        # A new session, so a timeout can kill mpiexec and every rank it started.
        proc = subprocess.Popen(
            cmd, cwd=item.config.rootpath, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            timed_out = True
        text = output.decode(errors="replace")
        reports = {}
        for r in range(nranks):
            f = report_dir / f"rank{r}.json"
            if f.exists():
                reports[r] = json.loads(f.read_text())
        problems = []
        for r in range(nranks):
            rep = reports.get(r)
            if rep is None:
                why = f"timed out after {timeout:.0f}s" if timed_out else f"exit code {proc.returncode}"
                problems.append(f"rank {r} of {nranks} never reported ({why})")
            elif rep["outcome"] == "failed":
                problems.append(f"rank {r} of {nranks} failed:\n{rep['longrepr']}")
            elif rep["outcome"] == "skipped":
                problems.append(f"rank {r} of {nranks} skipped: {rep['longrepr']}")
        skipped = len(reports) == nranks and all(rep["outcome"] == "skipped" for rep in reports.values())
        reasons = {rep["longrepr"] for rep in reports.values()}
        if skipped and len(reasons) == 1 and proc.returncode == 0:
            # Every rank skipped for one reason (a condition only the ranks can see, such as a GPU
            # per rank): the test is skipped. A skip on some ranks only stays a failure.
            pytest.skip(_skip_reason(reasons.pop()))
        if problems:
            tail = "\n".join(text.splitlines()[-40:])
            pytest.fail("\n\n".join(problems) + f"\n\n--- mpiexec output (tail) ---\n{tail}",
                        pytrace=False)
        if not timed_out and proc.returncode != 0:
            pytest.fail(f"mpiexec exited with {proc.returncode} although every rank passed:\n{text}",
                        pytrace=False)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _skip_reason(longrepr: str) -> str:
    """The message of a skip report's longrepr, ``(path, line, 'Skipped: why')`` as text."""
    try:
        return str(ast.literal_eval(longrepr)[2]).removeprefix("Skipped: ")
    except (ValueError, SyntaxError, IndexError, TypeError):
        return longrepr


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    marker = pyfuncitem.get_closest_marker("mpi")
    if marker is None or os.environ.get(_CHILD_ENV):
        return None
    nranks = pyfuncitem.callspec.params["_mpi_ranks"]
    if nranks == 1:
        return None
    _run_ranks(pyfuncitem, nranks, float(marker.kwargs.get("timeout", _DEFAULT_TIMEOUT)))
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report_dir = os.environ.get(_CHILD_ENV)
    if not report_dir or item.get_closest_marker("mpi") is None:
        return
    rep = outcome.get_result()
    # One file per rank: the worst outcome over setup / call / teardown.
    if rep.when == "call" or rep.outcome != "passed":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        path = Path(report_dir) / f"rank{rank}.json"
        if path.exists() and json.loads(path.read_text())["outcome"] == "failed":
            return
        path.write_text(json.dumps({"outcome": rep.outcome, "longrepr": str(rep.longrepr or "")}))


@pytest.fixture
def mpi_comm(request: pytest.FixtureRequest):
    """MPI.COMM_WORLD; its size is the test's rank count (None in a parent that only launches)."""
    expected = request.node.callspec.params.get("_mpi_ranks", 1)
    if expected > 1 and not os.environ.get(_CHILD_ENV):
        return None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != expected:
        raise RuntimeError(f"running at {comm.Get_size()} ranks, test asked for {expected}")
    return comm
