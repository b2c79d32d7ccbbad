"""The errors terrapipe.horovod raises, with horovod.torch's names."""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "TensorArgumentError"]


class HorovodInternalError(RuntimeError):
    """A collective failed: ranks issued it with different arguments, a rank never issued it
    within the timeout, or a peer died (horovod.common.exceptions.HorovodInternalError)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic mode signal; elastic training is not supported, so it is never raised."""


class TensorArgumentError(ValueError, RuntimeError):
    """A tensor argument is unusable (a ValueError; also a RuntimeError, which is what
    horovod.torch raised for the same checks from its C++ core)."""
