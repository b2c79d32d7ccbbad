"""The errors terrapipe.horovod raises, with horovod.torch's names."""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "TensorArgumentError"]


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
