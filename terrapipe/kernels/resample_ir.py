"""The two resampling passes of :mod:`terrapipe.kernels.image`, emitted as LLVM IR at the vector
width of the CPU the process runs on, and called from Numba through a function pointer.

Why one module: :func:`emit` is one kernel, whose two passes share its loops, its registers and
the block's layout, in both arithmetics; the rest (its weights for the 16-bit arithmetic, its
compilation, cache and call) is what that one kernel needs and nothing else uses.

NOTE [a kernel generated for the machine at hand]
1. Why IR and not a Numba loop. Numba hands LLVM scalar loops and LLVM's vectorizer picks the
   width: on the Xeons with AVX-512 that is 256 bits (LLVM's ``prefer-256-bit`` tuning), and
   the horizontal taps, whose offsets come from a table, were not vectorized at all. Here the
   vectors are explicit (``<R x i32>``), so the width is ours: R = the CPU's vector bits / 32,
   8 on AVX2 (ymm), 16 on AVX-512 (zmm, with the function attributes that let the backend use
   512-bit registers), 4 on 128-bit ISAs. :func:`assembly` shows what a given CPU gets, and
   the tests check it for AVX2 and AVX-512 targets on any machine.
2. The arithmetic is the scalar kernel's, unchanged: the vertical pass sums 22-bit weights times
   uint8 pixels in int32 and keeps 8 fractional bits in a uint16; the horizontal pass sums 14-bit
   weights times those in int32 and rounds once. So results are bit-identical at every width.
3. Layout. One block is R output rows. The vertical pass computes, for R source columns (bytes)
   at a time, the R rows as R vectors across columns, then transposes the R x R tile with a
   shuffle network (log2 R rounds of interleaves) and stores it column-major: the block holds
   ``block[(pixel * S + channel) * R + row]``. The horizontal pass then multiplies one tap of
   one channel for all R rows as one contiguous vector load, and never shuffles. Every row of
   a block runs as many vertical taps as its widest row (zero weights pad the others), so the
   R accumulators live in registers through one loop instead of one loop per row.
4. Specialized per (R, source bytes per pixel S, output channels C, output element size E), the
   sizes that fix the loops' shapes; compiled on first use in a process (~0.4 s), under a lock,
   and its machine code cached on disk beside Numba's (a later process loads it in ~20 ms).
   The loops over output pixels and taps stay runtime loops.
5. Ownership: every pointer is the caller's; the kernel writes only ``block`` (scratch) and
   ``out``, and keeps nothing between calls.
6. The 16-bit arithmetic (``narrow``), the default with AVX2 and with AVX-512BW
   (:func:`narrow_default`). On Intel cores an int32 multiply (``vpmulld``) is
   two micro-ops on one port, so clause 2's vertical pass ran 8 products a cycle at best;
   ``vpmulhuw`` is one micro-op for 16 (ymm) or 32 (zmm).
   - Weights are Q15 (:func:`narrow_weights`: rounded, then settled
     to sum to exactly 1.0, each within a unit). The vertical pass multiplies ``pixel << 8``
     (one byte shuffle puts each pixel in a lane's high byte) by the weight and keeps the high
     16 bits: Q7. The horizontal pass multiplies those by Q15 weights the same way: Q6, rounded
     once at the end. Each product is floored, so each sum starts at half a unit per tap:
     unbiased. Every weight is >= 0 (a triangle filter), so nothing goes below zero, and a sum
     of products under 1.0 stays under 2**16.
   - Results are within one level of the exact arithmetic (tests: hypothesis at every width),
     and so of Pillow's and Pillow-SIMD's (itself 16-bit).
   - The vertical pass does 2R columns per vector for its R rows, then
     :func:`terrapipe.kernels.llvm_ir.transpose_words` turns the R x 2R tile into columns with
     in-lane unpacks (half the shuffles of two R x R transposes). A tail under 2R columns is
     one more vector ending at the span's end, over columns already done.
   - The horizontal pass reads channels in pairs: channel c + 1's R rows follow channel c's.
   - Measured on an Intel Xeon (AVX-512), per photograph: 16 lanes 1.5x and 8 lanes 1.4x
     faster than the exact arithmetic at the same width. On AMD, where an int32 multiply is
     cheap (and an earlier 16-bit attempt, pairs of rows through ``vpmaddwd``, had lost on a
     Zen 3), it still wins: on a Zen 4 (``python -m benchmarks.kernels --photos DIR``, both
     arithmetics interleaved, 200 photographs) 130 against 145 us at 16 lanes, and with AVX2
     code (8 lanes, compiled for ``znver3`` through ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``:
     :func:`target`) 134 against 180 us; on a Zen 3 itself (AVX2 only, 8 lanes) 169 against
     198 us (``kernels_zen3_avx2_2026-12-07.json``). Zen 1-3 had kept the exact arithmetic until
     then. The benchmark times both arithmetics on the machine at hand.
     ``narrow=True`` or ``False`` runs at any width.
7. With the 16-bit passes, a lut of 4-byte entries (float32 normalization) is applied after the
   byte transpose of clause 3's identity path: each output row's R levels index the channel's
   lut row in one gather (``llvm.masked.gather``: ``vpgatherdd`` on AVX-512), then one vector
   store, where the per-pixel path does R scattered loads and stores. Measured on the Xeon
   (AVX-512): the lut's cost over uint8 output fell from ~84 us to ~45 us per 224 x 224 sample.
   The pointers are one GEP of the row's base by the zero-extended levels
   (:func:`terrapipe.kernels.llvm_ir.lanes_at`): built by integer adds, as first written, the
   backend saw 64-bit addresses and emitted two ``vpgatherqd`` per row with the index
   arithmetic in 64-bit lanes (found on a Zen 4 under LLVM 22, where the lut's cost was
   60-80 us a sample; the best of 31 interleaved rounds there went from 234 to 222 us, 270 to
   249 with the flip, the medians within the machine's noise).
8. The vertical pass reads its block's 16-30 source rows side by side, a few bytes of each per
   step, and a source that is not in cache (a photograph decoded a while ago, a set larger than
   the caches) comes in as that many streams at once, which the hardware prefetchers follow
   poorly: on a Zen 4, 200 photographs, the pass took ~100 us of a sample's ~130 against ~17 us
   with the same work on 4 photographs (warm). So each step whose columns begin a 64-byte line
   prefetches, for every source row of the block, the line :data:`PREFETCH_BYTES` ahead: one
   ``prefetcht0`` a row and line, all rows' misses in flight together. Interleaved on the Zen 4
   (21 rounds, ours / Pillow-SIMD per round): 16 lanes 0.95 -> 0.77; AVX2 code (8 lanes, a
   ``znver3`` target) 1.21 -> 1.04 exact, 1.16 -> 0.91 in 16 bits. 128 bytes ahead beat 64, 192,
   256, 384, 512 and 1024; on 4 photographs it costs nothing (0.743 / 0.739). A prefetch past the
   row's end reads nothing and faults nothing.
"""

