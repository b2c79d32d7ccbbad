import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.mpi_plugin"]

# Kernels compile on first call (cached on disk afterwards): no per-example deadline.
settings.register_profile(
    "terrapipe", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("terrapipe"), max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "terrapipe"))


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
