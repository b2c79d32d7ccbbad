"""terrapipe.pipeline: FastLoader, its sources and transforms (imports kernels, never comm)."""

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
