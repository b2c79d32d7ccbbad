"""Transforms: declarations that compile into one per-sample plan.

Each transform only declares what it does; :func:`compile_plan` checks the list and folds it
into a :class:`Plan`: how to pick the crop box from the source size (before decode), the output
size, the flip probability and the lookup table that maps resampled uint8 values to the output
dtype. The loader then runs one compiled kernel per sample
(:func:`terrapipe.kernels.image.resize_crop_bilinear`) that writes the sample's slot.

Accepted order: a geometry (``RandomResizedCrop``, or ``Resize`` and/or ``CenterCrop``; none
means every image must have the same size), then ``RandomHorizontalFlip``, then ``Normalize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import geometry, image, rng

__all__ = [
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
    "Plan",
    "compile_plan",
]

# op ids: independent random streams per kind of draw.
_OP_CROP = 1
_OP_FLIP = 2


def _size2(name: str, size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int):
        size = (size, size)
    if len(size) != 2 or any(int(s) <= 0 for s in size):
        raise ValueError(f"{name}: size must be a positive int or (h, w), got {size!r}")
    return int(size[0]), int(size[1])


class RandomResizedCrop:
    """torchvision semantics: area fraction in ``scale``, aspect ratio log-uniform in ``ratio``,
    10 attempts then a central crop; output ``size`` (int or (h, w))."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> None:
        self.size = _size2("RandomResizedCrop", size)
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must satisfy 0 < lo <= hi, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must satisfy 0 < lo <= hi, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))


class Resize:
    """Resize the shorter side to ``size`` (an int), keeping the aspect ratio."""

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"Resize: size must be a positive int (shorter side), got {size!r}")
        self.size = size


class CenterCrop:
    def __init__(self, size) -> None:
        self.size = _size2("CenterCrop", size)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = float(p)


_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.float64: "float64"}


class Normalize:
    """``(x / 255 - mean) / std`` per channel, output ``dtype`` (float32, float16, bfloat16,
    float64). Without it the loader yields uint8."""

    def __init__(self, mean, std, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"Normalize: dtype must be one of {list(_DTYPES)}, got {dtype}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std):
            raise ValueError(f"Normalize: {len(self.mean)} means but {len(self.std)} stds")
        if any(s == 0 for s in self.std):
            raise ValueError(f"Normalize: std must be non-zero, got {self.std}")
        self.dtype = dtype


@dataclass
class Plan:
    """The compiled per-sample chain. ``out_hw`` None means "source size" (no geometry)."""

    out_hw: tuple[int, int] | None
    channels: int
    rrc: RandomResizedCrop | None
    resize: int
    center: tuple[int, int] | None
    flip_p: float
    lut: np.ndarray  # (C, 256) of the kernel's output dtype
    torch_dtype: torch.dtype
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # per-channel (mean, std)

    def box(self, w: int, h: int, seed: int, epoch: int, index: int) -> tuple[float, ...]:
        """Crop box (x0, y0, x1, y1) in source pixels for sample ``index`` (drawn before decode)."""
        if self.rrc is not None:
            r = self.rrc
            return geometry.random_resized_crop_box(
                w, h, r.scale[0], r.scale[1], math.log(r.ratio[0]), math.log(r.ratio[1]),
                seed, epoch, index, _OP_CROP)
        if self.center is None:  # no geometry (compile_plan rejects Resize without CenterCrop)
            return 0.0, 0.0, float(w), float(h)
        return geometry.resize_center_crop_box(w, h, self.resize, *self.center)

    def flip(self, seed: int, epoch: int, index: int) -> bool:
        return self.flip_p > 0 and rng.uniform(seed, epoch, index, _OP_FLIP, 0) < self.flip_p


def compile_plan(transforms, channels: int = 3) -> Plan:
    """Check the transform list and fold it into a :class:`Plan` (ValueError names the problem)."""
    rrc = None
    resize = 0
    center = None
    flip_p = 0.0
    norm = None
    stage = 0  # 0 geometry, 1 flip, 2 normalize: each stage only after the previous ones
    for t in transforms:
        if isinstance(t, (RandomResizedCrop, Resize, CenterCrop)):
            if stage > 0:
                raise ValueError(f"transforms: {type(t).__name__} must come before flip/normalize")
            if isinstance(t, RandomResizedCrop):
                if rrc or resize or center:
                    raise ValueError("transforms: RandomResizedCrop cannot follow another geometry")
                rrc = t
            elif isinstance(t, Resize):
                if rrc or center or resize:
                    raise ValueError("transforms: Resize must come first, once")
                resize = t.size
            else:
                if rrc or center:
                    raise ValueError("transforms: CenterCrop cannot follow RandomResizedCrop/CenterCrop")
                center = t.size
        elif isinstance(t, RandomHorizontalFlip):
            if stage > 1:
                raise ValueError("transforms: RandomHorizontalFlip must come before Normalize")
            stage = 1
            flip_p = t.p
        elif isinstance(t, Normalize):
            if norm is not None:
                raise ValueError("transforms: Normalize given twice")
            stage = 2
            norm = t
        else:
            raise ValueError(f"transforms: unsupported transform {t!r}")
    if resize and center is None:
        raise ValueError("transforms: Resize needs a CenterCrop after it so every sample has one "
                         "size (batches are fixed-shape)")
    out_hw = rrc.size if rrc else center
    if norm is not None:
        if len(norm.mean) not in (1, channels):
            raise ValueError(f"Normalize: {len(norm.mean)} channel means for {channels}-channel images")
        mean = np.broadcast_to(np.asarray(norm.mean), (channels,))
        std = np.broadcast_to(np.asarray(norm.std), (channels,))
        lut = image.build_normalize_lut(mean, std, _DTYPES[norm.dtype])
        tdtype = norm.dtype
        mean_std = (tuple(float(m) for m in mean), tuple(float(s) for s in std))
    else:
        lut = image.identity_lut(channels)
        tdtype = torch.uint8
        mean_std = None
    return Plan(out_hw, channels, rrc, resize, center, flip_p, lut, tdtype, mean_std)
