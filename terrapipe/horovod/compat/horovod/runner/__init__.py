"""``horovod.runner`` as far as scripts and Horovod's own test helpers import it under
``terrapipe run --horovod``: ``run``, the interactive launcher (terrapipe.horovod.runner), and
``_HorovodArgs`` with ``launch._run``, which Horovod's own tests call (NOTE [the run API] 4)."""


def __getattr__(name: str):
    if name == "run":  # lazy, as in the top-level package
        from terrapipe.horovod.runner import run

        return run
    if name == "_HorovodArgs":  # what Horovod's tests hand to horovod.runner.launch._run
        from terrapipe.horovod.runner import HorovodArgs

        return HorovodArgs
    raise AttributeError(f"module 'horovod.runner' has no attribute {name!r}")
