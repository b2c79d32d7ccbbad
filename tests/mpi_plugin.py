"""Run a test body at several rank counts under ``mpiexec``, the way mpi4py's suite runs.

    @pytest.mark.mpi(ranks=(1, 2, 4), timeout=120)
    def test_allreduce(mpi_comm):
        ...

The test is parametrized over ``ranks``. At 1 rank it runs in the pytest process. At N > 1 every
rank runs the body under ``mpiexec -n N`` and writes its own report; the parent fails with the
traceback of each failing rank (``rank 1 of 2 failed: ...``), or names the ranks that never
reported (crashed or hung) once the timeout passes, after killing the whole job. No orphaned
ranks survive a parent that times out, fails or is killed.

The ``mpi_comm`` fixture is ``MPI.COMM_WORLD`` of the rank running the body.

Rank counts above 2 are marked ``full`` (``make test-full``; ``make test`` deselects them to
keep CI within its budget on two cores) unless the test names them in ``ci_ranks``: the load
and topology tests do, so every ``make test`` still runs the comm core under load at 4 ranks.

    @pytest.mark.mpi(ranks=(2, 4), ci_ranks=(2, 4))

NOTE [one job per rank count]

  Starting ranks costs more than most bodies (each rank imports torch, numba and pytest, then
  joins MPI: 2 s on two cores), so every test at one rank count shares a job, across modules:

  1. At the first such test the parent starts ``mpiexec -n N python -m pytest <every selected
     test still to come at N ranks, in the parent's order>``. Each rank holds before every test
     until the parent releases it (a ``go`` file): one test runs at a time, in the parent's
     order, as if each had its own job, and a test the parent skips is skipped in the job too.
     A rank held for over a second looks for its ``go`` less often (the parent is running
     tests of its own, and the ranks must not take its cores); so does the parent for the
     ranks' reports once a test has run for a second (each look reads every rank's report: at
     5 ms apart they took 6% of a core for as long as the test ran, from the ranks' two).
  2. After each test every rank undoes what a process exit would (``_fresh_process``: Horovod's
     shutdown, torch.distributed's process group, terrapipe.comm's world, and the environment
     as it was when the test began) before reporting, so the next test starts from a process as
     new as a fresh one in everything terrapipe keeps.
  3. A test that hangs, crashes a rank, or fails on one rank while the others wait ends its job:
     the parent kills it, reports that test, and the next test at N ranks starts a new job.
  4. Once a job's last test has passed on every rank, every rank must exit within 60 s with
     status 0; a rank stuck at exit (a thread left running) fails that last test.
  5. ``@pytest.mark.mpi(..., own_job=True)``: a test of process start or exit runs alone, in a
     job of its own; the shared job waits for the tests after it.

NOTE [jobs across an emulated cluster]

  ``pytest --mpi-cluster 2x1,2x2`` (``make test-cluster``) runs every multi-rank job across
  emulated nodes (terrapipe.testing.cluster) instead of on this host:

  1. A job of N ranks runs on the layout of N ranks given (``2x2``: 2 nodes of 2 ranks); a test
     at a rank count with no layout given, or at 1 rank, is deselected.
  2. A test of something that exists on one host only says so, ``@pytest.mark.mpi(...,
     one_node=True)``, and is deselected: the tests that emulate nodes on one host
     (TERRAPIPE_NODE_SIZE), whose emulated nodes would span real ones.
  3. One cluster per layout lives for the session, its links shaped to ``--mpi-link`` (10gbit
     by default: the suites check results, and on two cores a faster link only moves the
     bottleneck to the CPU). Jobs on it are started, released and killed as on one host; the job
     directory is on the host's filesystem, which every node shares.
"""

from __future__ import annotations

import ast
import atexit
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from terrapipe import launch_env

_CHILD_ENV = "TERRAPIPE_TEST_MPI_CHILD"  # set in every rank: the job's directory
_PARENT_ENV = "TERRAPIPE_TEST_MPI_PARENT"  # the parent's pid: a rank outliving it exits
_DEFAULT_TIMEOUT = 120.0
_EXIT_TIMEOUT = float(os.environ.get("TERRAPIPE_TEST_MPI_EXIT_TIMEOUT", "60"))  # clause 4
# How long the other ranks may still report after one rank failed (clause 3).
_FAILED_GRACE = float(os.environ.get("TERRAPIPE_TEST_MPI_FAILED_GRACE", "10"))
_POLL = 0.005
_IDLE_POLL = 0.05  # a rank held for over a second (clause 1)
_LONG_POLL = 0.02  # the parent, for the reports of a test running for over a second (clause 1)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpi", "multi-rank tests (tests/mpi_plugin.py)")
    group.addoption("--mpi-cluster", default=None, metavar="LAYOUTS",
                    help="run multi-rank jobs across an emulated cluster, one layout per rank "
                         "count: comma-separated NODESxRANKS, e.g. 2x1,2x2 (NOTE [jobs across an "
                         "emulated cluster])")
    group.addoption("--mpi-link", default="10gbit", metavar="RATE",
                    help="the emulated cluster's link rate (tc syntax; default 10gbit)")


