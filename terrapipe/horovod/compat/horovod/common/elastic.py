"""``horovod.common.elastic`` under ``terrapipe run --horovod``."""

from terrapipe.horovod.elastic import ObjectState, State, run

__all__ = ["State", "ObjectState", "run"]
