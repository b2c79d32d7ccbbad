import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from terrapipe.kernels.floats import BF16, F16
from terrapipe.kernels.reduce import (
    OPS as OP_CODES,
)
from terrapipe.kernels.reduce import (
    TILE,
    allreduce_rows,
    divide,
    reduce_into,
    reduce_many_16,
    reduce_many_into,
    reduce_many_native,
    reduce_pair,
    reduce_rows_into,
)

NATIVE = [np.float32, np.float64, np.int32, np.int64]
DTYPES = NATIVE + [np.float16, "bfloat16"]
OPS = ["sum", "avg", "min", "max", "prod"]


def _make(rng, n, dtype, k=1):
    """k random arrays of n elements; bfloat16 as uint16 bits. Small integers keep prod exact."""
    if dtype == "bfloat16":
        x = rng.uniform(-4, 4, (k, n)).astype(np.float32)
        return torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-5, 6, (k, n)).astype(dtype)
    return rng.uniform(-4, 4, (k, n)).astype(dtype)


def _as_f64(a, dtype):
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).double().numpy()
    return a.astype(np.float64)


def _round(x64, dtype):
    """Reference rounding of a float64 result back to the storage type."""
    if dtype == "bfloat16":
        return torch.from_numpy(x64.astype(np.float32)).bfloat16().double().numpy()
    if dtype == np.float16:  # computed in float32, rounded once to half
        return x64.astype(np.float32).astype(np.float16).astype(np.float64)
    return x64.astype(dtype).astype(np.float64)


# k rows of n native elements, an op, and hypothesis' data for the rest
_ROWS = given(n=st.integers(0, 2 * TILE + 3), k=st.integers(1, 5), dtype=st.sampled_from(NATIVE),
              op=st.sampled_from(OPS), data=st.data())


def _draw_chunk(data, n: int) -> tuple[int, int]:
    """(offset, length) of a chunk of an n-element array, drawn by hypothesis."""
    offset = data.draw(st.integers(0, n))
    return offset, data.draw(st.integers(0, n - offset))


_NP = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


@given(
    n=st.integers(0, 3 * TILE + 5),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    data=st.data(),
)
def test_reduce_into_matches_numpy_on_a_chunk(n, dtype, op, data):
    rng = np.random.default_rng(n)
    dst, src = _make(rng, n, dtype, 2)
    offset, length = _draw_chunk(data, n)
    before = dst.copy()
    reduce_into(dst, src, op, offset=offset, length=length,
                dtype="bfloat16" if dtype == "bfloat16" else None)
    sl = slice(offset, offset + length)
    a, b = _as_f64(before, dtype), _as_f64(src, dtype)
    ref = _round(_NP[op](a, b), dtype)
    if np.dtype(dtype if dtype != "bfloat16" else np.uint16).kind == "i":
        ref = _NP[op](before.astype(np.int64), src.astype(np.int64)).astype(dtype)
        np.testing.assert_array_equal(dst[sl], ref[sl])
    else:
        np.testing.assert_array_equal(_as_f64(dst, dtype)[sl], ref[sl])
    # Outside the chunk nothing moved.
    np.testing.assert_array_equal(dst[:offset], before[:offset])
    np.testing.assert_array_equal(dst[offset + length:], before[offset + length:])


