"""``horovod.common.util`` under ``terrapipe run --horovod``: the helpers Horovod's scripts and
tests import from it that mean something without Horovod's compiled extension."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["env", "gloo_built", "mpi_built"]


def gloo_built() -> bool:
    """Whether a job can run over Gloo (terrapipe.horovod.gloo_built)."""
    from terrapipe.horovod import gloo_built as built

    return built()


def mpi_built() -> bool:
    """Whether a job can run over MPI (terrapipe.horovod.mpi_built)."""
    from terrapipe.horovod import mpi_built as built

    return built()


@contextlib.contextmanager
def env(**variables: str | None) -> Iterator[None]:
    """Set environment ``variables`` (a None value is left alone) inside the block, then put each
    back as it was (restored, or removed when it had not been set)."""
    given = {k: v for k, v in variables.items() if v is not None}
    before = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
