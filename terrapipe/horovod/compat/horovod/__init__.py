"""``horovod`` as ``terrapipe run --horovod`` provides it: ``horovod.torch`` is terrapipe.horovod."""

__version__ = "0.28.1"  # the horovod.torch API level terrapipe.horovod implements
