"""``horovod.common.process_sets`` under ``terrapipe run --horovod``."""

from terrapipe.horovod.basics import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
