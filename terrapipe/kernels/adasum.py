"""Adasum's two passes over one rank's piece of a fused vector of tensors.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021;
Horovod's ``op=hvd.Adasum``) combines two gradients ``a`` and ``b`` of one tensor as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is ``a + b`` for orthogonal gradients and their average for parallel ones. Across ranks a
rank holds one piece of each vector at a time (NOTE [adasum by halves] in
comm/algorithms/adasum.py), so each pass works on a piece:

* :func:`dot_and_norms` adds the piece's share of ``a.b``, ``|a|^2`` and ``|b|^2`` for each
  tensor the piece overlaps;
* :func:`combine` applies the coefficients the ranks agreed from every piece's share.

Both take the piece as elements ``lo .. lo + len(a)`` of the fused vector and ``bounds``, the
tensors' element offsets in it (``(k + 1,)`` int64: ``bounds[0] == 0``, ``bounds[k]`` the
vector's length), so a piece that spans several tensors gets each tensor's own coefficients.
float32 and float64 arrays are native; float16 and bfloat16 come as ``uint16`` bits with their
``kind`` (kernels/floats.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .floats import from_f32, to_f32

__all__ = ["dot_and_norms", "dot_and_norms_16", "combine", "combine_16", "coefficients", "tree", "tree_16"]


# NOTE [which sums may be reordered]
#     1. A float64 sum written as a loop is a chain of dependent adds, one element per add's
#        latency. Allowed to reassociate (``fastmath={"reassoc", "nsz"}``), LLVM sums in vector
#        lanes, at the pace the memory delivers the halves (several times the chain's).
#     2. Reassociated sums depend on the CPU's vector width, so two CPUs may round one sum
#        differently. That is harmless where one rank computes each share and every rank then
#        adds the same gathered shares (the pieces of comm/algorithms/adasum.py): the pieces'
#        kernels reassociate. It is not where every rank computes the same sum itself (the small
#        messages' :func:`tree`): ranks on different CPUs would derive different coefficients
#        and drift apart, so those sums keep their order.
#     3. Every loop runs over slices starting at 0 (NOTE [chunk views] in kernels/reduce.py:
#        indexing from an offset keeps LLVM from vectorizing).


@njit(nogil=True, cache=True, inline="always")
def _f64(v, kind):
    if kind:
        return np.float64(to_f32(v, kind))
    return np.float64(v)


@njit(nogil=True, cache=True, inline="always")
def _sums(x, y, kind):
    """(x.y, x.x, y.y) in float64; reordered where the caller's flags allow (NOTE [which sums
    may be reordered])."""
    d = 0.0
    p = 0.0
    q = 0.0
    for i in range(x.shape[0]):
        u = _f64(x[i], kind)
        v = _f64(y[i], kind)
        d += u * v
        p += u * u
        q += v * v
    return d, p, q


@njit(nogil=True, cache=True, inline="always")
def _shares(a, b, lo, bounds, out, kind):
    m = a.shape[0]
    for t in range(bounds.shape[0] - 1):
        s = max(bounds[t] - lo, 0)
        e = min(bounds[t + 1] - lo, m)
        out[t, 0], out[t, 1], out[t, 2] = _sums(a[s:e], b[s:e], kind) if e > s else (0.0, 0.0, 0.0)


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def dot_and_norms(a, b, lo, bounds, out):
    """``out[t] = (a.b, |a|^2, |b|^2)`` over the part of tensor ``t`` in the piece.

    a, b: (m,) float32 or float64, the same elements ``lo .. lo + m`` of two vectors (read
    only). bounds: (k + 1,) int64. out: (k, 3) float64, written whole (rows of tensors the
    piece misses are zero). The sums are float64 whatever the dtype (a float32 sum of a long
    gradient's squares loses its small terms, and the coefficients divide by them), reordered
    for speed: a piece's shares have one owner (NOTE [which sums may be reordered] 2)."""
    _shares(a, b, lo, bounds, out, 0)


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def dot_and_norms_16(a, b, lo, bounds, out, kind):
    """:func:`dot_and_norms` of float16 (``kind=F16``) or bfloat16 (``kind=BF16``) values held
    as (m,) uint16; each value widened exactly, the sums in float64."""
    _shares(a, b, lo, bounds, out, kind)


@njit(nogil=True, cache=True, inline="always")
def _scaled(x, c, y, d):
    for i in range(x.shape[0]):
        x[i] = c * np.float64(x[i]) + d * np.float64(y[i])


@njit(nogil=True, cache=True, inline="always")
def _scaled_16(x, c, y, d, kind):
    for i in range(x.shape[0]):
        x[i] = from_f32(c * to_f32(x[i], kind) + d * to_f32(y[i], kind), kind)


@njit(nogil=True, cache=True)
def combine(a, ca, b, cb, lo, bounds):
    """``a[i] = ca[t] * a[i] + cb[t] * b[i]`` for each element ``i`` of tensor ``t`` in the piece.

    a: (m,) float32 or float64, overwritten (the caller's piece). b: (m,) of a's dtype, read
    only. ca, cb: (k,) float64. Computed in float64 and rounded once to a's dtype."""
    m = a.shape[0]
    for t in range(bounds.shape[0] - 1):
        s = max(bounds[t] - lo, 0)
        e = min(bounds[t + 1] - lo, m)
        if e > s:
            _scaled(a[s:e], ca[t], b[s:e], cb[t])


@njit(nogil=True, cache=True)
def combine_16(a, ca, b, cb, lo, bounds, kind):
    """:func:`combine` of uint16-held float16 / bfloat16 values: in float32 (the coefficients
    rounded to float32 first), rounded to nearest even once per element."""
    m = a.shape[0]
    for t in range(bounds.shape[0] - 1):
        s = max(bounds[t] - lo, 0)
        e = min(bounds[t + 1] - lo, m)
        if e > s:
            _scaled_16(a[s:e], np.float32(ca[t]), b[s:e], np.float32(cb[t]), kind)


# Below this a squared norm counts as zero, and its vector's coefficient is 1: a zero gradient
# (a rank with nothing for a tensor) leaves the other unchanged instead of dividing by zero.
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


@njit(nogil=True, cache=True)
def coefficients(sums, left, ca, cb):
    """The two coefficients of each tensor from its summed ``(a.b, |left|^2, |right|^2)``.

    sums: (k, 3) float64, every piece's share summed. left: whether the caller's vector ``a``
    is the left one. ca, cb: (k,) float64 out, the caller's vector's coefficient and the
    other's."""
    for t in range(sums.shape[0]):
        dot = sums[t, 0]
        cl = 1.0 - 0.5 * dot / sums[t, 1] if sums[t, 1] >= _TINY else 1.0
        cr = 1.0 - 0.5 * dot / sums[t, 2] if sums[t, 2] >= _TINY else 1.0
        if left:
            ca[t], cb[t] = cl, cr
        else:
            ca[t], cb[t] = cr, cl


@njit(nogil=True, cache=True)
def tree(rows, bounds, shares, ca, cb):
    """The whole Adasum tree of ``rows`` into ``rows[0]``: row i with row i + 1, then the
    results two apart, and so on (NOTE [adasum by halves] 1 in comm/algorithms/adasum.py).

    rows: (p, N) float32 or float64, p a power of two, every rank's fused vector (overwritten).
    bounds: (k + 1,) int64. shares: (k, 3), ca, cb: (k,) float64 scratch. Every rank runs it
    on the same rows, so its sums keep their order (NOTE [which sums may be reordered] 2)."""
    p = rows.shape[0]
    step = 1
    while step < p:
        for i in range(0, p, 2 * step):
            _shares(rows[i], rows[i + step], 0, bounds, shares, 0)
            coefficients(shares, True, ca, cb)
            combine(rows[i], ca, rows[i + step], cb, 0, bounds)
        step *= 2


@njit(nogil=True, cache=True)
def tree_16(rows, bounds, shares, ca, cb, kind):
    """:func:`tree` of uint16-held float16 / bfloat16 rows (``kind``)."""
    p = rows.shape[0]
    step = 1
    while step < p:
        for i in range(0, p, 2 * step):
            _shares(rows[i], rows[i + step], 0, bounds, shares, kind)
            coefficients(shares, True, ca, cb)
            combine_16(rows[i], ca, rows[i + step], cb, 0, bounds, kind)
        step *= 2
