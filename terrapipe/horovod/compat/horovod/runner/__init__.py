"""``horovod.runner`` as far as scripts and Horovod's own test helpers import it under
``terrapipe run --horovod``: ``run``, the interactive launcher (terrapipe.horovod.runner);
launching a script is ``terrapipe run``'s job."""


def __getattr__(name: str):
    if name == "run":  # lazy, as in the top-level package
        from terrapipe.horovod.runner import run

        return run
    raise AttributeError(f"module 'horovod.runner' has no attribute {name!r}")
