"""kernels/adasum.py against NumPy: shares and coefficients over pieces of fused tensors, in
every dtype, and the scaled sum they drive."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from terrapipe.kernels import BF16, F16
from terrapipe.kernels import adasum as kadasum

TINY = np.sqrt(np.finfo(np.float64).tiny)


def _bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values as the dtype's array (16-bit: uint16 bits) and those values in float64."""
    if dtype in ("float32", "float64"):
        a = x.astype(dtype)
        return a, a.astype(np.float64)
    t = torch.from_numpy(x).to(torch.float16 if dtype == "float16" else torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16), t.double().numpy()


@st.composite
def _piece(draw):
    """Tensor sizes, the fused vector's piece [lo, hi) and a dtype."""
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(bounds[-1])
    lo = draw(st.integers(0, n))
    hi = draw(st.integers(lo, n))
    return bounds, lo, hi, draw(st.sampled_from(["float32", "float64", "float16", "bfloat16"])), draw(
        st.integers(0, 2**31))


@settings(deadline=None)
@given(_piece())
def test_shares_are_each_tensors_dot_and_norms_over_the_piece(case):
    bounds, lo, hi, dtype, seed = case
    g = np.random.default_rng(seed)
    a, a64 = _bits(g.normal(size=hi - lo) * 3, dtype)
    b, b64 = _bits(g.normal(size=hi - lo) * 3, dtype)
    out = np.full((len(bounds) - 1, 3), np.nan)
    if dtype in ("float16", "bfloat16"):
        kadasum.dot_and_norms_16(a, b, lo, bounds, out, F16 if dtype == "float16" else BF16)
    else:
        kadasum.dot_and_norms(a, b, lo, bounds, out)
    for t in range(len(bounds) - 1):
        s, e = max(bounds[t], lo) - lo, min(bounds[t + 1], hi) - lo
        x, y = (a64[s:e], b64[s:e]) if e > s else (np.zeros(0), np.zeros(0))
        np.testing.assert_allclose(out[t], [x @ y, x @ x, y @ y], rtol=1e-12, atol=1e-300)


@settings(deadline=None)
@given(_piece())
def test_combine_scales_each_tensors_elements_by_its_own_coefficients(case):
    bounds, lo, hi, dtype, seed = case
    g = np.random.default_rng(seed)
    k = len(bounds) - 1
    a, a64 = _bits(g.normal(size=hi - lo), dtype)
    b, b64 = _bits(g.normal(size=hi - lo), dtype)
    ca, cb = g.uniform(-1, 2, k), g.uniform(-1, 2, k)
    want = np.empty(hi - lo)
    for t in range(k):
        s, e = max(bounds[t], lo) - lo, min(bounds[t + 1], hi) - lo
        if e > s:
            if dtype in ("float16", "bfloat16"):  # in float32, as the kernel computes them
                f32 = np.float32
                want[s:e] = f32(ca[t]) * a64[s:e].astype(f32) + f32(cb[t]) * b64[s:e].astype(f32)
            else:
                want[s:e] = ca[t] * a64[s:e] + cb[t] * b64[s:e]
    if dtype in ("float16", "bfloat16"):
        kind = F16 if dtype == "float16" else BF16
        kadasum.combine_16(a, ca, b, cb, lo, bounds, kind)
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        got = torch.from_numpy(a.view(np.int16)).view(tdt).double().numpy()
        rounded = torch.from_numpy(want.astype(np.float32)).to(tdt).double().numpy()
        np.testing.assert_array_equal(got, rounded)  # rounded once, to nearest even
    else:
        kadasum.combine(a, ca, b, cb, lo, bounds)
        np.testing.assert_array_equal(a, want.astype(dtype))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.floats(0, 1e3), st.floats(0, 1e3)),
                min_size=1, max_size=6), st.booleans())
def test_coefficients_follow_the_rule_and_leave_a_zero_vectors_partner_alone(rows, left):
    sums = np.array(rows, np.float64)
    ca, cb = np.empty(len(rows)), np.empty(len(rows))
    kadasum.coefficients(sums, left, ca, cb)
    for t, (dot, nl, nr) in enumerate(rows):
        cl = 1 - dot / (2 * nl) if nl >= TINY else 1.0
        cr = 1 - dot / (2 * nr) if nr >= TINY else 1.0
        want = (cl, cr) if left else (cr, cl)
        np.testing.assert_allclose((ca[t], cb[t]), want, rtol=1e-15)


def test_two_vectors_combine_to_their_sum_when_orthogonal_and_mean_when_parallel():
    bounds = np.array([0, 4, 8], np.int64)
    a = np.array([1.0, 0, 0, 0, 2, 4, 6, 8])
    b = np.array([0, 3.0, 0, 0, 1, 2, 3, 4])  # tensor 0 orthogonal, tensor 1 parallel
    shares = np.empty((2, 3))
    kadasum.dot_and_norms(a, b, 0, bounds, shares)
    ca, cb = np.empty(2), np.empty(2)
    kadasum.coefficients(shares, True, ca, cb)
    kadasum.combine(a, ca, b, cb, 0, bounds)
    np.testing.assert_allclose(a, [1, 3, 0, 0, 1.5, 3, 4.5, 6])