from __future__ import annotations

import functools
import threading

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba import njit, types
from numba.core import config as numba_config
from numba.extending import intrinsic

from .llvm_ir import at as _at
from .llvm_ir import c64 as _c64
from .llvm_ir import for_range as _for
from .llvm_ir import lanes_at as _lanes_at
from .llvm_ir import splat as _splat
from .llvm_ir import transpose as _transpose
from .llvm_ir import transpose_words as _transpose_words
from .object_cache import ObjectCache

__all__ = ["N_PARAMS", "target", "vector_lanes", "narrow_default", "narrow_weights", "kernel", "emit",
           "assembly", "call_kernel"]

# How far ahead of the columns at hand the vertical pass prefetches its source rows (NOTE
# [...] 8).
PREFETCH_BYTES = 128

# The narrow arithmetic's fixed point (NOTE [...] 6): Q15 weights, 7 fractional bits after the
# vertical pass, 6 after the horizontal (the exact one's are image's, NOTE [...] 2).
NARROW_WBITS, NARROW_XFRAC = 15, 6

# Slots of the kernel's int64 parameter array (NOTE [a kernel generated ...] 5: the caller's).
(P_LANES, P_SRC_ROW, P_SRC_H, P_J0, P_SPAN, P_KY, P_KX, P_OUT_CS, P_OUT_YS, P_OUT_XS, P_LUT_ROW,
 P_OUT_H, P_OUT_W, P_FLIP, P_NARROW) = range(15)
N_PARAMS = 15

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_P8 = _I8.as_pointer()
_ARGS = ("params", "src", "ybounds", "yweights", "xbounds", "xweights", "block", "out", "lut")
_FNTY = ir.FunctionType(ir.VoidType(), [_P8] * len(_ARGS))


def target() -> tuple[str, str]:
    """(LLVM CPU name, feature string) the kernels are compiled for: Numba's own target, so
    ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` (read by ``numba.config``, with Numba's
    meaning: the features default to this machine's, or to none for ``generic``) move these
    kernels and Numba's together, e.g. to one cache that a cluster's oldest CPU can run, or to
    time AVX2 code on an AVX-512 machine; else this machine's CPU and features."""
    cpu = numba_config.CPU_NAME or llvm.get_host_cpu_name()
    features = numba_config.CPU_FEATURES
    return cpu, llvm.get_host_cpu_features().flatten() if features is None else features


