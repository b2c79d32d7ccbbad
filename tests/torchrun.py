"""Starting a ``torchrun --standalone`` job from a test: its command and its environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# A test may run inside a rank of an MPI job (tests/mpi_plugin.py): a torchrun started from there
# must not see that job's variables, or its ranks would join the MPI job instead.
LAUNCHER_VARIABLES = ("PMI", "OMPI_", "HYDRA", "MPI", "TERRAPIPE_TEST_MPI")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any MPI launcher's variables, with one OpenMP thread
    per rank (two cores), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def standalone(ranks: int, log_dir: Path) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=<ranks>``; append the
    script and its arguments. torchrun's per-run folder goes under ``log_dir`` (left alone,
    torchrun makes one in /tmp for every run and never removes it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", f"--log-dir={log_dir}"]
