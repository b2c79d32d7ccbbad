import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from terrapipe.kernels.floats import BF16, F16, from_f32, to_f32


@njit
def _decode(bits, kind, out):
    for i in range(bits.size):
        out[i] = to_f32(bits[i], kind)


@njit
def _encode(x, kind, out):
    for i in range(x.size):
        out[i] = from_f32(x[i], kind)


ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_f16_decode_exhaustive():
    out = np.empty(ALL_BITS.size, np.float32)
    _decode(ALL_BITS, F16, out)
    np.testing.assert_array_equal(out, ALL_BITS.view(np.float16).astype(np.float32))


def test_bf16_decode_exhaustive():
    out = np.empty(ALL_BITS.size, np.float32)
    _decode(ALL_BITS, BF16, out)
    ref = torch.from_numpy(ALL_BITS.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(out, ref)


SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-8, 6e-8, -3e-5, 1.0 + 2**-11,
     1.0 + 3 * 2**-11, 3.3895314e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8],
    np.float32,
)


@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_f16_and_bf16_encode_round_to_nearest_even(values):
    x = np.concatenate([np.array(values, np.float32), SPECIALS])
    out = np.empty(x.size, np.uint16)
    _encode(x, F16, out)
    with np.errstate(over="ignore"):
        ref16 = x.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.float16), ref16)  # NaN == NaN here
    _encode(x, BF16, out)
    refb = torch.from_numpy(x).bfloat16().float().numpy()
    got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, refb)
