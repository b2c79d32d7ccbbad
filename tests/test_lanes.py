"""make test's two lanes (tests/lanes.py, NOTE [two lanes])."""

import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests import lanes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("first,second,code", [
    (0, 0, 0), (0, 5, 0), (5, 0, 0), (5, 5, 5),  # a lane with nothing selected is no failure
    (1, 0, 1), (0, 1, 1), (5, 1, 1), (1, 5, 1), (2, 1, 2),  # either failing fails the run
])
def test_the_run_fails_where_either_lane_fails(first, second, code):
    assert lanes.exit_code(first, second) == code


# What starts or joins an MPI job in a test module (NOTE [two lanes] 2): the harness's marker
# and fixture, mpiexec, the emulated cluster (hydra's proxies), mpi4py.
_MPI_WORDS = ("mark.mpi(", "mpi_comm", "mpiexec", "testing.cluster", "emulated_cluster", "mpi4py")


def _code(path: Path) -> str:
    """The module's text without its comments."""
    with path.open("rb") as f:
        return " ".join(t.string for t in tokenize.tokenize(f.readline) if t.type != tokenize.COMMENT)


def test_no_module_of_the_second_lane_names_an_mpi_job():
    modules = [p for lane in lanes.LANE for p in
               ((ROOT / lane).rglob("*.py") if (ROOT / lane).is_dir() else [ROOT / lane])]
    assert len(modules) > len(lanes.LANE), modules  # every path is there
    codes = {str(p.relative_to(ROOT)): _code(p) for p in modules}
    named = {name: word for name, code in codes.items() for word in _MPI_WORDS if word in code}
    assert not named, f"MPI in the second lane: {named}"


@pytest.mark.full  # each lane collects the whole suite (30-60 s); every `make test` runs the lanes
def test_each_lane_runs_its_own_tests_and_reports_after_the_other():
    p = subprocess.run([sys.executable, "-m", "tests.lanes", "-q", "-p", "no:randomly", "-k",
                        "test_launchers_are_told_apart or test_uniform_distribution_and_independence"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    first, _, second = p.stdout.partition("===== the second lane: tests/kernels tests/pipeline ")
    assert second, p.stdout  # the second lane's report comes after the first's, whole
    assert "1 passed" in first and "1 passed" in second, p.stdout
    none = subprocess.run([sys.executable, "-m", "tests.lanes", "-q", "-k", "no_test_is_named_so"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert none.returncode == 5, none.stdout[-3000:]