@given(
    n=st.integers(0, 2 * TILE + 3),
    k=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    data=st.data(),
)
def test_reduce_many_into_matches_numpy(n, k, dtype, op, data):
    rng = np.random.default_rng(n * 7 + k)
    srcs = _make(rng, n, dtype, k)
    dst = np.zeros(n, srcs.dtype)
    offset, length = _draw_chunk(data, n)
    reduce_many_into(dst, srcs, op, offset=offset, length=length,
                     dtype="bfloat16" if dtype == "bfloat16" else None)
    sl = slice(offset, offset + length)
    if dtype in (np.int32, np.int64):
        ref = _NP[op].reduce(srcs.astype(np.int64), axis=0).astype(dtype)
        np.testing.assert_array_equal(dst[sl], ref[sl])
        return
    x = _as_f64(srcs, dtype)
    if dtype in (np.float16, "bfloat16"):
        # float32 accumulation, one rounding at the end.
        acc = x[0].astype(np.float32)
        for r in range(1, k):
            acc = _NP[op](acc, x[r].astype(np.float32))
        ref = _round(acc.astype(np.float64), dtype)
        np.testing.assert_array_equal(_as_f64(dst, dtype)[sl], ref[sl])
    else:
        ref = _NP[op].reduce(srcs, axis=0)
        np.testing.assert_allclose(dst[sl], ref[sl], rtol=1e-6 if dtype == np.float32 else 1e-12)
    assert not np.any(dst[:offset]) and not np.any(dst[offset + length:])


@_ROWS
def test_reduce_rows_into_equals_the_row_kernel_bit_for_bit(n, k, dtype, op, data):
    # The one-shot allreduce writes its result with reduce_rows_into where it used a scratch row
    # and a copy: the bytes must not change (ranks and paths are compared bit for bit).
    rng = np.random.default_rng(n * 5 + k)
    rows = _make(rng, n, dtype, k)
    offset, length = _draw_chunk(data, n)
    out = np.full(length + 3, 99, rows.dtype)  # longer than the result: the tail stays
    reduce_rows_into(out, rows, OP_CODES[op], offset, length)
    scratch = np.zeros(n, rows.dtype)
    reduce_many_native(scratch, rows, OP_CODES[op], offset, length)
    np.testing.assert_array_equal(out[:length], scratch[offset:offset + length])
    if dtype in (np.int32, np.int64):
        ref = _NP[op].reduce(rows.astype(np.int64), axis=0)[offset:offset + length].astype(dtype)
        np.testing.assert_array_equal(out[:length], ref)
    else:
        np.testing.assert_allclose(out[:length], _NP[op].reduce(rows, axis=0)[offset:offset + length],
                                   rtol=1e-6 if dtype == np.float32 else 1e-12)
    assert np.all(out[length:] == 99)


@_ROWS
def test_allreduce_rows_equals_reduce_divide_copy_bit_for_bit(n, k, dtype, op, data):
    # The shared-array allreduce does in one pass what it did in three (reduce into its own row,
    # divide, copy into the other rows): the bytes must not change, in every row.
    rng = np.random.default_rng(n * 3 + k)
    rows = _make(rng, n, dtype, k)
    me = data.draw(st.integers(0, k - 1))
    offset, length = _draw_chunk(data, n)
    divisor = k if op == "avg" else 1
    ref = rows.copy()
    reduce_many_native(ref[me], ref, OP_CODES[op], offset, length)
    if op == "avg":
        divide(ref[me], k, offset=offset, length=length)
    want = ref[me, offset:offset + length].copy()
    before = rows.copy()
    allreduce_rows(rows, me, OP_CODES[op], offset, length, divisor)
    for r in range(k):
        np.testing.assert_array_equal(rows[r, offset:offset + length], want, err_msg=f"row {r}")
        np.testing.assert_array_equal(rows[r, :offset], before[r, :offset])
        np.testing.assert_array_equal(rows[r, offset + length:], before[r, offset + length:])
    wide_type = np.float64 if dtype in (np.float32, np.float64) else np.int64
    wide = _NP[op].reduce(before.astype(wide_type), axis=0)[offset:offset + length]
    if op == "avg":
        wide = wide / k if dtype in (np.float32, np.float64) else wide // k
    if dtype in (np.int32, np.int64):
        np.testing.assert_array_equal(want, wide.astype(dtype))
    else:
        # A float sum of k values in [-4, 4] that cancels to near zero is off by up to k rounding
        # errors of its partial sums (|partial| <= 4k), which no relative tolerance covers.
        eps = np.finfo(dtype).eps
        np.testing.assert_allclose(want, wide, rtol=1e-5 if dtype == np.float32 else 1e-12,
                                   atol=4 * k * k * eps if op in ("sum", "avg") else 0)


