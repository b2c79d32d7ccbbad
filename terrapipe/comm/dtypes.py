"""The element types terrapipe.comm moves: one table.

A call's signature carries its dtype's ``code`` (so a mismatch names the dtype of every rank);
``reduced`` says whether the reduction kernels reduce it (``kernels.reduce``: 32/64-bit floats
and ints, and float16/bfloat16 accumulated in float32), else it only travels (broadcast, gather,
scatter, allgather). The torch.distributed backend asks here which tensors it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DType", "DTYPES", "by_name", "by_code", "MOVED"]


@dataclass(frozen=True)
class DType:
    name: str      # NumPy's and torch's name (torch.<name>); bfloat16 travels as uint16 bits
    code: int      # in a call's signature; never reused
    reduced: bool  # the reduction kernels reduce it


DTYPES = (
    DType("float32", 1, True),
    DType("float64", 2, True),
    DType("float16", 3, True),
    DType("bfloat16", 4, True),
    DType("int32", 5, True),
    DType("int64", 6, True),
    DType("uint8", 7, False),
    DType("int8", 8, False),
    DType("int16", 9, False),
    DType("uint16", 10, False),
    DType("bool", 11, False),
)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_CODE = {d.code: d for d in DTYPES}
MOVED = frozenset(_BY_NAME)  # names every collective moves


def by_name(name: str) -> DType | None:
    """The entry of dtype ``name`` (``"float32"``), or None for one terrapipe does not move."""
    return _BY_NAME.get(name)


def by_code(code: int) -> DType | None:
    """The entry whose signature code is ``code``, or None."""
    return _BY_CODE.get(code)
