"""16-bit floating point held as ``uint16`` bit patterns.

Numba has no CPU ``float16`` and NumPy has no ``bfloat16``, so both travel through the kernels
as ``uint16`` arrays. These helpers convert one value at a time and are meant to be called from
other compiled kernels, where LLVM inlines them and vectorizes the surrounding loop (on x86 with
F16C the half conversions become ``vcvtph2ps`` / ``vcvtps2ph``).

Rounding: float32 -> float16 and float32 -> bfloat16 round to nearest, ties to even (what
``np.float16(x)`` and ``torch.tensor(x).bfloat16()`` do); NaN stays NaN.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "F16",
    "BF16",
    "f32_bits",
    "bits_f32",
    "f16_to_f32",
    "f32_to_f16",
    "bf16_to_f32",
    "f32_to_bf16",
    "to_f32",
    "from_f32",
    "compress",
    "decompress",
]

# Kind codes for the 16-bit formats, passed to kernels that handle both.
F16 = 1
BF16 = 2


@intrinsic
def f32_bits(typingctx, x):
    """Reinterpret a float32 as its uint32 bit pattern."""
    if not isinstance(x, types.Float):
        return None
    sig = types.uint32(x)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], signature.args[0], types.float32)
        return builder.bitcast(val, ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, u):
    """Reinterpret a uint32 bit pattern as a float32."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(val, ir.FloatType())

    return sig, codegen


@intrinsic
def f16_to_f32(typingctx, h):
    """IEEE half (as integer bits) -> float32, exact."""
    if not isinstance(h, types.Integer):
        return None
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        bits = context.cast(builder, args[0], signature.args[0], types.uint16)
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> IEEE half bits (uint16), round to nearest even."""
    if not isinstance(x, types.Float):
        return None
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[0], signature.args[0], types.float32)
        return builder.bitcast(builder.fptrunc(val, ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def bf16_to_f32(h):
    """bfloat16 bits -> float32, exact."""
    return bits_f32(np.uint32(h) << np.uint32(16))


@njit(nogil=True, cache=True, inline="always")
def f32_to_bf16(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = f32_bits(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@njit(nogil=True, cache=True, inline="always")
def to_f32(h, kind):
    """16-bit bits of format ``kind`` (F16 or BF16) -> float32."""
    if kind == BF16:
        return bf16_to_f32(h)
    return f16_to_f32(h)


@njit(nogil=True, cache=True, inline="always")
def from_f32(x, kind):
    """float32 -> 16-bit bits of format ``kind`` (F16 or BF16)."""
    if kind == BF16:
        return f32_to_bf16(x)
    return f32_to_f16(x)


@njit(nogil=True, cache=True)
def compress(src, dst, kind):
    """dst[i] = float32 src[i] rounded to 16-bit ``kind`` bits (uint16 dst)."""
    for i in range(src.shape[0]):
        dst[i] = from_f32(np.float32(src[i]), kind)


@njit(nogil=True, cache=True)
def decompress(src, dst, kind):
    """dst[i] = 16-bit ``kind`` bits src[i] widened to dst's float type (exact)."""
    for i in range(src.shape[0]):
        dst[i] = to_f32(src[i], kind)
