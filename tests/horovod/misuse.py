"""Horovod's two refusals of a DistributedOptimizer used out of order, shared by the averaging
optimizer's tests and the Adasum delta optimizer's: both raise horovod.torch's AssertionErrors."""

from collections.abc import Callable

import pytest

import terrapipe.horovod as hvd


def check_out_of_order_use_is_refused(opt, backward: Callable[[], None]) -> None:
    """``opt``: a DistributedOptimizer on which ``backward()`` (one loss.backward() over its
    parameters) has just run once, with backward_passes_per_step=1. With more than one rank its
    gradients are in flight, so zero_grad() and a second backward() must both be refused; at one
    rank nothing is in flight and both are allowed, so this checks nothing there."""
    if hvd.size() == 1:
        return
    with pytest.raises(AssertionError, match="before optimizer.step"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step times"):
        backward()
