"""Transforms: declarations that compile into one per-sample plan.

A transform never runs on pixels itself. Each one *declares* what it contributes (FFCV's
operations declare their output state and memory the same way): given the :class:`SampleSpec`
it receives, it records in the draft plan its part (a crop-box function, the flip probability,
the per-channel lookup table) and returns the spec it hands on (output size, channels, dtype).
:func:`compile_plan` asks each transform in turn and freezes the result into a :class:`Plan`;
the loader sizes every buffer from the final spec and runs one compiled kernel per sample
(:func:`terrapipe.kernels.image.resize_crop_bilinear_region`) that writes the sample's slot.
Adding a transform touches its own class only.

Accepted order (each transform's ``stage``): a geometry (``RandomResizedCrop``, or ``Resize``
and/or ``CenterCrop``; none means every image must have the same size), then
``RandomHorizontalFlip``, then ``Normalize``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..kernels import geometry, image, rng

if TYPE_CHECKING:
    import torch

__all__ = [
    "Transform",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Normalize",
    "SampleSpec",
    "Plan",
    "compile_plan",
    "BOX_UNNAMED",
    "BOX_WHOLE",
    "BOX_RANDOM_RESIZED_CROP",
    "BOX_RESIZE_CENTER_CROP",
]

# op ids: independent random streams per kind of draw.
_OP_CROP = 1
_OP_FLIP = 2

# The box rules a plan may name (Plan.box_kind), for compiled callers that draw the box
# themselves (pipeline/compiled_fill.py); each rule's parameters go in Plan.box_args. A
# geometry that names none leaves BOX_UNNAMED: its box_fn only draws it, and compiled callers
# leave such plans to the per-sample path.
BOX_UNNAMED, BOX_WHOLE, BOX_RANDOM_RESIZED_CROP, BOX_RESIZE_CENTER_CROP = -1, 0, 1, 2

# stages, in the order a chain must follow
_GEOMETRY, _FLIP, _NORMALIZE = 0, 1, 2
_STAGE_NAMES = {_GEOMETRY: "a crop/resize", _FLIP: "a flip", _NORMALIZE: "Normalize"}

BoxFn = Callable[[int, int, int, int, int], tuple[float, float, float, float]]


@dataclass(frozen=True)
class SampleSpec:
    """A sample as it leaves a transform.

    out_hw: fixed (H, W), or None while every source image keeps its own size; channels: C;
    dtype: the name of the element type the loader's batch buffer holds ("uint8" until
    ``Normalize``; a name, not a torch.dtype, so the loader's worker process compiles a plan
    without importing torch: NOTE [the loader's worker process] 2).
    """

    out_hw: tuple[int, int] | None
    channels: int
    dtype: str = "uint8"


@dataclass
class _Draft:
    """What the transforms declared so far (mutable while compiling, frozen into a Plan)."""

    box: BoxFn | None = None
    box_kind: int = BOX_UNNAMED
    box_args: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    resize: int = 0  # shorter side a CenterCrop applies first (Resize)
    unfinished: str = ""  # the error to raise if the chain ends here
    flip_p: float = 0.0
    lut: np.ndarray | None = None
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None


class Transform:
    """One step of the per-sample chain: ``declare`` says what it does, nothing runs here."""

    stage: ClassVar[int]

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:  # pragma: no cover
        raise NotImplementedError


def _size2(name: str, size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size, int):
        size = (size, size)
    if len(size) != 2 or any(int(s) <= 0 for s in size):
        raise ValueError(f"{name}: size must be a positive int or (h, w), got {size!r}")
    return int(size[0]), int(size[1])


class RandomResizedCrop(Transform):
    """torchvision semantics: area fraction in ``scale``, aspect ratio log-uniform in ``ratio``,
    10 attempts then a central crop; output ``size`` (int or (h, w))."""

    stage = _GEOMETRY

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> None:
        self.size = _size2("RandomResizedCrop", size)
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must satisfy 0 < lo <= hi, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must satisfy 0 < lo <= hi, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self._logr = (math.log(self.ratio[0]), math.log(self.ratio[1]))

    def box(self, w: int, h: int, seed: int, epoch: int, index: int) -> tuple[float, float, float, float]:
        return geometry.random_resized_crop_box(w, h, self.scale[0], self.scale[1], *self._logr,
                                                seed, epoch, index, _OP_CROP)

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:
        if draft.box is not None or draft.resize:
            raise ValueError("transforms: RandomResizedCrop cannot follow another geometry")
        draft.box = self.box
        draft.box_kind = BOX_RANDOM_RESIZED_CROP
        draft.box_args = (self.scale[0], self.scale[1], *self._logr)
        return dataclasses.replace(spec, out_hw=self.size)


class Resize(Transform):
    """Resize the shorter side to ``size`` (an int), keeping the aspect ratio; a ``CenterCrop``
    must follow so every sample has one size (batches are fixed-shape)."""

    stage = _GEOMETRY

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"Resize: size must be a positive int (shorter side), got {size!r}")
        self.size = size

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:
        if draft.box is not None or draft.resize:
            raise ValueError("transforms: Resize must come first, once")
        draft.resize = self.size
        draft.unfinished = ("transforms: Resize needs a CenterCrop after it so every sample has one "
                            "size (batches are fixed-shape)")
        return spec


class CenterCrop(Transform):
    """The central (h, w) region, after a ``Resize`` if one precedes it (one resampling pass)."""

    stage = _GEOMETRY

    def __init__(self, size) -> None:
        self.size = _size2("CenterCrop", size)
        self._resize = 0

    def box(self, w: int, h: int, seed: int, epoch: int, index: int) -> tuple[float, float, float, float]:
        return geometry.resize_center_crop_box(w, h, self._resize, *self.size)

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:
        if draft.box is not None:
            raise ValueError("transforms: CenterCrop cannot follow RandomResizedCrop/CenterCrop")
        crop = CenterCrop(self.size)  # the compiled copy carries the Resize; self stays reusable
        crop._resize = draft.resize
        draft.box, draft.unfinished = crop.box, ""
        draft.box_kind = BOX_RESIZE_CENTER_CROP
        draft.box_args = (float(draft.resize), float(self.size[0]), float(self.size[1]), 0.0)
        return dataclasses.replace(spec, out_hw=self.size)


class RandomHorizontalFlip(Transform):
    stage = _FLIP

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = float(p)

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:
        draft.flip_p = self.p
        return spec


_DTYPES = ("float32", "float16", "bfloat16", "float64")  # Normalize's output dtypes, by name


def _torch_dtype(name: str) -> torch.dtype:
    import torch  # the caller yields tensors: torch is imported there already

    return getattr(torch, name)


class Normalize(Transform):
    """``(x / 255 - mean) / std`` per channel, output ``dtype`` (torch.float32, float16, bfloat16
    or float64, or its name: "float16"). Without it the loader yields uint8."""

    stage = _NORMALIZE

    def __init__(self, mean, std, dtype: torch.dtype | str = "float32") -> None:
        name = str(dtype).removeprefix("torch.")  # a torch.dtype, kept by name (SampleSpec)
        if name not in _DTYPES:
            raise ValueError(f"Normalize: dtype must be one of torch.{', torch.'.join(_DTYPES)}, got {dtype}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std):
            raise ValueError(f"Normalize: {len(self.mean)} means but {len(self.std)} stds")
        if any(s == 0 for s in self.std):
            raise ValueError(f"Normalize: std must be non-zero, got {self.std}")
        self.dtype_name = name

    @property
    def dtype(self) -> torch.dtype:
        """The output dtype (a torch.dtype)."""
        return _torch_dtype(self.dtype_name)

    def declare(self, spec: SampleSpec, draft: _Draft) -> SampleSpec:
        if draft.norm is not None:
            raise ValueError("transforms: Normalize given twice")
        c = spec.channels
        if len(self.mean) not in (1, c):
            raise ValueError(f"Normalize: {len(self.mean)} channel means for {c}-channel images")
        mean = np.broadcast_to(np.asarray(self.mean), (c,))
        std = np.broadcast_to(np.asarray(self.std), (c,))
        draft.lut = image.build_normalize_lut(mean, std, self.dtype_name)
        draft.norm = (tuple(float(m) for m in mean), tuple(float(s) for s in std))
        return dataclasses.replace(spec, dtype=self.dtype_name)


def _whole_image(w: int, h: int, seed: int, epoch: int, index: int) -> tuple[float, float, float, float]:
    return 0.0, 0.0, float(w), float(h)


@dataclass(frozen=True)
class Plan:
    """The compiled per-sample chain; immutable, shared by every loader thread.

    out_hw: (H, W) of every output sample, or None for "source size" (no geometry: the loader
    makes a copy with the size it finds, :meth:`with_size`); lut: (C, 256) table of the kernel's
    output dtype (uint8 identity without Normalize); dtype: the yielded image dtype's name
    (:attr:`torch_dtype` the torch.dtype); norm: per-channel (mean, std) in [0, 1] units, or
    None; box_kind, box_args: the rule ``box_fn`` follows (``BOX_*``) and its parameters, for
    compiled callers.
    """

    out_hw: tuple[int, int] | None
    channels: int
    box_fn: BoxFn
    flip_p: float
    lut: np.ndarray
    dtype: str
    norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    box_kind: int = BOX_UNNAMED
    box_args: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The yielded image dtype."""
        return _torch_dtype(self.dtype)

    def box(self, w: int, h: int, seed: int, epoch: int, index: int) -> tuple[float, ...]:
        """Crop box (x0, y0, x1, y1) in source pixels for sample ``index`` (drawn before decode)."""
        return self.box_fn(w, h, seed, epoch, index)

    def flip(self, seed: int, epoch: int, index: int) -> bool:
        return self.flip_p > 0 and rng.uniform(seed, epoch, index, _OP_FLIP, 0) < self.flip_p

    def with_size(self, out_hw: tuple[int, int]) -> Plan:
        return dataclasses.replace(self, out_hw=(int(out_hw[0]), int(out_hw[1])))


def compile_plan(transforms: Sequence[Transform], channels: int = 3) -> Plan:
    """Check the transform list and fold it into a :class:`Plan` (ValueError names the problem)."""
    spec = SampleSpec(None, channels)
    draft = _Draft()
    stage = _GEOMETRY
    for t in transforms:
        if not isinstance(t, Transform):
            raise ValueError(f"transforms: unsupported transform {t!r} (terrapipe.pipeline's "
                             f"transforms compile into one kernel per sample)")
        if t.stage < stage:
            raise ValueError(f"transforms: {type(t).__name__} must come before {_STAGE_NAMES[stage]}")
        stage = t.stage
        spec = t.declare(spec, draft)
    if draft.unfinished:
        raise ValueError(draft.unfinished)
    lut = draft.lut if draft.lut is not None else image.identity_lut(channels)
    # No geometry: the whole image, a rule compiled callers draw too; else the geometry's own.
    box_kind = BOX_WHOLE if draft.box is None else draft.box_kind
    return Plan(spec.out_hw, channels, draft.box or _whole_image, draft.flip_p, lut, spec.dtype,
                draft.norm, box_kind, draft.box_args)
