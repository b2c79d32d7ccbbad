"""The errors terrapipe.horovod raises, with horovod.torch's names."""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "TensorArgumentError"]

# Horovod's words for misuse of a DistributedOptimizer, raised as AssertionError by both the
# averaging optimizer (optimizer.py) and the Adasum delta optimizer (adasum_optimizer.py), as
# horovod.torch raises them (scripts and Horovod's tests match on this text).
ZERO_GRAD_IN_FLIGHT = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                       "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")


class HorovodInternalError(RuntimeError):
    """A collective failed: ranks issued it with different arguments, a rank never issued it
    within the timeout, or a peer died (horovod.common.exceptions.HorovodInternalError)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The elastic job's workers changed (hvd.elastic's ``check_host_updates``, at a commit):
    every rank raises it at the same commit and ``hvd.elastic.run`` re-forms the world.
    ``skip_sync``: True when workers were only removed (the survivors' state is already the
    same everywhere, so the sync after the reset is skipped)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated" + (" (workers removed)" if skip_sync else ""))
        self.skip_sync = bool(skip_sync)


class TensorArgumentError(ValueError, RuntimeError):
    """A tensor argument is unusable (a ValueError; also a RuntimeError, which is what
    horovod.torch raised for the same checks from its C++ core)."""
