"""Small LLVM IR building blocks (llvmlite's ``ir``) for kernels emitted at run time: a counted
loop, a splat, a byte-addressed pointer, an R x R transpose by shuffles.

Used by :mod:`terrapipe.kernels.resample_ir`; each takes the ``IRBuilder`` positioned where the
code goes and leaves it after what it emitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import llvmlite.ir as ir

__all__ = ["c64", "for_range", "splat", "at", "lanes_at", "transpose", "transpose_words"]

_I32, _I64 = ir.IntType(32), ir.IntType(64)


def c64(v: int) -> ir.Constant:
    """The i64 constant ``v``."""
    return ir.Constant(_I64, v)


@contextmanager
def for_range(b: ir.IRBuilder, start, stop, step: int = 1) -> Iterator[ir.Value]:
    """``for i in range(start, stop, step)`` (i64, signed compare); yields ``i`` in the body."""
    fn = b.function
    with b.goto_block(fn.entry_basic_block):
        slot = b.alloca(_I64)
    b.store(start, slot)
    head = fn.append_basic_block("for.head")
    body = fn.append_basic_block("for.body")
    done = fn.append_basic_block("for.end")
    b.branch(head)
    b.position_at_end(head)
    i = b.load(slot)
    b.cbranch(b.icmp_signed("<", i, stop), body, done)
    b.position_at_end(body)
    yield i
    b.store(b.add(i, c64(step)), slot)
    b.branch(head)
    b.position_at_end(done)


def splat(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """``value`` in every one of ``lanes`` lanes (insert, then a zero shuffle: LLVM's broadcast)."""
    vt = ir.VectorType(value.type, lanes)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), zeros)


def at(b: ir.IRBuilder, base: ir.Value, byte_offset: ir.Value, ty: ir.Type) -> ir.Value:
    """Pointer to a ``ty`` at ``base + byte_offset``."""
    return b.bitcast(b.gep(base, [byte_offset]), ty.as_pointer())


def lanes_at(b: ir.IRBuilder, base: ir.Value, indices: ir.Value) -> ir.Value:
    """``<R x T*>``: ``&base[indices[k]]`` in lane k, for a ``T*`` base and ``<R x iN>`` indices:
    one ``getelementptr`` of the splat base by the vector index, the form in which x86's backend
    sees a uniform base and narrow indices and emits ``vpgatherdd`` (the same pointers made by
    integer adds reach it as 64-bit addresses: two ``vpgatherqd`` per 16 lanes)."""
    return b.gep(splat(b, base, indices.type.count), [indices], inbounds=True,
                 source_etype=base.type.pointee)


def transpose(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """R vectors of R lanes -> their transpose: log2(R) rounds pairing vector i with i + R/2
    and interleaving their low halves, then their high halves (NOTE [a kernel generated for the
    machine at hand] 3 in resample_ir.py)."""
    r = len(rows)
    half = r // 2
    mask_t = ir.VectorType(_I32, r)
    lo = ir.Constant(mask_t, [k for i in range(half) for k in (i, i + r)])
    hi = ir.Constant(mask_t, [k for i in range(half, r) for k in (i, i + r)])
    for _ in range(r.bit_length() - 1):
        out = []
        for i in range(half):
            out.append(b.shuffle_vector(rows[i], rows[i + half], lo))
            out.append(b.shuffle_vector(rows[i], rows[i + half], hi))
        rows = out
    return rows


def _unpack(n: int, g: int, high: bool) -> list[int]:
    # x86's unpack{lo,hi} of two n-word vectors at g words: within each 128-bit lane (8 words),
    # the low (or high) half's g-word groups of a and b, alternating. One in-lane shuffle.
    groups = range(4 // g, 8 // g) if high else range(4 // g)
    return [base + 8 * lane + i * g + k for lane in range(n // 8) for i in groups
            for base in (0, n) for k in range(g)]


def transpose_words(b: ir.IRBuilder, rows: list[ir.Value]) -> list[tuple[int, ir.Value]]:
    """R vectors of 2R 16-bit lanes (R = 8 or 16: a row each, 2R columns) -> the 2R columns as
    ``(column, <R x i16>)`` pairs. Three rounds of in-lane unpacks transpose each 128-bit lane's
    8 x 8 words (for each group of 8 rows), then for R = 16 one lane-crossing shuffle per pair
    joins a column's two halves: 4R + R shuffles where :func:`transpose` on each half takes
    2 R log2(R), and none crosses lanes but the last. Which column lands where is tracked by
    running the same shuffles on labels."""
    r = len(rows)
    if r not in (8, 16):
        raise ValueError(f"transpose_words: takes 8 or 16 rows, got {r}")
    n = 2 * r
    masks = {(g, hi): _unpack(n, g, hi) for g in (1, 2, 4) for hi in (False, True)}

    def shuffle(x, y, mask):  # (vector, labels) pairs
        both = x[1] + y[1]
        vec = b.shuffle_vector(x[0], y[0], ir.Constant(ir.VectorType(_I32, len(mask)), mask))
        return vec, [both[m] for m in mask]

    groups = []
    for g0 in range(0, r, 8):
        vs = [(rows[g0 + i], [(g0 + i, c) for c in range(n)]) for i in range(8)]
        for g, pairs in ((1, [(0, 1), (2, 3), (4, 5), (6, 7)]), (2, [(0, 2), (1, 3), (4, 6), (5, 7)]),
                         (4, [(0, 4), (1, 5), (2, 6), (3, 7)])):
            vs = [shuffle(vs[i], vs[k], masks[(g, hi)]) for i, k in pairs for hi in (False, True)]
        groups.append(vs)
    half = ir.Constant(ir.VectorType(_I32, r), list(range(r)))
    upper = ir.Constant(ir.VectorType(_I32, r), list(range(r, n)))
    out = []
    if r == 8:  # each 128-bit lane of a vector is one column's 8 rows
        pieces = groups[0]
    else:  # lanes (0, 1) and (2, 3) of the two groups' vectors: a column's rows 0-7 and 8-15
        pieces = []
        for p, q in zip(*groups, strict=True):
            for lanes in ((0, 1), (2, 3)):
                mask = [base + 8 * lane + k for lane in lanes for base in (0, n) for k in range(8)]
                pieces.append(shuffle(p, q, mask))
    for vec, labels in pieces:
        for sel, lo in ((half, 0), (upper, r)):
            col = labels[lo][1]
            if labels[lo:lo + r] != [(row, col) for row in range(r)]:
                raise AssertionError("transpose_words: a column's rows out of order")
            out.append((col, b.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), sel)))
    return out