@given(n=st.integers(0, 2 * TILE + 3), dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       out=st.sampled_from(["apart", "first", "second"]), data=st.data())
def test_reduce_pair_equals_the_two_row_kernel_bit_for_bit(n, dtype, op, out, data):
    # The reduce-scatter between nodes reduces its own data with the peer's message in place
    # (reduce_pair) where it copied both into two rows and reduced those: the bits must not
    # change, whichever operand is the output, in native and 16-bit formats.
    rng = np.random.default_rng(n * 7 + len(op))
    rows = _make(rng, n, dtype, 2)
    if np.dtype(rows.dtype).kind == "f":  # signed zeros and ties: min/max keep the first's
        rows[:, : n // 3] = 0.0
        rows[0, : n // 6] = -0.0
    kind = {np.float16: F16, "bfloat16": BF16}.get(dtype, 0)
    if dtype == np.float16:
        rows = rows.view(np.uint16)
    want = np.zeros(n, rows.dtype)
    if kind:
        reduce_many_16(want, rows, OP_CODES[op], 0, n, kind, np.zeros(TILE, np.float32))
    else:
        reduce_many_native(want, rows, OP_CODES[op], 0, n)
    first, second = rows[0].copy(), rows[1].copy()
    dst = {"apart": np.full(n, 7, rows.dtype), "first": first, "second": second}[out]
    reduce_pair(dst, first, second, OP_CODES[op], kind)
    np.testing.assert_array_equal(dst.view(np.uint8), want.view(np.uint8))


def test_reduce_many_aliasing_a_source_row():
    # In shared memory the destination is often one rank's own row.
    srcs = np.arange(3 * 5000, dtype=np.float32).reshape(3, 5000)
    ref = srcs.sum(axis=0)
    reduce_many_into(srcs[1], srcs, "sum")
    np.testing.assert_array_equal(srcs[1], ref)


def test_noncontiguous_views():
    base = np.arange(40, dtype=np.float64)
    dst = base[::2].copy()
    src = base[1::2]
    reduce_into(dst, src, "max")
    np.testing.assert_array_equal(dst, np.maximum(base[::2], base[1::2]))


def test_nan_propagates_through_min_and_max():
    for op in ("min", "max"):
        dst = np.array([1.0, np.nan, 3.0], np.float32)
        reduce_into(dst, np.array([np.nan, 2.0, 1.0], np.float32), op)
        assert np.isnan(dst[0]) and np.isnan(dst[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_is_sum_then_divide(dtype):
    rng = np.random.default_rng(3)
    srcs = _make(rng, 1001, dtype, 4)
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    dst = np.empty(1001, srcs.dtype)
    reduce_many_into(dst, srcs, "avg", **kw)
    divide(dst, 4, **kw)
    if dtype in (np.int32, np.int64):
        np.testing.assert_array_equal(dst, srcs.astype(np.int64).sum(0) // 4)
    else:
        x = _as_f64(srcs, dtype)
        acc = x.astype(np.float32).sum(0, dtype=np.float32) if dtype in (np.float16, "bfloat16") else x.sum(0)
        ref = acc / 4
        tol = {np.float16: 1e-3, "bfloat16": 8e-3}.get(dtype, 1e-6)
        np.testing.assert_allclose(_as_f64(dst, dtype), ref, rtol=tol, atol=tol)


def test_errors_name_the_problem():
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="float64"):
        reduce_into(a, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="shape"):
        reduce_into(a, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        reduce_into(a, a.copy(), "mean")
    with pytest.raises(ValueError, match="outside"):
        reduce_into(a, a.copy(), offset=3, length=2)
    with pytest.raises(TypeError, match="uint8"):
        reduce_into(np.zeros(4, np.uint8), np.zeros(4, np.uint8))
    with pytest.raises(TypeError, match="bfloat16"):
        reduce_into(a, a.copy(), dtype="bfloat16")
    with pytest.raises(ZeroDivisionError):
        divide(a, 0)
