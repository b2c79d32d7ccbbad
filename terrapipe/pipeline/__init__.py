"""terrapipe.pipeline: FastLoader, its sources and transforms (imports kernels, never comm)."""

from . import roi_jpeg
from .loader import FastLoader, SampleError
from .order import epoch_indices
from .sources import ArrayDataset, ImageFolder, Source
from .transforms import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize

__all__ = [
    "roi_jpeg",
    "FastLoader",
    "SampleError",
    "epoch_indices",
    "ArrayDataset",
    "ImageFolder",
    "Source",
    "CenterCrop",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
]
