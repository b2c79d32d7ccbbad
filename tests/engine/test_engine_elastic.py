"""Engine(elastic=True) under ``terrapipe run -np 4 --min-np 2``: a rank SIGKILLed mid-epoch,
the other three restore the last commit, join the next generation and finish at three ranks with
every sample of every epoch trained on once (FastLoader resumed at the new world size) and the
loss going on from where it was."""

from pathlib import Path

import numpy as np
import pytest

from terrapipe.engine import Engine
from tests.elastic_jobs import epochs_covered_once, run_job

WORKER = Path(__file__).resolve().parent / "elastic_engine_worker.py"


# make test-full (CI time: four ranks on two cores): CI keeps Horovod's elastic job with a worker
# killed (tests/horovod/test_elastic_job.py) and the loader's resume at another world size.
@pytest.mark.full
def test_a_rank_killed_at_four_training_goes_on_at_three_without_a_sample_lost():
    code, records, err = run_job(["-np", "4", "--min-np", "2", "-H", "localhost:4"], WORKER,
                                 ["--kill-rank", "3", "--kill-step", "7"], timeout=300)
    assert code == 0, err[-3000:]
    assert "generation 2: 3 workers" in err and "restoring step 6 (epoch 0)" in err, err[-3000:]
    steps = [r for r in records if "step" in r]
    assert {r["size"] for r in steps if r["generation"] == 1} == {4}
    after = [r for r in steps if r["generation"] == 2]
    assert {r["size"] for r in after} == {3} and min(r["step"] for r in after) == 7
    epochs_covered_once(records, 2, 480)
    # the loss goes on from the commit: the three steps after the restore are about as good as
    # the three before the kill, averaged over the ranks (a restart from scratch is back at ~1.3)
    def mean_loss(rs, lo, hi):
        return np.mean([r["loss"] for r in rs if lo <= r["step"] <= hi])

    before = mean_loss([r for r in steps if r["generation"] == 1], 4, 6)
    resumed = mean_loss(after, 7, 9)
    first = mean_loss(steps, 1, 1)
    assert resumed < 0.8 * first and resumed < 1.15 * before, (first, before, resumed)
    final = [r["final"] for r in records if "final" in r]
    assert len(final) == 1 and final[0] < 0.5 * first, (final, first)


def test_elastic_needs_a_loader_that_resumes_at_any_world_size():
    import torch

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="train_loader: elastic=True .* set_world"):
        Engine(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
               [(torch.zeros(1, 2), torch.zeros(1, 1))], elastic=True)
