"""``horovod.common.exceptions`` under ``terrapipe run --horovod``."""

from terrapipe.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
