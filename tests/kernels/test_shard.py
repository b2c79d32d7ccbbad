"""kernels/shard.py against NumPy, and its lock under threads that really contend."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terrapipe.kernels.shard import ADD, COPY, LOCK_STRIDE, NONE, ZERO, apply_rule, holder, locked_apply
from terrapipe.kernels.sync import compare_exchange

DTYPES = [np.float32, np.float64, np.int32, np.int64]


def _reference(shard, src, rule, scale):
    if rule == ADD:
        return shard + (src if scale == 1 else scale * src).astype(shard.dtype)
    if rule == COPY:
        return src.copy()
    if rule == ZERO:
        return np.zeros_like(shard)
    return shard.copy()


@settings(deadline=None)  # examples: the profile's (tests/conftest.py; fewer in CI)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), rule=st.sampled_from([ADD, COPY, ZERO, NONE]),
       scale=st.sampled_from([1, 2, -3]), with_out=st.booleans(), seed=st.integers(0, 2**16))
def test_apply_rule_matches_numpy(dtype, n, rule, scale, with_out, seed):
    rng = np.random.default_rng(seed)
    shard = rng.integers(-100, 100, n).astype(dtype)
    src = rng.integers(-100, 100, n).astype(dtype)
    expected = _reference(shard, src, rule, dtype(scale))
    out = np.full(n if with_out else 0, 77, dtype)
    apply_rule(shard, src, out, rule, dtype(scale))
    np.testing.assert_array_equal(shard, expected)
    if with_out:
        np.testing.assert_array_equal(out, expected)


def test_float_scale_is_applied_in_the_shard_dtype():
    shard = np.ones(5, np.float32)
    apply_rule(shard, np.full(5, 2, np.float32), shard[:0], ADD, np.float32(-0.25))
    np.testing.assert_array_equal(shard, np.full(5, 0.5, np.float32))


def test_compare_exchange_swaps_only_on_the_expected_value():
    from numba import njit

    @njit
    def cas(a, i, e, d):
        return compare_exchange(a, i, e, d)

    a = np.array([0, 5], np.int64)
    assert cas(a, 1, 5, 9) and a[1] == 9
    assert not cas(a, 1, 5, 1) and a[1] == 9
    assert cas(a, 0, 0, 3) and list(a) == [3, 9]


def test_a_held_lock_is_reported_with_its_holder_and_nothing_is_applied():
    locks = np.zeros(2 * LOCK_STRIDE, np.int64)
    locks[LOCK_STRIDE] = 4  # chunk 1 held by rank 3
    shard = np.zeros(3, np.int64)
    assert locked_apply(locks, 1, 1, 50, shard, np.ones(3, np.int64), shard[:0], ADD, np.int64(1)) == 4
    assert shard.sum() == 0 and holder(locks, 1) == 4
    assert locked_apply(locks, 0, 1, 50, shard, np.ones(3, np.int64), shard[:0], ADD, np.int64(1)) == -1
    assert shard.sum() == 3 and holder(locks, 0) == 0  # released after applying


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_contending_threads_lose_no_add_and_never_read_a_torn_chunk(dtype):
    # Four threads add to the same 3 chunks 400 times each while a fifth reads them: the sum is
    # exact and every read of a chunk is uniform (the adds are uniform per chunk).
    locks = np.zeros(3 * LOCK_STRIDE, np.int64)
    n = 4096
    shard = np.zeros(3 * n, dtype)
    torn = []

    def adder(token):
        src = np.full(n, token, dtype)
        for i in range(400):
            k = i % 3
            while locked_apply(locks, k, token, 64, shard[k * n:(k + 1) * n], src, src[:0], ADD,
                               dtype(1)) != -1:
                pass

    def reader():
        out = np.empty(n, dtype)
        for i in range(600):
            k = i % 3
            while locked_apply(locks, k, 9, 64, shard[k * n:(k + 1) * n], out, out, NONE, dtype(1)) != -1:
                pass
            if out.min() != out.max():
                torn.append((k, out.min(), out.max()))

    threads = [threading.Thread(target=adder, args=(t,)) for t in (1, 2, 3, 4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torn
    per_chunk = {k: sum(t * len(range(k, 400, 3)) for t in (1, 2, 3, 4)) for k in range(3)}
    for k in range(3):
        assert np.all(shard[k * n:(k + 1) * n] == per_chunk[k])
    assert not locks.any()
