"""torch's own distributed test suite (shipped in the wheel) against the "terrapipe" backend.

Not part of ``make test`` (it takes tens of minutes); run it with ``make torch-suite``, which
runs this module once per backend and prints pass/skip/fail counts for each::

    BACKEND=terrapipe WORLD_SIZE=2 python -m pytest tests/distributed/torch_suite.py

``torch.testing._internal.distributed.distributed_test`` reads ``BACKEND`` and ``WORLD_SIZE``
when imported and spawns a process per rank for every test; each spawned child imports this
module again, which registers the backend there too. The suite's decorators name backend sets
(``DistTestCases.backend_feature``): terrapipe is added wherever Gloo is, and to the plugin set,
before the suite is imported, since it serves every call Gloo serves on the CPU. Other gates
name Gloo literally in the suite's source (``require_backend_is_available({"gloo"})``,
``BACKEND != "gloo"``, ``BACKEND == "gloo"``): the suite is loaded from its own source with
"terrapipe" added to each of them (``_load_suite``). The tests that call
``dist.monitored_barrier`` stay Gloo's: torch itself refuses that function on any other backend
("only implemented for GLOO backend"), so they skip here with that reason (``_refused``, read
from the tests' own code). A test that calls ``monitored_barrier`` on a group object runs: the
terrapipe group serves it (through its Gloo group). Nothing else of the suite changes.
"""

import ast
import os
import re
import tempfile

import pytest

os.environ.setdefault("BACKEND", "terrapipe")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # spawned children inherit the parent's
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="terrapipe-torch-suite-")

pytest.importorskip("expecttest", reason="torch's suite needs expecttest (make torch-suite installs it)")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

import terrapipe.distributed  # noqa: E402,F401 (registers "terrapipe" here and in every spawned child)

for _name, _backends in DistTestCases.backend_feature.items():
    if "gloo" in _backends:
        _backends.add("terrapipe")
DistTestCases.backend_feature["plugin"].add("terrapipe")  # what the suite's availability check reads

_SUITE = "torch.testing._internal.distributed.distributed_test"
# The decorator, up to the test it gates: widened unless torch refuses what that test calls.
_DECORATOR = re.compile(r'require_backend_is_available\(\{"gloo"\}\)(?=(?:\s*@[^\n]*)*\s*def (test_\w+))')
_GATES = {'BACKEND == "gloo"': 'BACKEND in ("gloo", "terrapipe")',
          'BACKEND != "gloo"': 'BACKEND not in ("gloo", "terrapipe")'}
# Tests (with the helpers they call on self) that call dist.monitored_barrier: filled by _load_suite.
_REFUSED: set[str] = set()


def _refused(source: str) -> set[str]:
    """The suite's tests that reach ``dist.monitored_barrier``, directly or through a
    ``self._helper`` of the suite: torch raises ValueError there for every backend but Gloo."""
    calls: dict[str, set[str]] = {}
    direct: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        calls.setdefault(node.name, set())
        for sub in ast.walk(node):
            if not (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                    and isinstance(sub.func.value, ast.Name)):
                continue
            owner, attr = sub.func.value.id, sub.func.attr
            if owner == "dist" and attr == "monitored_barrier":
                direct.add(node.name)
            elif owner == "self":
                calls[node.name].add(attr)
    refused = set(direct)
    while True:  # through helpers, to a fixed point
        more = {f for f, callees in calls.items() if f not in refused and callees & refused}
        if not more:
            break
        refused |= more
    return {f for f in refused if f.startswith("test_")}


def _widen(match: re.Match) -> str:
    if match.group(1) in _REFUSED:
        return match.group(0)
    return 'require_backend_is_available({"gloo", "terrapipe"})'


def _load_suite():
    """torch's suite module, compiled from its own file with the literal Gloo gates widened to
    terrapipe (the module docstring); registered under its name so the suite's own imports and
    the spawned children find this one."""
    import importlib.util
    import sys

    if _SUITE in sys.modules:
        return sys.modules[_SUITE]
    spec = importlib.util.find_spec(_SUITE)
    with open(spec.origin) as f:
        source = f.read()
    _REFUSED.update(_refused(source))
    if not _REFUSED:
        raise RuntimeError("torch's suite no longer calls dist.monitored_barrier: update _refused")
    source, n = _DECORATOR.subn(_widen, source)
    for gate, widened in _GATES.items():
        if gate not in source or not n:
            raise RuntimeError(f"torch's suite no longer contains {gate!r} or the Gloo-only "
                               "decorator: update _GATES / _DECORATOR")
        source = source.replace(gate, widened)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_SUITE] = module
    exec(compile(source, spec.origin, "exec"), module.__dict__)  # noqa: S102 - torch's own test file
    return module


_suite = _load_suite()
DistributedTest, TestDistBackend = _suite.DistributedTest, _suite.TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        if self._testMethodName in _REFUSED and os.environ["BACKEND"] != "gloo":
            self.skipTest("torch refuses dist.monitored_barrier on any backend but Gloo")
        super().setUp()
        self._spawn_processes()
