"""Gradient compression for allreduce (horovod.torch.compression's interface).

``Compression.fp16`` on float32 tensors does not round-trip through a float16 tensor: the
values travel as float16 and are accumulated in float32 by terrapipe's reduction kernels (one
rounding, where Horovod sums in float16). Any other Compressor runs as Horovod runs it:
``compress`` before the allreduce, ``decompress`` after.
"""

from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def wire_format(compression, dtype: torch.dtype) -> tuple[str, bool]:
    """(the reduction's wire compression, whether ``compression`` must run around it instead)."""
    if compression is None or compression is NoneCompressor or isinstance(compression, NoneCompressor):
        return "", False
    if compression is FP16Compressor or isinstance(compression, FP16Compressor):
        if dtype == torch.float32:
            return "fp16", False
        return "", dtype.is_floating_point and dtype != torch.float16
    return "", True
