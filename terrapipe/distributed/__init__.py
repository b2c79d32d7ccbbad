"""terrapipe.distributed: the ``"terrapipe"`` backend of torch.distributed (imports comm).

Importing it registers the backend, so a script changes one word::

    import terrapipe.distributed  # noqa: F401
    dist.init_process_group(backend="terrapipe")   # under torchrun, or any init_method
    model = DDP(model)

See NOTE [the terrapipe process group] in process_group.py for how calls are served.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .process_group import ProcessGroupTerrapipe, create

__all__ = ["ProcessGroupTerrapipe", "BACKEND", "register"]

BACKEND = "terrapipe"


def register() -> None:
    """Register the backend with torch.distributed (idempotent; done on import)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=devices)


register()
