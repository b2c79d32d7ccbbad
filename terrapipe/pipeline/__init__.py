"""terrapipe.pipeline: FastLoader, its sources and transforms (imports kernels, never comm).

The names load on first use: the loader's worker process imports this package to rebuild its
sources and transforms, and must not pay for torch (3 s on two cores) where its dataset does
not need it (NOTE [the loader's worker process] 2 in worker_process.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy loader below returns, for readers and type checkers
    from . import compiled_fill, roi_jpeg
    from .loader import FastLoader, SampleError
    from .order import epoch_indices
    from .shards import ShardError, TarShards, write_shards
    from .sources import ArrayDataset, ImageFolder, Source, TorchDataset
    from .transforms import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize, Transform

__all__ = [
    "roi_jpeg",
    "compiled_fill",
    "FastLoader",
    "SampleError",
    "epoch_indices",
    "ArrayDataset",
    "ImageFolder",
    "Source",
    "TarShards",
    "ShardError",
    "write_shards",
    "TorchDataset",
    "Transform",
    "CenterCrop",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
]

_MODULE_OF = {"roi_jpeg": None, "compiled_fill": None,
              "FastLoader": ".loader", "SampleError": ".loader", "epoch_indices": ".order",
              "TarShards": ".shards", "ShardError": ".shards", "write_shards": ".shards",
              "ArrayDataset": ".sources", "ImageFolder": ".sources", "Source": ".sources",
              "TorchDataset": ".sources",
              **{name: ".transforms" for name in ("Transform", "CenterCrop", "Normalize",
                                                  "RandomHorizontalFlip", "RandomResizedCrop", "Resize")}}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'terrapipe.pipeline' has no attribute {name!r}")
    module = _MODULE_OF[name]
    value = (importlib.import_module(f".{name}", __name__) if module is None
             else getattr(importlib.import_module(module, __name__), name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
