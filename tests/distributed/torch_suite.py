"""torch's own distributed test suite (shipped in the wheel) against the "terrapipe" backend.

Not part of ``make test`` (it takes tens of minutes); run it with ``make torch-suite``, which
runs this module once per backend and prints pass/skip/fail counts for each::

    BACKEND=terrapipe WORLD_SIZE=2 python -m pytest tests/distributed/torch_suite.py

``torch.testing._internal.distributed.distributed_test`` reads ``BACKEND`` and ``WORLD_SIZE``
when imported and spawns a process per rank for every test; each spawned child imports this
module again, which registers the backend there too. The suite's decorators name backend sets
(``DistTestCases.backend_feature``): terrapipe is added wherever Gloo is, and to the plugin set,
before the suite is imported, since it serves every call Gloo serves on the CPU. Decorators that
name a literal set (``require_backend_is_available({"gloo"})``) or compare ``BACKEND == "gloo"``
still skip for terrapipe: nothing else of the suite changes.
"""

import os
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

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
