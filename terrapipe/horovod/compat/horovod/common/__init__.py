"""``horovod.common`` under ``terrapipe run --horovod``: its exceptions and process sets."""
