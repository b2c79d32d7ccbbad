"""The ``torch.backends`` entry point: ``backend="terrapipe"`` with no terrapipe import.

torch (>= 2.5) calls :func:`register` at the end of ``import torch`` for every package that
names it in the ``torch.backends`` entry-point group (``pyproject.toml``). That happens in every
process that imports torch, so this module is a leaf: it imports ``torch.distributed`` and
nothing of terrapipe, and registers the name with a creator that loads the backend
(:mod:`terrapipe.distributed`, and with it ``terrapipe.comm``) only when a process group of it
is first made. ``import terrapipe.distributed`` registers through the same function.
"""

from __future__ import annotations

__all__ = ["BACKEND", "DEVICES", "register"]

BACKEND = "terrapipe"
# The devices the backend serves: host tensors, and CUDA tensors (over NCCL where each rank
# has a GPU of its own, else staged through the host). Named without asking whether CUDA is
# there: asking would initialise the driver inside every ``import torch``.
DEVICES = ("cpu", "cuda")


def _create(opts, backend_options=None):
    """torch's creator for ``"terrapipe"`` (extended API): the first call loads the backend."""
    from terrapipe.distributed import create

    return create(opts, backend_options)


def register() -> None:
    """Register ``"terrapipe"`` with torch.distributed (idempotent, cheap: no terrapipe layer
    is imported). Nothing to do where torch was built without distributed support."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
