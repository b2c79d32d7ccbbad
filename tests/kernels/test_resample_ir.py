"""The resampling passes emitted at the CPU's vector width (terrapipe.kernels.resample_ir):
the exact (32-bit) arithmetic bit-identical to the scalar kernel they replaced at every width,
the 16-bit one within a level of it, and the width a CPU gets is the one its registers hold
(checked in the assembly for AVX2 and AVX-512 targets on any machine)."""

import functools
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terrapipe.kernels import resample_ir
from terrapipe.kernels.image import (
    alloc_resize_scratch,
    build_normalize_lut,
    identity_lut,
    resize_crop_bilinear,
    resize_crop_bilinear_region,
)

from .scalar_resize import alloc, resize_region

LANES = (4, 8, 16)  # every width runs on any CPU (LLVM splits what its registers cannot hold)
# The width this CPU runs in make test (CI time: each width compiles its own kernels); every
# width in make test-full.
WIDTHS = [pytest.param(n, marks=() if n == resample_ir.vector_lanes() else pytest.mark.full, id=f"{n}lanes")
          for n in LANES]
# Likewise each arithmetic's hypothesis test: in make test where it is this CPU's default (NOTE
# [a kernel generated for the machine at hand] 6), at every width in make test-full.
_NARROW = resample_ir.narrow_default()
EXACT_WIDTHS = WIDTHS if not _NARROW else [pytest.param(n, marks=pytest.mark.full, id=f"{n}lanes")
                                           for n in LANES]
NARROW_WIDTHS = WIDTHS if _NARROW else [pytest.param(n, marks=pytest.mark.full, id=f"{n}lanes")
                                        for n in LANES]
ARITHMETICS = [pytest.param(a, id=name, marks=() if a == _NARROW else pytest.mark.full)
               for a, name in ((False, "exact"), (True, "16bit"))]


@st.composite
def cases(draw):
    """An image (any bytes per pixel), a box in it, an output size (blocks with a short last
    one, spans off the vector width), an output dtype and a flip."""
    h = draw(st.integers(1, 70))
    w = draw(st.integers(1, 70))
    stride = draw(st.sampled_from([1, 2, 3, 4]))
    channels = draw(st.integers(1, stride))
    seed = draw(st.integers(0, 2**16))
    g = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["noise", "edges", "flat255"]))
    if kind == "noise":
        img = g.integers(0, 256, (h, w, stride), dtype=np.uint8)
    elif kind == "edges":
        img = np.where(g.random((h, w, stride)) > 0.5, 255, 0).astype(np.uint8)
    else:  # the largest intermediate values: 255 everywhere
        img = np.full((h, w, stride), 255, np.uint8)
    x0 = draw(st.floats(0, w - 0.25))
    y0 = draw(st.floats(0, h - 0.25))
    x1 = draw(st.floats(min(x0 + 0.25, w), w))
    y1 = draw(st.floats(min(y0 + 0.25, h), h))
    oh = draw(st.integers(1, 60))
    ow = draw(st.integers(1, 60))
    dtype = draw(st.sampled_from([np.uint8, np.uint16, np.float32, np.float64]))
    flip = draw(st.booleans())
    return img, (x0, y0, x1, y1), (oh, ow), channels, dtype, flip


def _lut(channels, dtype, seed=0):
    if dtype == np.uint8:
        return identity_lut(channels)
    g = np.random.default_rng(seed)
    return (g.standard_normal((channels, 256)) * 1000).astype(dtype)


def _reference(img, box, oh, ow, channels, lut, flip):
    """The scalar kernel's ``(levels, output through lut)``: its levels through the identity
    table, then looked up in ``lut`` as its store does (``table[level]``, scalar_resize._hrows).
    One compiled specialization of the reference serves every dtype of table (each would take
    5-13 s to compile)."""
    h, w, stride = img.shape
    levels = np.zeros((channels, oh, ow), np.uint8)
    resize_region(img, 0, 0, w, h, *box, levels, identity_lut(channels), flip, *alloc(h, w, oh, ow, stride))
    return levels, lut[np.arange(channels)[:, None, None], levels]


@pytest.mark.parametrize("lanes", EXACT_WIDTHS)
@settings(deadline=None)  # examples: the profile's (tests/conftest.py; fewer in CI)
@given(case=cases())
def test_every_width_is_bit_identical_to_the_scalar_kernel(case, lanes):
    img, box, (oh, ow), channels, dtype, flip = case
    h, w, stride = img.shape
    lut = _lut(channels, dtype)
    ref = _reference(img, box, oh, ow, channels, lut, flip)[1]
    out = np.zeros((channels, oh, ow), dtype)
    resize_crop_bilinear(img, *box, out, lut, flip,
                         *alloc_resize_scratch(h, w, oh, ow, stride, lanes, narrow=False))
    np.testing.assert_array_equal(out, ref)


