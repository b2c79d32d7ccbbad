"""Sample sources for FastLoader.

A source is anything with ``__len__``, ``read(i) -> (payload, label)`` and ``describe(i) -> str``:

* payload: encoded image bytes (anything Pillow opens) or a uint8 array (H, W, C) / (H, W);
* label: an int;
* describe(i): what to name in an error about sample i (a path, "shard.tar:key.jpg",
  "array[i]").

``read`` is called from loader threads concurrently, so it must be thread-safe (plain file
reads and array indexing are). Sources here: :class:`ImageFolder` (files), :class:`ArrayDataset`
(arrays in memory), :class:`TorchDataset` (any map-style torch dataset) and
:class:`terrapipe.pipeline.shards.TarShards` (WebDataset tar shards).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

from .compiled_fill import FileTable

__all__ = ["Source", "ImageFolder", "ArrayDataset", "TorchDataset", "IMG_EXTENSIONS"]

# torchvision's list, so ImageFolder sees the same files.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@runtime_checkable
class Source(Protocol):
    def __len__(self) -> int: ...

    def read(self, i: int) -> tuple[bytes | np.ndarray, int]: ...

    def describe(self, i: int) -> str: ...


def _read_bytes(path: str) -> bytes:
    """The whole file, in 4 system calls (open, fstat, read, close) where ``open(path,
    "rb").read()`` makes 9. Each call drops and retakes the GIL, and the loader's threads read a
    file per sample (NOTE [scalar draws keep the GIL] in kernels/rng.py says why retakes cost)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)  # one more byte: a file that grew since fstat is read whole
        if len(data) > size or (0 < len(data) < size):
            chunks = [data]
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            data = b"".join(chunks)
        return data
    finally:
        os.close(fd)


class ImageFolder:
    """Class-per-folder images: ``root/<class>/<file>``, classes sorted as torchvision does.

    Attributes: ``classes`` (sorted names), ``class_to_idx``, ``samples`` (path, label) sorted
    by class then file name. Files are read as bytes; decoding happens in the loader. A class
    folder without an image file is refused naming it, as torchvision's ``ImageFolder`` refuses
    it, unless ``allow_empty=True`` (its index is kept, with no samples).
    """

    def __init__(self, root: str | os.PathLike, extensions: Sequence[str] = IMG_EXTENSIONS, *,
                 allow_empty: bool = False) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"root: {self.root} is not a directory")
        exts = tuple(e.lower() for e in extensions)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise ValueError(f"root: no class folders in {self.root}")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for c in self.classes:
            for dirpath, _, files in sorted(os.walk(self.root / c, followlinks=True)):
                for f in sorted(files):
                    if f.lower().endswith(exts):
                        self.samples.append((os.path.join(dirpath, f), self.class_to_idx[c]))
        if not self.samples:
            raise ValueError(f"root: no image files ({', '.join(exts)}) under {self.root}")
        empty = sorted(set(self.classes) - {self.classes[label] for _, label in self.samples})
        if empty and not allow_empty:
            raise FileNotFoundError(f"root: no image file ({', '.join(exts)}) in the class folders "
                                    f"{', '.join(empty)} of {self.root} (allow_empty=True keeps them)")
        self.targets = [s[1] for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int) -> tuple[bytes, int]:
        path, label = self.samples[i]
        return _read_bytes(path), label

    def describe(self, i: int) -> str:
        return self.samples[i][0]

    def file_table(self) -> FileTable | None:
        """Where the samples lie (sample i: the whole file ``samples[i][0]``), as :meth:`read`
        reads them; None for a subclass that reads otherwise. The loader's threads then read a
        chunk of files in one compiled call (NOTE [one compiled call per chunk] in
        pipeline/compiled_fill.py)."""
        if type(self).read is not ImageFolder.read or type(self).__len__ is not ImageFolder.__len__:
            return None
        return FileTable([p for p, _ in self.samples], [label for _, label in self.samples])


