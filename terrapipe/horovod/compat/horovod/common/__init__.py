"""``horovod.common`` under ``terrapipe run --horovod``: its exceptions, process sets, elastic state
and ``util.env``."""