def vector_lanes(features: str | None = None) -> int:
    """int32 lanes of the widest vector registers that ``features`` (LLVM's ``+avx2,...``
    string; default: :func:`target`'s) offer: 16 with AVX-512 (F and BW), 8 with AVX2, else 4."""
    if features is None:
        return _target_lanes()
    have = {f[1:] for f in features.split(",") if f.startswith("+")}
    if {"avx512f", "avx512bw"} <= have:
        return 16
    if "avx2" in have:
        return 8
    return 4


def narrow_default(features: str | None = None) -> bool:
    """Whether a CPU (LLVM's ``features`` string; default: :func:`target`'s) resamples in 16-bit
    arithmetic by default (NOTE [...] 6): with AVX2 or AVX-512BW, Intel's cores and AMD's alike."""
    if features is None:
        features = target()[1]
    have = {f[1:] for f in features.split(",") if f.startswith("+")}
    return "avx2" in have or {"avx512f", "avx512bw"} <= have


@njit(nogil=True, cache=True)
def narrow_weights(bounds, weights, bits):
    """Fixed-point weights of Q``bits`` -> Q15 (:data:`NARROW_WBITS`), in place, for
    the 16-bit passes. Each is rounded, then what the rounding left over is handed back one unit
    per tap, so each output pixel's weights still sum to exactly 1.0 (a flat image stays flat
    however many taps) and none moves by more than a unit. bounds: int32 (n, 2), (first tap,
    taps); weights: int32 (n, >= taps), each >= 0."""
    one = 1 << NARROW_WBITS
    for o in range(bounds.shape[0]):
        n = bounds[o, 1]
        left = one
        for t in range(n):
            w = weights[o, t]
            if bits > NARROW_WBITS:
                w = (w + (1 << (bits - NARROW_WBITS - 1))) >> (bits - NARROW_WBITS)
            else:
                w = w << (NARROW_WBITS - bits)
            weights[o, t] = w
            left -= w
        # Each rounding moved a weight by at most half a unit, so |left| <= n / 2, and a surplus
        # came from taps rounded up, which hold at least a unit: one pass settles it.
        for t in range(n):
            if left > 0:
                weights[o, t] += 1
                left -= 1
            elif left < 0 and weights[o, t] > 0:
                weights[o, t] -= 1
                left += 1


@functools.cache
def _target_lanes() -> int:
    return vector_lanes(target()[1])