def _within_a_level(out, levels, lut):
    """Whether each of ``out`` is lut[c, v] for v within one of the exact ``levels``."""
    c = np.arange(lut.shape[0])[:, None, None]
    near = [lut[c, np.clip(levels.astype(int) + d, 0, 255)] for d in (-1, 0, 1)]
    return np.any([out == v for v in near], axis=0)


# 16-bit arithmetic: this CPU's width in make test, every width in make test-full (4 lanes takes
# the generic transpose, 8 and 16 the word transpose).
@pytest.mark.parametrize("lanes", NARROW_WIDTHS)
@settings(deadline=None)
@given(case=cases())
def test_every_width_in_16_bits_is_within_a_level_of_the_scalar_kernel(case, lanes):
    img, box, (oh, ow), channels, dtype, flip = case
    h, w, stride = img.shape
    lut = _lut(channels, dtype)
    levels = _reference(img, box, oh, ow, channels, lut, flip)[0]
    out = np.zeros((channels, oh, ow), dtype)
    resize_crop_bilinear(img, *box, out, lut, flip,
                         *alloc_resize_scratch(h, w, oh, ow, stride, lanes, narrow=True))
    near = _within_a_level(out, levels, lut)
    assert near.all(), f"{np.argwhere(~near)[:5]} off by more than a level"
    if img.min() == img.max():  # a flat image stays flat: the weights sum to exactly 1.0
        assert (out == lut[np.arange(channels)[:, None, None], img.flat[0]]).all()


@settings(deadline=None)
@given(n=st.integers(1, 60), taps=st.integers(1, 400), bits=st.sampled_from([14, 22]),
       seed=st.integers(0, 2**16))
def test_narrow_weights_sum_to_one_each_within_a_unit_of_its_rounding(n, taps, bits, seed):
    g = np.random.default_rng(seed)
    bounds = np.zeros((n, 2), np.int32)
    bounds[:, 1] = g.integers(1, taps + 1, n)
    weights = np.zeros((n, taps), np.int32)
    for o in range(n):  # Q(bits) weights of a filter: nonnegative, summing to 1.0
        raw = g.random(bounds[o, 1]) * (g.random(bounds[o, 1]) > 0.2) + 1e-9
        weights[o, : bounds[o, 1]] = np.round(raw / raw.sum() * (1 << bits))
    before = weights.astype(np.float64) / (1 << bits)
    resample_ir.narrow_weights(bounds, weights, bits)
    for o in range(n):
        k = bounds[o, 1]
        assert weights[o, :k].sum() == 1 << resample_ir.NARROW_WBITS
        assert (weights[o, :k] >= 0).all()
        assert np.abs(weights[o, :k] - before[o, :k] * (1 << resample_ir.NARROW_WBITS)).max() <= 1.5


