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

import numpy as np
from numba import njit

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
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
# NOTE [scalar draws keep the GIL]
# The loader's pool threads call a few of these once per sample, from Python (the crop box, the
# flip draw). Each runs for about a microsecond. Compiled with nogil=True, every call would drop
# and retake the GIL, and with many loader threads plus the training thread each retake can queue
# behind the others: measured as lost training throughput on a 16-core machine. So these keep the
# GIL, and only kernels that run for long (resize, reductions) release it. Called from other
# compiled code the flag makes no difference.

_S11 = np.uint64(11)
_TWO_M53 = 1.0 / 9007199254740992.0  # 2**-53


@njit(nogil=True, cache=True, inline="always")
def _mulhilo(a, b):
    # 64x64 -> 128 multiply from 32-bit halves (Numba has no 128-bit integers).
    a_lo = a & _LO32
    a_hi = a >> _S32
    b_lo = b & _LO32
    b_hi = b >> _S32
    ll = a_lo * b_lo
    t = a_hi * b_lo + (ll >> _S32)
    w1 = (t & _LO32) + a_lo * b_hi
    hi = a_hi * b_hi + (t >> _S32) + (w1 >> _S32)
    return hi, a * b


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
