"""``horovod`` as ``terrapipe run --horovod`` provides it: ``horovod.torch`` is terrapipe.horovod,
``horovod.run`` its interactive launcher (terrapipe.horovod.runner)."""

__version__ = "0.28.1"  # the horovod.torch API level terrapipe.horovod implements


def __getattr__(name: str):
    # Lazy, as `import horovod` is light in Horovod: run() brings torch with terrapipe.horovod.
    if name == "run":
        from terrapipe.horovod.runner import run

        return run
    raise AttributeError(f"module 'horovod' has no attribute {name!r}")
