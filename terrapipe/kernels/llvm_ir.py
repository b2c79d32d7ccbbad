"""Small LLVM IR building blocks (llvmlite's ``ir``) for kernels emitted at run time: a counted
loop, a splat, a byte-addressed pointer, an R x R transpose by shuffles.

Used by :mod:`terrapipe.kernels.resample_ir`; each takes the ``IRBuilder`` positioned where the
code goes and leaves it after what it emitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import llvmlite.ir as ir

__all__ = ["c64", "for_range", "splat", "at", "transpose"]

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