def emit(lanes: int, stride: int, channels: int, esize: int, vshift: int, hshift: int,
         name: str, identity: bool = False, narrow: bool = False) -> str:
    """LLVM IR (text) of ``void name(i8* params, src, ybounds, yweights, xbounds, xweights,
    block, out, lut)``: the block loop of :func:`terrapipe.kernels.image.resize_crop_bilinear_region`.

    lanes: R, rows per block and int32 lanes per vector (a power of two). stride: source bytes
    per pixel (S). channels: output channels (C <= S). esize: bytes per output element (1, 2,
    4 or 8), the lut's. vshift / hshift: the passes' fixed-point shifts. identity: the lut is
    uint8 0..255 in every row (values are stored as they are, no lookup). narrow: 16-bit
    arithmetic (NOTE [...] 6): 2R columns per vertical vector, within one level of the exact
    int32 arithmetic.
    Arguments at run time: params int64[N_PARAMS] (slots ``P_*``); src uint8, ``params[P_SRC_H]``
    rows of ``params[P_SRC_ROW]`` bytes; ybounds/xbounds int32 (n, 2) (first tap, taps), x's relative to
    the first column read; yweights/xweights int32 (n, params[P_KY / P_KX]); block uint16
    (span * R); out any byte strides ``params[P_OUT_CS/YS/XS]``; lut (C, 256) rows of
    ``params[P_LUT_ROW]`` bytes.
    """
    if lanes & (lanes - 1) or not 2 <= lanes <= 64:
        raise ValueError(f"emit: lanes must be a power of two in [2, 64], got {lanes}")
    if not 1 <= channels <= stride:
        raise ValueError(f"emit: need 1 <= channels <= stride, got {channels}, {stride}")
    if esize not in (1, 2, 4, 8):
        raise ValueError(f"emit: esize must be 1, 2, 4 or 8, got {esize}")
    if identity and esize != 1:
        raise ValueError("emit: an identity lut is uint8 (esize 1)")
    R = lanes
    v32, v16, v8 = ir.VectorType(_I32, R), ir.VectorType(_I16, R), ir.VectorType(_I8, R)
    v8x2 = ir.VectorType(_I8, 2 * R)
    elem = ir.IntType(8 * esize)
    module = ir.Module(name)
    fn = ir.Function(module, _FNTY, name)
    for arg, arg_name in zip(fn.args, _ARGS, strict=True):
        arg.name = arg_name
        arg.add_attribute("noalias")  # every buffer is a distinct array of the caller's
    params, src, ybounds, yweights, xbounds, xweights, block, out, lut = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    start = fn.append_basic_block("start")
    b.branch(start)
    b.position_at_end(start)

    def param(k):
        return b.load(_at(b, params, _c64(8 * k), _I64))

    def i32_at(base, index):  # base[index] of an int32 array, as i64
        return b.sext(b.load(_at(b, base, b.shl(index, _c64(2)), _I32)), _I64)

    src_row, j0, span, ky, kx = (param(k) for k in (P_SRC_ROW, P_J0, P_SPAN, P_KY, P_KX))
    cs, ys, xs, lut_row = (param(k) for k in (P_OUT_CS, P_OUT_YS, P_OUT_XS, P_LUT_ROW))
    out_h, out_w = param(P_OUT_H), param(P_OUT_W)
    flip = b.icmp_signed("!=", param(P_FLIP), _c64(0))
    span_full = b.and_(span, _c64(-R))
    vround = _splat(b, ir.Constant(_I32, 1 << (vshift - 1)), R)
    hround = _splat(b, ir.Constant(_I32, 1 << (hshift - 1)), R)
    v_vshift = _splat(b, ir.Constant(_I32, vshift), R)
    v_hshift = _splat(b, ir.Constant(_I32, hshift), R)
    zero, top = _splat(b, ir.Constant(_I32, 0), R), _splat(b, ir.Constant(_I32, 255), R)
    top16 = _splat(b, ir.Constant(_I16, 255), R)
    src_h = param(P_SRC_H)
    # The vertical taps of one block, tap-major: (source byte offset, weight) of tap t of row r
    # at [t * R + r]. Sized for the widest filter (ky taps).
    toff = b.alloca(_I64, size=b.mul(ky, _c64(R)))
    tw = b.alloca(_I32, size=b.mul(ky, _c64(R)))
    with b.goto_block(fn.entry_basic_block):
        vaccs = [b.alloca(v32) for _ in range(R)]
        vaccs2 = [b.alloca(ir.VectorType(_I16, 2 * R)) for _ in range(R)] if narrow else []
        haccs16 = [b.alloca(ir.VectorType(_I16, (2 if c + 1 < stride else 1) * R))
                   for c in range(0, channels, 2)] if narrow else []
        sacc = b.alloca(_I32)
        haccs = [b.alloca(v32) for _ in range(channels)]
        tile = b.alloca(v8, size=channels * R)  # a group's [channel][pixel] row vectors, as bytes
    velem = ir.VectorType(elem, R)
    # NOTE [...] 7: a float32 (any 4-byte) lut is looked up by gathers after the transpose.
    gathered = narrow and esize == 4 and not identity
    gather = None
    if gathered:
        vptr = ir.VectorType(_I32.as_pointer(), R)
        gather = ir.Function(module, ir.FunctionType(ir.VectorType(_I32, R), [
            vptr, _I32, ir.VectorType(ir.IntType(1), R), ir.VectorType(_I32, R)]),
            f"llvm.masked.gather.v{R}i32.v{R}p0")
    reverse = ir.Constant(ir.VectorType(_I32, R), list(range(R - 1, -1, -1)))
    prefetch = ir.Function(module, ir.FunctionType(ir.VoidType(), [_P8, _I32, _I32, _I32]),
                           "llvm.prefetch.p0")

    with _for(b, _c64(0), out_h, R) as o0:
        left = b.sub(out_h, o0)
        rows = b.select(b.icmp_signed("<", left, _c64(R)), left, _c64(R))
        # Every row of the block runs K taps, K the most any of its rows has: a row with fewer
        # gets zero weights on a clamped (valid) source row. One loop shape for all R rows keeps
        # their accumulators in registers, where a loop per row spilled them and branched per row.
        # Rows past the image (a short last block) get no taps: they hold zeros, never stored.
        taps, ymins, wrows = [], [], []
        K = _c64(0)
        for r in range(R):
            y = b.add(o0, _c64(r))
            inside = b.icmp_signed("<", y, out_h)
            y = b.select(inside, y, b.sub(out_h, _c64(1)))
            n = b.select(inside, i32_at(ybounds, b.add(b.shl(y, _c64(1)), _c64(1))), _c64(0))
            taps.append(n)
            ymins.append(i32_at(ybounds, b.shl(y, _c64(1))))
            wrows.append(b.mul(y, ky))
            K = b.select(b.icmp_signed(">", n, K), n, K)
        last_row = b.sub(src_h, _c64(1))
        with _for(b, _c64(0), K) as t:
            for r in range(R):
                row = b.add(ymins[r], t)
                row = b.select(b.icmp_signed(">", row, last_row), last_row, row)
                slot = b.add(b.mul(t, _c64(R)), _c64(r))
                b.store(b.add(b.mul(row, src_row), j0), b.gep(toff, [slot]))
                w = b.trunc(i32_at(yweights, b.add(wrows[r], t)), _I32)
                if narrow:  # the Q15 weight in both halves: its splat is then a load
                    w = b.or_(w, b.shl(w, ir.Constant(_I32, 16)))
                b.store(b.select(b.icmp_signed("<", t, taps[r]), w, ir.Constant(_I32, 0)),
                        b.gep(tw, [slot]))

        def tap(t, r):  # (source byte offset, weight) of tap t of row r
            slot = b.add(b.mul(t, _c64(R)), _c64(r))
            return b.load(b.gep(toff, [slot])), b.load(b.gep(tw, [slot]))

        # NOTE [...] 8: the block's source rows, PREFETCH_BYTES ahead of the columns at hand.
        first_row = ymins[0]
        end_row = b.add(ymins[R - 1], K)
        end_row = b.select(b.icmp_signed(">", end_row, src_h), src_h, end_row)

        def prefetch_ahead(j, step):  # once per 64-byte line of the columns [j, j + step)
            with b.if_then(b.icmp_signed("<", b.and_(j, _c64(63)), _c64(step))):
                ahead = b.add(b.add(j0, j), _c64(PREFETCH_BYTES))
                with _for(b, first_row, end_row) as y:
                    b.call(prefetch, [b.gep(src, [b.add(b.mul(y, src_row), ahead)]),
                                      ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

        def vertical_exact():
            # Vertical pass, R columns at a time: R row vectors, transposed into R column vectors.
            with _for(b, _c64(0), span_full, R) as j:
                prefetch_ahead(j, R)
                for acc in vaccs:
                    b.store(vround, acc)
                with _for(b, _c64(0), K) as t:
                    for r, acc in enumerate(vaccs):
                        off, w = tap(t, r)
                        px = b.zext(b.load(_at(b, src, b.add(off, j), v8), align=1), v32)
                        b.store(b.add(b.load(acc), b.mul(px, _splat(b, w, R))), acc)
                row_vecs = [b.trunc(b.lshr(b.load(acc), v_vshift), v16) for acc in vaccs]
                for k, col in enumerate(_transpose(b, row_vecs)):
                    dst = _at(b, block, b.shl(b.mul(b.add(j, _c64(k)), _c64(R)), _c64(1)), v16)
                    b.store(col, dst, align=2)
            # The columns past the last whole vector, one value at a time.
            with _for(b, span_full, span) as j:
                for r in range(R):
                    b.store(ir.Constant(_I32, 1 << (vshift - 1)), sacc)
                    with _for(b, _c64(0), K) as t:
                        off, w = tap(t, r)
                        px = b.zext(b.load(b.gep(src, [b.add(off, j)])), _I32)
                        b.store(b.add(b.load(sacc), b.mul(px, w)), sacc)
                    dst = _at(b, block, b.shl(b.add(b.mul(j, _c64(R)), _c64(r)), _c64(1)), _I16)
                    b.store(b.trunc(b.lshr(b.load(sacc), ir.Constant(_I32, vshift)), _I16), dst)

        def vertical_narrow():  # NOTE [...] 6: 2R columns per vector, in 16 bits
            R2 = 2 * R
            v16x2, v32x2 = ir.VectorType(_I16, R2), ir.VectorType(_I32, R2)
            # Each row's accumulator starts at half its taps: each product below is floored,
            # losing half a unit on average, so the sum is unbiased.
            inits = [_splat(b, b.trunc(b.lshr(n, _c64(1)), _I16), R2) for n in taps]
            zeros8 = ir.Constant(v8x2, [0] * R2)
            high_bytes = ir.Constant(ir.VectorType(_I32, 2 * R2), [k for i in range(R2) for k in (R2, i)])
            sixteen = _splat(b, ir.Constant(_I32, 16), R2)
            lo_half = ir.Constant(ir.VectorType(_I32, R), list(range(R)))
            hi_half = ir.Constant(ir.VectorType(_I32, R), list(range(R, R2)))

            def step(j):  # source columns [j, j + 2R) of the block's R rows, into the block
                prefetch_ahead(j, R2)
                for acc, init in zip(vaccs2, inits, strict=True):
                    b.store(init, acc)
                with _for(b, _c64(0), K) as t:
                    for r, acc in enumerate(vaccs2):
                        off, w = tap(t, r)
                        # The bytes as the high halves of 16-bit lanes: pixel << 8, one shuffle.
                        px = b.bitcast(b.shuffle_vector(
                            b.load(_at(b, src, b.add(off, j), v8x2), align=1), zeros8, high_bytes), v16x2)
                        w16 = b.bitcast(_splat(b, w, R), v16x2)
                        # (pixel << 8) * w >> 16, unsigned: pmulhuw; Q7 for a Q15 weight.
                        prod = b.trunc(b.lshr(b.mul(b.zext(px, v32x2), b.zext(w16, v32x2)), sixteen),
                                       v16x2)
                        b.store(b.add(b.load(acc), prod), acc)
                rows_now = [b.load(acc) for acc in vaccs2]
                if R in (8, 16):
                    for k, col in _transpose_words(b, rows_now):
                        dst = _at(b, block, b.shl(b.mul(b.add(j, _c64(k)), _c64(R)), _c64(1)), v16)
                        b.store(col, dst, align=2)
                    return
                for half, first in ((lo_half, 0), (hi_half, R)):
                    cols = _transpose(b, [b.shuffle_vector(v, ir.Constant(v16x2, ir.Undefined), half)
                                          for v in rows_now])
                    for k, col in enumerate(cols):
                        dst = _at(b, block, b.shl(b.mul(b.add(j, _c64(first + k)), _c64(R)), _c64(1)), v16)
                        b.store(col, dst, align=2)

            span_full2 = b.and_(span, _c64(-R2))
            with _for(b, _c64(0), span_full2, R2) as j:
                step(j)
            # The last columns: one more vector ending at the span's end, over columns already
            # done (they get the same values again); only a span under 2R goes one at a time.
            wide = b.icmp_signed(">=", span, _c64(R2))
            with b.if_then(b.and_(wide, b.icmp_signed("<", span_full2, span))):
                step(b.sub(span, _c64(R2)))
            with _for(b, b.select(wide, span, _c64(0)), span) as j:
                for r in range(R):
                    b.store(b.trunc(b.lshr(taps[r], _c64(1)), _I32), sacc)
                    with _for(b, _c64(0), K) as t:
                        off, w = tap(t, r)
                        w = b.and_(w, ir.Constant(_I32, 0xFFFF))
                        px = b.shl(b.zext(b.load(b.gep(src, [b.add(off, j)])), _I32), ir.Constant(_I32, 8))
                        b.store(b.add(b.load(sacc), b.lshr(b.mul(px, w), ir.Constant(_I32, 16))), sacc)
                    dst = _at(b, block, b.shl(b.add(b.mul(j, _c64(R)), _c64(r)), _c64(1)), _I16)
                    b.store(b.trunc(b.load(sacc), _I16), dst)

        if narrow:
            vertical_narrow()
        else:
            vertical_exact()

        # Horizontal pass: per output pixel, each tap of each channel is one vector of R rows.
        # Channels in pairs: channel c + 1's R rows follow channel c's in the block, so one
        # vector of 2R lanes carries both (the pixel's padding byte rides along where C is odd).
        pairs = [(c, 2 if c + 1 < stride else 1) for c in range(0, channels, 2)]

        def resample_x_narrow(x):  # resample_x in 16 bits (NOTE [...] 6)
            xmin = i32_at(xbounds, b.shl(x, _c64(1)))
            n = i32_at(xbounds, b.add(b.shl(x, _c64(1)), _c64(1)))
            # Half a unit to round the final shift, and half a unit per floored product.
            init = b.trunc(b.add(_c64(1 << (NARROW_XFRAC - 1)), b.lshr(n, _c64(1))), _I16)
            for (_, width), acc in zip(pairs, haccs16, strict=True):
                b.store(_splat(b, init, width * R), acc)
            wrow = b.mul(x, kx)
            with _for(b, _c64(0), n) as t:
                w = b.trunc(i32_at(xweights, b.add(wrow, t)), _I16)
                base = b.mul(b.add(xmin, t), _c64(stride * R))
                for (c, width), acc in zip(pairs, haccs16, strict=True):
                    vt16, vt32 = ir.VectorType(_I16, width * R), ir.VectorType(_I32, width * R)
                    p = _at(b, block, b.shl(b.add(base, _c64(c * R)), _c64(1)), vt16)
                    prod = b.mul(b.zext(b.load(p, align=2), vt32), b.zext(_splat(b, w, width * R), vt32))
                    prod = b.trunc(b.lshr(prod, _splat(b, ir.Constant(_I32, 16), width * R)), vt16)
                    b.store(b.add(b.load(acc), prod), acc)
            values = []
            for (c, width), acc in zip(pairs, haccs16, strict=True):
                for k in range(min(width, channels - c)):
                    v = b.shuffle_vector(b.load(acc), ir.Constant(acc.type.pointee, ir.Undefined),
                                         ir.Constant(ir.VectorType(_I32, R), list(range(k * R, k * R + R))))
                    v = b.lshr(v, _splat(b, ir.Constant(_I16, NARROW_XFRAC), R))
                    v = b.select(b.icmp_unsigned(">", v, top16), top16, v)
                    values.append(b.zext(v, v32))
            return values

        def resample_x(x):  # output pixel x of the block's R rows: C clamped <R x i32>
            if narrow:
                return resample_x_narrow(x)
            xmin = i32_at(xbounds, b.shl(x, _c64(1)))
            n = i32_at(xbounds, b.add(b.shl(x, _c64(1)), _c64(1)))
            for acc in haccs:
                b.store(hround, acc)
            wrow = b.mul(x, kx)
            with _for(b, _c64(0), n) as t:
                w = _splat(b, b.trunc(i32_at(xweights, b.add(wrow, t)), _I32), R)
                # Element index of (pixel xmin + t, channel 0, row 0) in the block.
                base = b.mul(b.add(xmin, t), _c64(stride * R))
                for c, acc in enumerate(haccs):
                    p = _at(b, block, b.shl(b.add(base, _c64(c * R)), _c64(1)), v16)
                    px = b.zext(b.load(p, align=2), v32)
                    b.store(b.add(b.load(acc), b.mul(px, w)), acc)
            values = []
            for acc in haccs:
                v = b.ashr(b.load(acc), v_hshift)
                v = b.select(b.icmp_signed("<", v, zero), zero, v)
                values.append(b.select(b.icmp_signed(">", v, top), top, v))
            return values

        def store_column(x, values):  # one pixel's R rows: R scattered stores per channel
            xo = b.select(flip, b.sub(b.sub(out_w, _c64(1)), x), x)
            obase = b.add(b.mul(xo, xs), b.mul(o0, ys))

            def store(c, v, r):  # out[c, o0 + r, xo] = lut[c, v[r]]
                byte = b.zext(b.extract_element(v, r), _I64)
                e = b.load(_at(b, lut, b.add(b.mul(_c64(c), lut_row), b.mul(byte, _c64(esize))), elem),
                           align=esize)
                dst = _at(b, out, b.add(b.add(obase, b.mul(_c64(c), cs)), b.mul(b.zext(r, _I64), ys)), elem)
                b.store(e, dst, align=esize)

            with b.if_else(b.icmp_signed("==", rows, _c64(R))) as (whole, partial):
                with whole:  # every block but the last: R stores per channel, unrolled
                    for c, v in enumerate(values):
                        for r in range(R):
                            store(c, v, ir.Constant(_I32, r))
                with partial:
                    for c, v in enumerate(values):
                        with _for(b, _c64(0), rows) as r:
                            store(c, v, b.trunc(r, _I32))

        def store_rows(xg):
            # R pixels from xg: per channel, their R x R values transposed to R rows of R pixels,
            # each stored as one vector, mirrored by a lane reversal under flip.
            xstart = b.select(flip, b.sub(b.sub(out_w, xg), _c64(R)), xg)
            for c in range(channels):
                row_vecs = _transpose(b, [b.load(b.gep(tile, [_c64(c * R + k)])) for k in range(R)])
                dst0 = b.add(b.add(b.mul(_c64(c), cs), b.mul(o0, ys)), b.mul(xstart, xs))
                for r, v in enumerate(row_vecs):
                    with b.if_then(b.icmp_signed("<", _c64(r), rows)):
                        if not identity:  # lut[c, v] for the row's R pixels: one gather
                            v = lookup(c, v)
                        e = b.select(flip, b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), reverse), v)
                        b.store(e, _at(b, out, b.add(dst0, b.mul(_c64(r), ys)), velem), align=esize)

        def lookup(c, v):  # <R x i8> levels -> <R x i32> entries of lut row c (esize 4)
            row = _at(b, lut, b.mul(_c64(c), lut_row), _I32)
            pointers = _lanes_at(b, row, b.zext(v, ir.VectorType(_I32, R)))
            every = ir.Constant(ir.VectorType(ir.IntType(1), R), [1] * R)
            return b.call(gather, [pointers, ir.Constant(_I32, 4), every,
                                   ir.Constant(ir.VectorType(_I32, R), ir.Undefined)])

        # With an identity lut (uint8 out, nothing to look up), whole groups of R pixels go
        # through a transpose when a row's pixels are adjacent in ``out`` (NCHW): one vector store
        # per row instead of R scattered ones. So does a 4-byte lut under NOTE [...] 7, one
        # gather per row. Without fast gathers (AVX2) LLVM loads the R entries one by one, and
        # the transpose costs more than the stores it saves (measured). The rest, per pixel.
        groups_end = _c64(0)
        if identity or gathered:
            grouped = b.icmp_signed("==", xs, _c64(esize))
            groups_end = b.select(grouped, b.and_(out_w, _c64(-R)), _c64(0))
            with _for(b, _c64(0), groups_end, R) as xg:
                for k in range(R):
                    for c, v in enumerate(resample_x(b.add(xg, _c64(k)))):
                        b.store(b.trunc(v, v8), b.gep(tile, [_c64(c * R + k)]))
                store_rows(xg)
        with _for(b, groups_end, out_w) as x:
            store_column(x, resample_x(x))
    b.ret_void()

    text = str(module)
    # Let the backend use registers as wide as the vectors (NOTE [...] 1): without these,
    # LLVM splits 512-bit vectors in two on CPUs tuned to prefer 256 bits.
    bits = 32 * R
    head = text.index(f'define void @"{name}"')
    brace = text.index("\n{", head)
    return (text[:brace] + " #0" + text[brace:] + f'\nattributes #0 = {{ nounwind '
            f'"prefer-vector-width"="{bits}" "min-legal-vector-width"="{bits}" }}\n')


