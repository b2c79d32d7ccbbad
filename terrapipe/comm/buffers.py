"""User arrays and tensors as flat NumPy views the kernels and MPI can work on.

A :class:`Buffer` wraps a NumPy array or torch tensor (any dtype the kernels reduce, contiguous
or not, CPU or CUDA). ``flat`` is a 1-D view of host memory holding its values; after a
collective writes ``flat``, :meth:`Buffer.commit` puts the result back where the caller expects
it (a no-op for contiguous CPU data, a copy for strided or device tensors).
"""

from __future__ import annotations

import sys

import numpy as np

from ..kernels import BF16, F16
from . import dtypes

__all__ = ["Buffer", "plain_array", "dtype_name"]

_NP_NAMES = {np.dtype(n): n for n in dtypes.MOVED if n != "bfloat16"}


def _torch():
    import torch

    return torch


def dtype_name(dtype: np.dtype) -> str | None:
    """The name a :class:`Buffer` of a NumPy array of ``dtype`` gives its dtype (comm/dtypes.py),
    or None where comm does not move it."""
    return _NP_NAMES.get(dtype)


def plain_array(x) -> np.ndarray | None:
    """``x`` as a NumPy array sharing its memory when that needs no copy and no dtype trick (a
    C-contiguous array, or a contiguous CPU tensor without grad whose dtype NumPy has), else
    None. For latency paths that skip :class:`Buffer`."""
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous else None
    torch = sys.modules.get("torch")  # a tensor implies torch is imported; no import per call
    if (torch is not None and isinstance(x, torch.Tensor) and x.is_cpu and not x.requires_grad
            and x.is_contiguous() and x.dtype is not torch.bfloat16):
        return x.numpy()
    return None


class Buffer:
    """Flat host view of ``x``. Attributes: flat (1-D ndarray), shape, dtype_name, kind (0 native,
    F16, BF16: how the reduce kernels read it), is_torch."""

    def __init__(self, x, name: str = "tensor") -> None:
        self.orig = x
        self.is_torch = False
        self._host = None
        if isinstance(x, np.ndarray):
            self.shape = x.shape
            arr = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            self._host = None if arr is x else arr
            self.dtype_name = _NP_NAMES.get(arr.dtype) or str(arr.dtype)
            flat = arr.reshape(-1)
            self.flat = flat.view(np.uint16) if arr.dtype == np.float16 else flat
        else:
            torch = _torch()
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")
            self.is_torch = True
            self.shape = tuple(x.shape)
            t = x.detach() if x.requires_grad else x
            host = t
            if not t.is_cpu:
                host = t.to("cpu")  # staged through host memory; committed back with copy_
            elif not t.is_contiguous():
                host = t.contiguous()
            self._host = None if host is t else host
            as16 = t.dtype in (torch.float16, torch.bfloat16)
            # numpy() of the whole tensor, then a NumPy reshape: torch's reshape costs 1 us more.
            flat = (host.view(torch.int16) if as16 else host).numpy().reshape(-1)
            if as16:
                self.flat = flat.view(np.uint16)
                self.dtype_name = "bfloat16" if t.dtype == torch.bfloat16 else "float16"
            else:
                self.flat = flat
                self.dtype_name = _NP_NAMES.get(flat.dtype) or str(flat.dtype)
        if self.dtype_name not in dtypes.MOVED:
            raise TypeError(f"{name}: unsupported dtype {self.dtype_name}")
        self.kind = {"float16": F16, "bfloat16": BF16}.get(self.dtype_name, 0)

    @property
    def size(self) -> int:
        return self.flat.shape[0]

    def commit(self) -> None:
        """Write ``flat`` back into the caller's array/tensor if it is not already its memory."""
        if self._host is None:
            return
        if self.is_torch:
            self.orig.copy_(self._host.reshape(self.orig.shape))
        else:
            self.orig[...] = self._host.reshape(self.orig.shape)

    def like(self, shape: tuple[int, ...]):
        """A new CPU array/tensor of this buffer's type (torch if the input was), and its Buffer."""
        if self.is_torch:
            torch = _torch()
            t = torch.empty(shape, dtype=self.orig.dtype)
            return t, Buffer(t)
        a = np.empty(shape, self.orig.dtype)
        return a, Buffer(a)
