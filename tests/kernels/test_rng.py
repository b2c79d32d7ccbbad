import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from terrapipe.kernels.rng import _mulhilo, fill_uniform, philox4x64, randint, random_u64, uniform

U64 = st.integers(0, 2**64 - 1)


@given(c=st.tuples(st.integers(1, 2**64 - 1), U64, U64, U64), k=st.tuples(U64, U64))
def test_philox_matches_numpy_reference(c, k):
    # NumPy's Philox increments the counter before each block. The state is set as a uint64
    # array: Philox(counter=[...]) passes large ints through float64 and loses low bits.
    gen = np.random.Philox()
    state = gen.state
    state["state"] = {"counter": np.array([c[0] - 1, c[1], c[2], c[3]], np.uint64),
                      "key": np.array(k, np.uint64)}
    state["buffer_pos"] = 4
    gen.state = state
    ref = gen.random_raw(4)
    ours = philox4x64(*(np.uint64(v) for v in c), *(np.uint64(v) for v in k))
    assert [int(v) for v in ours] == [int(v) for v in ref]


@given(seed=st.integers(0, 2**32), epoch=st.integers(0, 1000), index=st.integers(0, 10**7),
       op=st.integers(0, 64), n=st.integers(1, 33))
def test_streams_are_pure_functions_of_their_keys(seed, epoch, index, op, n):
    out = np.empty(n, np.float64)
    fill_uniform(seed, epoch, index, op, out)
    again = np.array([uniform(seed, epoch, index, op, j) for j in range(n)])
    np.testing.assert_array_equal(out, again)
    assert np.all((out >= 0) & (out < 1))
    # Changing any one key changes the stream.
    for other in [(seed + 1, epoch, index, op), (seed, epoch + 1, index, op),
                  (seed, epoch, index + 1, op), (seed, epoch, index, op + 1)]:
        assert random_u64(*other, 0) != random_u64(seed, epoch, index, op, 0)


def test_uniform_distribution_and_independence():
    n = 200_000
    out = np.empty(n, np.float64)
    fill_uniform(7, 0, 0, 0, out)
    hist, _ = np.histogram(out, bins=20, range=(0, 1))
    expected = n / 20
    chi2 = ((hist - expected) ** 2 / expected).sum()
    assert chi2 < 45.3  # p = 0.001 for 19 degrees of freedom
    assert abs(np.corrcoef(out[:-1], out[1:])[0, 1]) < 0.01
    # Across sample indices (what the loader uses per sample), first draws are uniform too.
    firsts = np.array([uniform(7, 0, i, 0, 0) for i in range(20_000)])
    assert abs(firsts.mean() - 0.5) < 0.01


@njit
def _randints(seed, n, low, high, out):
    for i in range(n):
        out[i] = randint(seed, 0, i, 3, 0, low, high)


@given(low=st.integers(-1000, 1000), span=st.integers(1, 50))
def test_randint_range_and_coverage(low, span):
    out = np.empty(4000, np.int64)
    _randints(11, 4000, low, low + span, out)
    assert out.min() >= low and out.max() < low + span
    assert len(np.unique(out)) == span  # 4000 draws hit every value of a small range


@njit
def _mulhilo_of(a, b):
    return _mulhilo(a, b)


@given(a=U64, b=U64)
def test_mulhilo_is_the_128_bit_product(a, b):
    # The intrinsic behind every Philox round: its halves against Python's exact integers.
    hi, lo = _mulhilo_of(np.uint64(a), np.uint64(b))
    assert (int(hi) << 64) | int(lo) == a * b