class ArrayDataset:
    """In-memory uint8 images: one stacked (N, H, W, C) array or a list of (H, W[, C]) arrays of
    any sizes, with ``labels`` (N ints). Arrays are used in place, never copied."""

    def __init__(self, images: np.ndarray | Sequence[np.ndarray], labels: Sequence[int]) -> None:
        n = len(images)
        if n == 0:
            raise ValueError("images: the dataset is empty")
        if len(labels) != n:
            raise ValueError(f"labels: {len(labels)} labels for {n} images")
        if isinstance(images, np.ndarray) and images.ndim not in (3, 4):
            raise ValueError(f"images: expected (N, H, W[, C]), got shape {images.shape}")
        first = np.asarray(images[0])
        if first.dtype != np.uint8:
            raise ValueError(f"images: expected uint8, got {first.dtype}")
        self.images = images
        self.labels = np.asarray(labels, np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def read(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], int(self.labels[i])

    def describe(self, i: int) -> str:
        return f"array[{i}]"


def _is_tensor(x: object) -> bool:
    # A tensor exists only where torch is imported: a source in the loader's worker process
    # (NOTE [the loader's worker process] 2) imports torch only if its dataset needs it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


class TorchDataset:
    """A map-style ``torch.utils.data.Dataset`` as a FastLoader source.

    ``dataset[i]`` must return ``(image, label)`` with image one of:

    * encoded bytes: ``bytes`` / ``bytearray`` / ``memoryview``, or a 1-D uint8 array or tensor
      (what ``torchvision.io.read_file`` returns), decoded by the loader like any file;
    * a PIL image (converted to RGB, as torchvision's ``ImageFolder`` loader does);
    * a uint8 NumPy array (H, W, C) or (H, W);
    * a uint8 CPU tensor (C, H, W) or (H, W) (read in place through a permuted view);

    and label an int (Python, NumPy or a 0-d integer tensor). Anything else raises TypeError
    naming the index; the loader reports it (and any exception of ``__getitem__``) as a
    ``SampleError`` naming ``<DatasetClass>[i]``.

    ``__getitem__`` is called from the loader's threads, several at once: it must be
    thread-safe (reading a file or indexing arrays is; a shared file handle or an unlocked
    cache is not). Its own transforms should stop at the decoded image; FastLoader's compiled
    transforms do the augmentation.
    """

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset: a map-style dataset (with __getitem__ and __len__) is needed, "
                            f"got {type(dataset).__name__}")
        self.dataset = dataset
        self._name = type(dataset).__name__

    def __len__(self) -> int:
        return len(self.dataset)

    def describe(self, i: int) -> str:
        return f"{self._name}[{i}]"

    def read(self, i: int) -> tuple[bytes | np.ndarray, int]:
        item = self.dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{self.describe(i)}: expected an (image, label) pair, got "
                            f"{type(item).__name__}")
        return self._image(i, item[0]), self._label(i, item[1])

    def _image(self, i: int, x: object) -> bytes | np.ndarray:
        if isinstance(x, (bytes, bytearray, memoryview)):
            return bytes(x)
        if isinstance(x, Image.Image):
            return np.asarray(x if x.mode == "RGB" else x.convert("RGB"))
        if _is_tensor(x):
            if str(x.dtype) != "torch.uint8" or x.device.type != "cpu":
                raise TypeError(f"{self.describe(i)}: image tensors must be uint8 on the CPU, got "
                                f"{x.dtype} on {x.device}")
            x = x.detach()
            if x.dim() == 3:
                return x.permute(1, 2, 0).numpy()  # CHW -> HWC view; no copy here
            arr = x.numpy()
        elif isinstance(x, np.ndarray):
            if x.dtype != np.uint8:
                raise TypeError(f"{self.describe(i)}: image arrays must be uint8, got {x.dtype}")
            arr = x
        else:
            raise TypeError(f"{self.describe(i)}: unsupported image type {type(x).__name__} (bytes, "
                            f"PIL image, uint8 HWC array or uint8 CHW tensor)")
        if arr.ndim == 1:
            return arr.tobytes()  # encoded file contents
        if arr.ndim not in (2, 3):
            raise TypeError(f"{self.describe(i)}: image of shape {tuple(arr.shape)}; expected "
                            f"(H, W, C) or (H, W)")
        return arr

    def _label(self, i: int, y: object) -> int:
        if _is_tensor(y):
            if y.numel() != 1 or y.dtype.is_floating_point or y.dtype.is_complex:
                raise TypeError(f"{self.describe(i)}: label must be one integer, got a "
                                f"{y.dtype} tensor of shape {tuple(y.shape)}")
            return int(y.item())
        if isinstance(y, (int, np.integer)) and not isinstance(y, bool):
            return int(y)
        raise TypeError(f"{self.describe(i)}: label must be an int, got {type(y).__name__}")
