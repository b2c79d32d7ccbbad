"""comm.init under ``torchrun --standalone`` on one machine: shared memory for every collective
(NOTE [machines over Gloo] 9 in comm/group.py), not Gloo's; the body is
tests/comm/torchrun_one_machine.py."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.torchrun import clean_env, standalone

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.full)])  # 3: make test-full
def test_a_torchrun_world_on_one_machine_is_its_segment(tmp_path, ranks):
    cmd = [*standalone(ranks, tmp_path), "-m", "tests.comm.torchrun_one_machine"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=clean_env(PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    # The ranks share one stdout: their lines may interleave.
    assert sorted(re.findall(r"rank \d+ of \d+: ok", out.stdout)) == [f"rank {r} of {ranks}: ok"
                                                                    for r in range(ranks)]