_lock = threading.Lock()
_compiled: dict[tuple[int, ...], int] = {}
_engines: list = []  # the JIT engines own the code: kept for the life of the process


def _target_machine(cpu: str, features: str, jit: bool):
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=cpu, features=features, opt=3,
                                        codemodel="jitdefault" if jit else "default", jit=jit)


def _optimized(text: str, tm) -> llvm.ModuleRef:
    mod = llvm.parse_assembly(text)
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return mod


def _shifts() -> tuple[int, int]:
    from . import image  # the fixed point is image's (NOTE [...] 2)

    return image._VSHIFT, image._HSHIFT


def kernel(stride: int, channels: int, esize: int, lanes: int | None = None,
           identity: bool = False, narrow: bool = False) -> int:
    """Address of the kernel compiled for :func:`target`'s CPU, for (source bytes per pixel,
    output channels, output element size, whether the lut is uint8's identity, 16-bit
    arithmetic) at ``lanes`` (default :func:`vector_lanes`; any power of two runs on any CPU,
    LLVM splitting what is wider than its registers), compiled on first use (NOTE [a kernel
    generated ...] 4) or loaded from the object cache. Thread-safe."""
    lanes = vector_lanes() if lanes is None else lanes
    key = (stride, channels, esize, lanes, identity, narrow)
    address = _compiled.get(key)
    if address is not None:
        return address
    with _lock:
        if key not in _compiled:
            name = (f"tp_resample_r{lanes}_s{stride}_c{channels}_e{esize}{'_id' if identity else ''}"
                    f"{'_n16' if narrow else ''}")
            cpu, features = target()
            tm = _target_machine(cpu, features, True)
            text = emit(lanes, stride, channels, esize, *_shifts(), name, identity, narrow)
            cache = ObjectCache(text, cpu, features)
            if cache.hit():  # MCJIT takes the object; the IR is only its identity
                mod = llvm.parse_assembly(text)
                mod.triple, mod.data_layout = tm.triple, str(tm.target_data)
            else:
                mod = _optimized(text, tm)
            engine = llvm.create_mcjit_compiler(mod, tm)
            engine.set_object_cache(cache.store, cache.load)
            engine.finalize_object()
            _engines.append(engine)
            _compiled[key] = engine.get_function_address(name)
        return _compiled[key]


