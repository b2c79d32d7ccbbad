"""A pytest plugin for ``make horovod-suite`` (Horovod's own test/parallel files against
terrapipe.horovod): torch >= 2.10's ``torch.optim.Muon`` refuses 1-D parameters, and Horovod's
sweep over ``torch.optim.Optimizer.__subclasses__()`` predates it (the same three tests fail
under Horovod itself), so the sweep is shown every optimizer but Muon. Nothing else changes."""

import torch

_subclasses = torch.optim.Optimizer.__subclasses__


def _without_muon() -> list[type]:
    return [c for c in _subclasses() if c.__name__ != "Muon"]


def pytest_configure(config) -> None:
    torch.optim.Optimizer.__subclasses__ = staticmethod(_without_muon)
