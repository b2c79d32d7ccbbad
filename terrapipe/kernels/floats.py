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


# NOTE [conversions as intrinsics]
#     The conversions below emit their LLVM IR straight into the caller (``@intrinsic``; the
#     bfloat16 ones and to_f32 / from_f32 were compiled functions inlined by Numba,
#     ``inline="always"``), each format's IR written once in a ``_*_ir`` helper. Numba inlines by
#     copying the callee's IR into the caller and typing it again, once per call site, and a
#     16-bit loop calls them several times in each of its format's and op's copies: a pair
#     kernel's three loops took 7-9 s to compile that way and 2-3 s as intrinsics, with the same
#     bits and the same speed per element (2-core Xeon, 64K elements). ``kind`` is a value at
#     run time: where the caller passes a constant (typed as a literal) only that format's IR
#     is emitted, else a select of both (:func:`_choose`).

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _bf16_to_f32_ir(builder, bits):
    """i16 bfloat16 bits -> float (exact: the bits are float32's upper half)."""
    return builder.bitcast(builder.shl(builder.zext(bits, _I32), ir.Constant(_I32, 16)), ir.FloatType())


def _f16_to_f32_ir(builder, bits):
    """i16 IEEE half bits -> float (exact)."""
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


def _f32_to_bf16_ir(builder, x):
    """float -> i16 bfloat16 bits, round to nearest even; a NaN stays a quiet NaN."""
    u = builder.bitcast(x, _I32)
    upper = builder.lshr(u, ir.Constant(_I32, 16))
    nan = builder.icmp_unsigned(">", builder.and_(u, ir.Constant(_I32, 0x7FFFFFFF)),
                                ir.Constant(_I32, 0x7F800000))
    quiet = builder.or_(upper, ir.Constant(_I32, 0x40))
    lsb = builder.and_(upper, ir.Constant(_I32, 1))
    rounded = builder.lshr(builder.add(builder.add(u, ir.Constant(_I32, 0x7FFF)), lsb), ir.Constant(_I32, 16))
    return builder.trunc(builder.select(nan, quiet, rounded), _I16)


def _f32_to_f16_ir(builder, x):
    """float -> i16 IEEE half bits, round to nearest even (LLVM's fptrunc)."""
    return builder.bitcast(builder.fptrunc(x, ir.HalfType()), _I16)


def _choose(context, builder, kind, kind_type, bf16, f16):
    """``bf16()`` where ``kind`` is BF16, else ``f16()``: only one of them emitted where the kind
    is a constant the caller typed as a literal (a loop per format), a select of both else."""
    if isinstance(kind_type, types.IntegerLiteral):
        return bf16() if kind_type.literal_value == BF16 else f16()
    is_bf16 = builder.icmp_signed("==", context.cast(builder, kind, kind_type, types.int64),
                                  ir.Constant(_I64, BF16))
    return builder.select(is_bf16, bf16(), f16())


@intrinsic
def f16_to_f32(typingctx, h):
    """IEEE half (as integer bits) -> float32, exact."""
    if not isinstance(h, types.Integer):
        return None
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        return _f16_to_f32_ir(builder, context.cast(builder, args[0], signature.args[0], types.uint16))

    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> IEEE half bits (uint16), round to nearest even."""
    if not isinstance(x, types.Float):
        return None
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return _f32_to_f16_ir(builder, context.cast(builder, args[0], signature.args[0], types.float32))

    return sig, codegen


@intrinsic
def bf16_to_f32(typingctx, h):
    """bfloat16 bits -> float32, exact."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return _bf16_to_f32_ir(builder, context.cast(builder, args[0], signature.args[0], types.uint16))

    return types.float32(h), codegen


@intrinsic
def f32_to_bf16(typingctx, x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        return _f32_to_bf16_ir(builder, context.cast(builder, args[0], signature.args[0], types.float32))

    return types.uint16(x), codegen


@intrinsic
def to_f32(typingctx, h, kind):
    """16-bit bits of format ``kind`` (F16 or BF16) -> float32, exact."""
    if not isinstance(h, types.Integer) or not isinstance(kind, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bits = context.cast(builder, args[0], signature.args[0], types.uint16)
        return _choose(context, builder, args[1], signature.args[1], lambda: _bf16_to_f32_ir(builder, bits),
                       lambda: _f16_to_f32_ir(builder, bits))

    return types.float32(h, kind), codegen


@intrinsic
def from_f32(typingctx, x, kind):
    """float32 -> 16-bit bits of format ``kind`` (F16 or BF16), round to nearest even (a wider
    float is rounded to float32 first)."""
    if not isinstance(x, types.Float) or not isinstance(kind, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.float32)
        return _choose(context, builder, args[1], signature.args[1], lambda: _f32_to_bf16_ir(builder, v),
                       lambda: _f32_to_f16_ir(builder, v))

    return types.uint16(x, kind), codegen


@njit(nogil=True, cache=True)
def compress(src, dst, kind):
    """dst[i] = float32 src[i] rounded to 16-bit ``kind`` bits (uint16 dst). The format's
    branch outside the loop: each loop converts one way only."""
    if kind == BF16:
        for i in range(src.shape[0]):
            dst[i] = from_f32(np.float32(src[i]), BF16)
    else:
        for i in range(src.shape[0]):
            dst[i] = from_f32(np.float32(src[i]), F16)


@njit(nogil=True, cache=True)
def decompress(src, dst, kind):
    """dst[i] = 16-bit ``kind`` bits src[i] widened to dst's float type (exact); the format's
    branch outside the loop."""
    if kind == BF16:
        for i in range(src.shape[0]):
            dst[i] = to_f32(src[i], BF16)
    else:
        for i in range(src.shape[0]):
            dst[i] = to_f32(src[i], F16)