def assembly(cpu: str | None = None, lanes: int | None = None, stride: int = 4,
             channels: int = 3, esize: int = 4, narrow: bool = False) -> str:
    """The kernel's x86/ARM assembly as compiled for ``cpu`` (an LLVM CPU name, e.g.
    ``"haswell"``, ``"skylake-avx512"``, with that CPU's default features; default: this CPU
    and its lanes) at ``lanes`` int32 lanes: to check the vector width a machine would run at,
    from any machine (NOTE [a kernel generated ...] 1)."""
    if cpu is None:
        tm = _target_machine(*target(), False)
        lanes = vector_lanes() if lanes is None else lanes
    else:
        if lanes is None:
            raise ValueError("assembly: name the lanes for another cpu")
        tm = _target_machine(cpu, "", False)
    name = f"tp_resample_r{lanes}_s{stride}_c{channels}_e{esize}"
    text = emit(lanes, stride, channels, esize, *_shifts(), name, narrow=narrow)
    return tm.emit_assembly(_optimized(text, tm))


@intrinsic
def call_kernel(typingctx, address, params, src, ybounds, yweights, xbounds, xweights, block, out,
                lut):
    """From Numba: call the kernel at ``address`` (from :func:`kernel`) on these arrays' data.
    The arrays stay the caller's (NOTE [...] 5); no reference is taken."""
    sig = types.void(address, params, src, ybounds, yweights, xbounds, xweights, block, out, lut)

    def codegen(context, builder, signature, args):
        pointers = []
        for ty, value in zip(signature.args[1:], args[1:], strict=True):
            data = context.make_array(ty)(context, builder, value).data
            pointers.append(builder.bitcast(data, _P8))
        target = builder.inttoptr(args[0], _FNTY.as_pointer())
        builder.call(target, pointers)
        return context.get_dummy_value()

    return sig, codegen