@pytest.mark.parametrize("narrow", ARITHMETICS)
@pytest.mark.parametrize("lanes", LANES)
def test_strided_outputs_and_regions_and_reused_scratch(lanes, narrow):
    """A channels-last slot of a batch (writes nothing else), a region of a larger image with a
    padded row stride, and one scratch reused across sizes and sources."""
    g = np.random.default_rng(lanes)
    lut = build_normalize_lut((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    scratch = alloc_resize_scratch(300, 300, 37, 41, 4, lanes, narrow=narrow)
    for trial in range(20):
        h, w = g.integers(40, 300, 2)
        img = g.integers(0, 256, (h, w, 4), dtype=np.uint8)
        box = (float(g.uniform(0, w / 3)), float(g.uniform(0, h / 3)),
               float(g.uniform(w / 2, w)), float(g.uniform(h / 2, h)))
        levels, ref = _reference(img, box, 37, 41, 3, lut, bool(trial % 2))
        batch = np.zeros((3, 37, 41, 3), np.float32)  # NHWC storage, written as NCHW views
        resize_crop_bilinear(img, *box, batch[1].transpose(2, 0, 1), lut, bool(trial % 2), *scratch)
        if narrow:  # within a level of the exact result; the region below must equal this one
            assert _within_a_level(batch[1].transpose(2, 0, 1), levels, lut).all()
            ref = batch[1].transpose(2, 0, 1).copy()
        np.testing.assert_array_equal(batch[1].transpose(2, 0, 1), ref)
        assert not batch[0].any() and not batch[2].any()
        # The same box from a region (rows padded to a wider buffer) around its taps.
        ox, oy = int(box[0]) // 2, int(box[1]) // 2
        padded = np.zeros((h - oy, w + 7, 4), np.uint8)
        padded[:, : w - ox] = img[oy:, ox:]
        region = padded[:, : w - ox]
        part = np.zeros((3, 37, 41), np.float32)
        resize_crop_bilinear_region(region, ox, oy, w, h, *box, part, lut, bool(trial % 2), *scratch)
        np.testing.assert_array_equal(part, ref)


def test_threads_compiling_at_once_get_one_kernel_and_exact_results():
    """Eight threads racing to the first use of a new specialization: one compilation, and
    every thread's output equals the reference."""
    g = np.random.default_rng(7)
    img = g.integers(0, 256, (90, 120, 2), dtype=np.uint8)
    lut = _lut(2, np.float64, seed=3)
    ref = _reference(img, (3.0, 5.0, 110.0, 80.0), 33, 47, 2, lut, True)[1]
    addresses, errors = [], []
    barrier = threading.Barrier(8)

    def work():
        try:
            barrier.wait()
            addresses.append(resample_ir.kernel(2, 2, 8, 32))
            out = np.zeros_like(ref)
            scratch = alloc_resize_scratch(90, 120, 33, 47, 2, 32, narrow=False)
            for _ in range(20):
                resize_crop_bilinear(img, 3.0, 5.0, 110.0, 80.0, out, lut, True, *scratch)
                np.testing.assert_array_equal(out, ref)
        except Exception as exc:  # reported below, with the thread's error
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(addresses)) == 1


@functools.cache
def _assembly(cpu: str, lanes: int, narrow: bool) -> str:
    """``resample_ir.assembly`` for another CPU, made once per process: several tests read the
    same kernel's assembly, and each is a whole LLVM compilation for that target (1-3 s).
    ``narrow`` is always passed, so each kernel has one key in the cache."""
    return resample_ir.assembly(cpu, lanes, narrow=narrow)


def _vector_registers(asm: str) -> set[str]:
    return set(re.findall(r"%([xyz]mm)\d+", asm))


def test_avx2_targets_get_256_bit_vectors():
    asm = _assembly("haswell", 8, False)
    assert "ymm" in _vector_registers(asm) and "zmm" not in _vector_registers(asm)
    assert re.search(r"vpmulld\s+%ymm", asm)  # the taps multiply 8 int32 lanes at once


@pytest.mark.parametrize("cpu", ["skylake-avx512", "icelake-server", "znver4"])
def test_avx512_targets_get_512_bit_vectors(cpu):
    """Xeons are tuned to prefer 256-bit vectors; the kernel's attributes let LLVM use zmm."""
    asm = _assembly(cpu, 16, False)
    assert re.search(r"vpmulld\s+%zmm", asm)


@pytest.mark.parametrize("cpu, lanes, reg", [("haswell", 8, "ymm"), ("skylake-avx512", 16, "zmm"),
                                             ("icelake-server", 16, "zmm")])
def test_the_16_bit_passes_multiply_16_bit_lanes(cpu, lanes, reg):
    """The 16-bit passes: unsigned 16-bit products (pmulhuw), 2R of them per vertical tap."""
    asm = _assembly(cpu, lanes, True)
    assert re.search(rf"vpmulhuw\s+%{reg}", asm)


@pytest.mark.parametrize("cpu", ["skylake-avx512", "icelake-server", "znver4"])
def test_the_float32_lut_is_gathered_by_32_bit_indices(cpu):
    """NOTE [a kernel generated ...] 7: one vpgatherdd per output row of 16 levels. The same
    pointers built by integer adds compiled to two 64-bit-index vpgatherqd per row (none of
    these) with the index arithmetic in 64-bit lanes."""
    asm = _assembly(cpu, 16, True)
    assert re.search(r"vpgatherdd\s+\(%\w+,%zmm\d+,4\), %zmm", asm)


def test_this_cpu_runs_at_its_own_width():
    lanes = resample_ir.vector_lanes()
    regs = _vector_registers(resample_ir.assembly())
    widest = {4: "xmm", 8: "ymm", 16: "zmm"}[lanes]
    assert widest in regs
    params = alloc_resize_scratch(10, 10, 5, 5, 3)[-1]
    assert lanes == params[resample_ir.P_LANES]
    assert params[resample_ir.P_NARROW] == resample_ir.narrow_default()


def test_narrow_default_reads_the_feature_string():
    # Intel's cores and AMD's alike (NOTE [a kernel generated ...] 6: measured on a Zen 4 at
    # both widths; Zen 1-3 had kept the exact arithmetic).
    assert resample_ir.narrow_default("+avx2,+avx512f,+avx512bw")
    assert resample_ir.narrow_default("+sse2,+avx,+avx2,-avx512f")
    assert not resample_ir.narrow_default("+sse4.2,-avx2")
    assert not resample_ir.narrow_default("+neon")


def test_numba_target_settings_move_the_generated_kernels_too():
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (Numba's own target) choose these kernels' CPU too:
    AVX2 code on an AVX-512 machine, or one cache for a cluster's oldest CPU."""
    code = ("from terrapipe.kernels import image, resample_ir as r; "
            "p = image.alloc_resize_scratch(10, 10, 5, 5, 3)[-1]; "
            "print(r.target()[0], r.vector_lanes(), p[r.P_LANES], r.narrow_default())")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="+sse2,+avx,+avx2,+fma,-avx512f")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["haswell", "8", "8", "True"]
    env = dict(os.environ, NUMBA_CPU_NAME="generic")  # Numba's default features for it: none
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["generic", "4", "4", "False"]


@pytest.mark.parametrize("cpu, lanes", [("haswell", 8), ("znver4", 16)])
def test_the_vertical_pass_prefetches_its_rows(cpu, lanes):
    # NOTE [a kernel generated ...] 8: one prefetch per source row and 64-byte line ahead.
    for narrow in (False, True):
        assert re.search(r"prefetcht0\s", _assembly(cpu, lanes, narrow))


def test_vector_lanes_reads_the_feature_string():
    assert resample_ir.vector_lanes("+sse2,+avx,+avx2,-avx512f") == 8
    assert resample_ir.vector_lanes("+avx2,+avx512f,+avx512bw") == 16
    assert resample_ir.vector_lanes("+avx2,+avx512f,-avx512bw") == 8
    assert resample_ir.vector_lanes("+neon") == 4


def test_bad_arguments_are_named():
    img = np.zeros((10, 10, 3), np.uint8)
    lut = identity_lut(3)
    out = np.zeros((3, 5, 5), np.uint8)
    with pytest.raises(ValueError, match="lanes"):
        alloc_resize_scratch(10, 10, 5, 5, 3, lanes=6)
    scratch = alloc_resize_scratch(10, 10, 5, 5, 3)
    with pytest.raises(ValueError, match="src"):
        resize_crop_bilinear(img[:, ::2], 0.0, 0.0, 5.0, 10.0, out, lut, False, *scratch)
    with pytest.raises(ValueError, match="out/lut"):
        resize_crop_bilinear(img, 0.0, 0.0, 10.0, 10.0, out.astype(np.float32), lut, False, *scratch)
    with pytest.raises(ValueError, match="output channels"):
        resize_crop_bilinear(np.zeros((10, 10, 2), np.uint8), 0.0, 0.0, 10.0, 10.0, out, lut, False,
                             *scratch)
    with pytest.raises(ValueError, match="scratch is too small"):
        resize_crop_bilinear(np.zeros((10, 40, 3), np.uint8), 5.0, 0.0, 15.0, 10.0, out, lut, False,
                             *scratch)
    with pytest.raises(ValueError, match="lanes"):
        resample_ir.emit(3, 3, 3, 4, 14, 22, "k")


_RUN = """
import numpy as np
from terrapipe.kernels.image import alloc_resize_scratch, identity_lut, resize_crop_bilinear
img = (np.arange(40 * 50 * 4) % 251).astype(np.uint8).reshape(40, 50, 4)
out = np.zeros((3, 21, 23), np.uint8)
resize_crop_bilinear(img, 1.5, 2.0, 47.0, 39.0, out, identity_lut(3), True,
                     *alloc_resize_scratch(40, 50, 21, 23, 4, 4))
print(int(out.astype(np.int64).sum()))
"""


def test_a_second_process_loads_the_machine_code_and_only_a_private_file(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run():
        return subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True,
                              check=True, timeout=300).stdout

    first = run()
    (obj,) = tmp_path.glob("terrapipe-llvm-*.o")
    stamp = obj.stat().st_mtime_ns
    assert run() == first and obj.stat().st_mtime_ns == stamp  # loaded, not written again
    obj.chmod(0o666)  # writable by others: never loaded, compiled again and replaced
    assert run() == first
    assert obj.stat().st_mode & 0o777 == 0o600 and obj.stat().st_mtime_ns != stamp