def _layouts(config: pytest.Config) -> dict[int, tuple[int, int]]:
    """--mpi-cluster as {ranks: (nodes, ranks per node)}; empty on one host."""
    given = config.getoption("--mpi-cluster", None)
    if not given:
        return {}
    layouts = {}
    for text in given.split(","):
        try:
            nodes, per_node = (int(x) for x in text.strip().lower().split("x"))
        except ValueError:
            raise pytest.UsageError(
                f"--mpi-cluster: expected layouts such as 2x1,2x2, got {text!r}") from None
        if nodes < 1 or per_node < 1 or nodes * per_node in layouts:
            raise pytest.UsageError(f"--mpi-cluster: {text!r} is empty or repeats a rank count")
        layouts[nodes * per_node] = (nodes, per_node)
    return layouts


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mpi(ranks=(1, 2), timeout=120, ci_ranks=None, own_job=False, one_node=False): run the "
        "test body under mpiexec at each rank count",
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    layouts = _layouts(config)
    if not layouts or os.environ.get(_CHILD_ENV):
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("mpi")
        across = (marker is not None and _ranks_of(item) in layouts
                  and not marker.kwargs.get("one_node", False))
        (keep if across else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_clusters: dict[int, object] = {}  # ranks -> the emulated cluster its jobs run on (clause 3)


def _launch(config: pytest.Config, nranks: int) -> list[str]:
    """The launcher and its arguments for a job of ``nranks`` ranks."""
    layout = _layouts(config).get(nranks)
    if layout is None:
        return [mpiexec(), "-n", str(nranks)]
    from terrapipe.testing import cluster as tc

    nodes, per_node = layout
    if nranks not in _clusters:
        why = tc.available()
        if why is not None:
            raise pytest.UsageError(f"--mpi-cluster: {why}")
        _clusters[nranks] = tc.Cluster(nodes, config.getoption("--mpi-link")).__enter__()
    return _clusters[nranks].mpiexec_args(per_node)


def _close_clusters() -> None:
    for cluster in _clusters.values():
        cluster.close()
    _clusters.clear()


def mpiexec() -> str:
    """The mpiexec beside this interpreter (the MPI wheel's), else the one on PATH."""
    found = launch_env.mpiexec_path()
    if found is None:
        raise RuntimeError("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    return found


def _key(nodeid: str) -> str:
    return hashlib.sha1(nodeid.encode()).hexdigest()[:16]


def _ranks_of(item: pytest.Item) -> int:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("_mpi_ranks", 1) if callspec is not None else 1


def _own_job(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("mpi").kwargs.get("own_job", False))


# --- the parent ---------------------------------------------------------------------------------

class _Job:
    """One ``mpiexec -n N`` running a list of tests, each released by the parent in turn."""

    def __init__(self, config: pytest.Config, nodeids: list[str], nranks: int) -> None:
        self.nodeids = nodeids
        self.nranks = nranks
        self.released: set[str] = set()
        self.failed_any = False
        self.dir = Path(tempfile.mkdtemp(prefix="terrapipe-mpitest-"))
        self.started = time.time()
        self.log_path = self.dir / "output.log"
        env = dict(os.environ)
        env[_CHILD_ENV] = str(self.dir)
        env[_PARENT_ENV] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [*_launch(config, nranks), sys.executable, "-m", "pytest", "-q",
               "-p", "no:cacheprovider", "--rootdir", str(config.rootpath), *nodeids]
        with open(self.log_path, "wb") as log:
            # A new session, so a timeout can kill mpiexec and every rank it started.
            self.proc = subprocess.Popen(cmd, cwd=config.rootpath, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def release(self, nodeid: str, action: str) -> None:
        self.released.add(nodeid)
        _write(self.dir / f"{_key(nodeid)}.go", action)

    def reports(self, nodeid: str) -> dict[int, dict]:
        """Each rank's outcome of ``nodeid`` so far, with ``done`` once it has also cleaned up."""
        found = {}
        for r in range(self.nranks):
            report = self.dir / f"{_key(nodeid)}.rank{r}.json"
            if report.exists():
                found[r] = json.loads(report.read_text())
                done = self.dir / f"{_key(nodeid)}.rank{r}.done"
                found[r]["done"] = done.read_text() if done.exists() else None
        return found

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_tail(self, start: int, lines: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        killed = self.alive()
        if killed:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        if killed or self.proc.returncode != 0:
            # Ranks that never reached MPI_Finalize leave MPICH's node file in /dev/shm.
            launch_env.end_job(_CHILD_ENV, str(self.dir))
            launch_env.remove_orphaned_mpi_files(self.started)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_jobs: dict[int, _Job] = {}  # rank count -> its shared job (clause 1)


def _close_all_jobs() -> None:
    for job in _jobs.values():
        job.close()
    _jobs.clear()
    _close_clusters()


atexit.register(_close_all_jobs)  # the parent's last word: no rank outlives it


def _job_for(item: pytest.Item, nranks: int) -> _Job:
    """The live job that holds ``item``, else a new one holding it and every later test at
    ``nranks`` (NOTE [one job per rank count] clauses 1 and 5)."""
    if _own_job(item):
        return _Job(item.config, [item.nodeid], nranks)
    job = _jobs.get(nranks)
    if job is not None and item.nodeid in job.nodeids and item.nodeid not in job.released \
            and job.alive():
        return job
    if job is not None:
        job.close()
        del _jobs[nranks]
    items = item.session.items
    rest = [it.nodeid for it in items[items.index(item):]
            if it.get_closest_marker("mpi") is not None and _ranks_of(it) == nranks and not _own_job(it)]
    job = _jobs[nranks] = _Job(item.config, rest, nranks)
    return job


def _run_ranks(item: pytest.Item, nranks: int, timeout: float) -> None:
    job = _job_for(item, nranks)
    start_log = job.log_size()
    job.release(item.nodeid, "run")
    start = time.monotonic()
    failed_at = None
    ended = timed_out = False
    while True:
        reports = job.reports(item.nodeid)
        if len(reports) == nranks and all(r["done"] is not None for r in reports.values()):
            break
        if not job.alive():
            ended = True
            reports = job.reports(item.nodeid)
            break
        now = time.monotonic()
        if failed_at is None and any(r["outcome"] == "failed" for r in reports.values()):
            failed_at = now
        if now - start > timeout or (failed_at is not None and now - failed_at > _FAILED_GRACE):
            timed_out = now - start > timeout
            job.kill()
            ended = True
            reports = job.reports(item.nodeid)
            break
        time.sleep(_POLL if now - start < 1.0 else _LONG_POLL)
    last = item.nodeid == job.nodeids[-1]
    if not ended and last:
        # Clause 4: the job's ranks leave once its last test is done.
        try:
            job.proc.wait(timeout=_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            job.kill()
    text = job.log_tail(start_log)
    problems = []
    for r in range(nranks):
        rep = reports.get(r)
        if rep is None:
            if timed_out:
                why = f"timed out after {timeout:.0f}s"
            elif failed_at is not None:
                why = f"still running {_FAILED_GRACE:.0f}s after another rank failed"
            else:
                why = f"exit code {job.proc.returncode}"
            problems.append(f"rank {r} of {nranks} never reported ({why})")
        elif rep["outcome"] == "failed":
            problems.append(f"rank {r} of {nranks} failed:\n{rep['longrepr']}")
        elif rep["outcome"] == "skipped":
            problems.append(f"rank {r} of {nranks} skipped: {rep['longrepr']}")
        if rep is not None and rep["done"]:
            problems.append(f"rank {r} of {nranks}: {rep['done']}")
        elif rep is not None and rep["done"] is None and rep["outcome"] != "failed":
            problems.append(f"rank {r} of {nranks} passed but never finished cleaning up")
    if ended or last:
        for key, j in list(_jobs.items()):
            if j is job:
                del _jobs[key]
        job.close()
    skipped = len(reports) == nranks and all(rep["outcome"] == "skipped" and rep["done"] == ""
                                             for rep in reports.values())
    reasons = {rep["longrepr"] for rep in reports.values()}
    if skipped and len(reasons) == 1:
        # Every rank skipped for one reason (a condition only the ranks can see, such as a GPU
        # per rank): the test is skipped. A skip on some ranks only stays a failure.
        pytest.skip(_skip_reason(reasons.pop()))
    if problems:
        job.failed_any = True
        pytest.fail("\n\n".join(problems) + f"\n\n--- mpiexec output (tail) ---\n{text}",
                    pytrace=False)
    if last and not job.failed_any and job.proc.returncode != 0:
        how = (f"did not exit within {_EXIT_TIMEOUT:.0f}s" if job.proc.returncode < 0
               else f"exited with {job.proc.returncode}")
        pytest.fail(f"mpiexec {how} after every rank passed its last test:\n{text}",
                    pytrace=False)


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
    nranks = _ranks_of(pyfuncitem)
    if nranks == 1:
        return None
    _run_ranks(pyfuncitem, nranks, float(marker.kwargs.get("timeout", _DEFAULT_TIMEOUT)))
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not os.environ.get(_CHILD_ENV):
        _close_all_jobs()


# --- a rank of a job -----------------------------------------------------------------------------

_outcomes: dict[str, tuple[str, str]] = {}
_environ_before: dict[str, dict[str, str]] = {}  # os.environ as each test found it (clause 2)


def _parent_alive() -> bool:
    pid = int(os.environ.get(_PARENT_ENV, "0"))
    return pid <= 0 or launch_env.alive(pid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    job_dir = os.environ.get(_CHILD_ENV)
    if not job_dir or item.get_closest_marker("mpi") is None:
        return
    # Clause 1: hold until the parent releases this test.
    go = Path(job_dir) / f"{_key(item.nodeid)}.go"
    held = checked = time.monotonic()
    while not go.exists():
        time.sleep(_POLL if time.monotonic() - held < 1.0 else _IDLE_POLL)
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not _parent_alive():
                os._exit(1)
    if go.read_text() == "skip":
        pytest.skip("not run by the parent")
    _environ_before[item.nodeid] = dict(os.environ)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if not os.environ.get(_CHILD_ENV) or item.get_closest_marker("mpi") is None:
        return
    rep = outcome.get_result()
    # One outcome per rank and test: the worst over setup / call / teardown.
    if rep.when == "call" or rep.outcome != "passed" or item.nodeid not in _outcomes:
        if _outcomes.get(item.nodeid, ("",))[0] != "failed":
            _outcomes[item.nodeid] = (rep.outcome, str(rep.longrepr or ""))


def _fresh_process(environ: dict[str, str] | None) -> None:
    """Undo what a process exit would of what terrapipe keeps per process, and put back
    ``environ`` (clause 2)."""
    hvd = sys.modules.get("terrapipe.horovod.basics")
    if hvd is not None:
        hvd.shutdown()
        # No object outlives an exit: an earlier test's DistributedOptimizer, still waiting for
        # the garbage collector, must not rebind itself in the next test's hvd.init().
        hvd._listeners.clear()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    collectives = sys.modules.get("terrapipe.comm.collectives")
    if collectives is not None:
        collectives.finalize()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    job_dir = os.environ.get(_CHILD_ENV)
    if not job_dir:
        # The parent: a test it never called (skipped, or a fixture failed here) is skipped by
        # its job too.
        for job in _jobs.values():
            if nodeid in job.nodeids and nodeid not in job.released and job.alive():
                job.release(nodeid, "skip")
        return
    if nodeid not in _outcomes:
        return  # not a multi-rank test
    from mpi4py import MPI

    base = f"{job_dir}/{_key(nodeid)}.rank{MPI.COMM_WORLD.Get_rank()}"
    outcome, longrepr = _outcomes.pop(nodeid)
    # The outcome first: a rank that fails while another still waits in a collective may wait in
    # its clean-up too, and the parent shows this traceback, not only a timeout.
    _write(Path(base + ".json"), json.dumps({"outcome": outcome, "longrepr": longrepr}))
    problem = ""
    try:
        _fresh_process(_environ_before.pop(nodeid, None))
    except Exception as e:  # noqa: BLE001 - the parent reports it as this test's failure
        problem = f"cleaning up after the test: {type(e).__name__}: {e}"
    _write(Path(base + ".done"), problem)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def mpi_comm(request: pytest.FixtureRequest):
    """MPI.COMM_WORLD; its size is the test's rank count (None in a parent that only launches)."""
    expected = _ranks_of(request.node)
    if expected > 1 and not os.environ.get(_CHILD_ENV):
        return None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != expected:
        raise RuntimeError(f"running at {comm.Get_size()} ranks, test asked for {expected}")
    return comm
