"""Counter-based random numbers: Philox4x64-10, keyed by (seed, epoch, sample index, op id).

Augmentation must be a pure function of *what* is being augmented, not of which thread got there
first, so there is no generator state at all: draw ``n`` for sample ``index`` of ``epoch`` by op
``op_id`` is ``philox(counter=(n // 4, index, epoch, 0), key=(seed, op_id))[n % 4]``. The same
bytes come out at any thread count, on any rank, and after a resume.

The block function is bit-identical to Random123's ``philox4x64_R(10, ...)``, which NumPy's
``np.random.Philox`` also implements (the tests compare against it).

Arithmetic note: in Numba, ``uint64 op int64`` promotes to float64, so every constant and shift
amount below is an explicit ``np.uint64``.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "philox4x64",
    "random_u64",
    "uniform",
    "randint",
    "fill_uniform",
]

_M0 = np.uint64(0xD2E7470EE14C6C93)
_M1 = np.uint64(0xCA5A826395121157)
_W0 = np.uint64(0x9E3779B97F4A7C15)
_W1 = np.uint64(0xBB67AE8584CAA73B)
# NOTE [scalar draws keep the GIL]
# The loader's pool threads call a few of these once per sample, from Python (the crop box, the
# flip draw). Each runs for about a microsecond. Compiled with nogil=True, every call would drop
# and retake the GIL, and with many loader threads plus the training thread each retake can queue
# behind the others: measured as lost training throughput on a 16-core machine. So these keep the
# GIL, and only kernels that run for long (resize, reductions) release it. Called from other
# compiled code the flag makes no difference.

_S11 = np.uint64(11)
_TWO_M53 = 1.0 / 9007199254740992.0  # 2**-53


@intrinsic
def _mulhilo(typingctx, a, b):
    """(high, low) 64-bit halves of the 128-bit product of two uint64. Numba has no 128-bit
    integers, but LLVM does: one ``mul i128`` of the zero-extended operands is one ``mulx`` (or
    ``mul``) on x86-64, where four 32-bit multiplies and their carries took 2.4x NumPy's
    Philox per block (measured, ``python -m benchmarks.kernels``)."""
    if a != types.uint64 or b != types.uint64:
        return None  # a typing error naming the argument types: callers pass np.uint64

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        hi = builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))
        lo = builder.trunc(product, ir.IntType(64))
        return context.make_tuple(builder, signature.return_type, (hi, lo))

    return types.UniTuple(types.uint64, 2)(types.uint64, types.uint64), codegen


@njit(nogil=True, cache=True)
def philox4x64(c0, c1, c2, c3, k0, k1):
    """Philox4x64 with 10 rounds: counter (c0..c3) and key (k0, k1), all uint64 -> 4 x uint64.

    From Python, values of 2**63 or more must be passed as ``np.uint64`` (Numba types a plain
    int as int64)."""
    c0 = np.uint64(c0)
    c1 = np.uint64(c1)
    c2 = np.uint64(c2)
    c3 = np.uint64(c3)
    k0 = np.uint64(k0)
    k1 = np.uint64(k1)
    for r in range(10):
        if r > 0:
            k0 = k0 + _W0
            k1 = k1 + _W1
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@njit(nogil=True, cache=True)
def random_u64(seed, epoch, index, op_id, draw):
    """The ``draw``-th uint64 of stream (seed, epoch, index, op_id). All arguments are integers
    >= 0 (they are reinterpreted as uint64)."""
    d = np.uint64(draw)
    r = philox4x64(d >> np.uint64(2), index, epoch, 0, seed, op_id)
    lane = d & np.uint64(3)
    if lane == 0:
        return r[0]
    if lane == 1:
        return r[1]
    if lane == 2:
        return r[2]
    return r[3]


@njit(cache=True)  # NOTE [scalar draws keep the GIL]
def uniform(seed, epoch, index, op_id, draw):
    """A float64 uniform on [0, 1) with 53 random bits, from the same stream as random_u64."""
    return np.float64(random_u64(seed, epoch, index, op_id, draw) >> _S11) * _TWO_M53


@njit(nogil=True, cache=True)
def randint(seed, epoch, index, op_id, draw, low, high):
    """An integer uniform on [low, high) (high > low), by multiply-shift of 53 random bits;
    the bias is below 2**-40 for ranges up to 2**13."""
    span = high - low
    v = low + np.int64(uniform(seed, epoch, index, op_id, draw) * span)
    return min(v, high - 1)


@njit(nogil=True, cache=True)
def fill_uniform(seed, epoch, index, op_id, out):
    """out[j] = uniform(seed, epoch, index, op_id, j) for a 1-D float64 ``out`` (4 draws per
    Philox block)."""
    n = out.shape[0]
    blocks = (n + 3) // 4
    for b in range(blocks):
        r = philox4x64(b, index, epoch, 0, seed, op_id)
        j = 4 * b
        out[j] = np.float64(r[0] >> _S11) * _TWO_M53
        if j + 1 < n:
            out[j + 1] = np.float64(r[1] >> _S11) * _TWO_M53
        if j + 2 < n:
            out[j + 2] = np.float64(r[2] >> _S11) * _TWO_M53
        if j + 3 < n:
            out[j + 3] = np.float64(r[3] >> _S11) * _TWO_M53
