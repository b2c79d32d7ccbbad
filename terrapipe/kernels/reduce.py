"""Elementwise reductions for collectives: ``dst op= src`` and ``dst = op(src_0, ..., src_k)``.

Every kernel works on a chunk ``[offset, offset + length)`` of flat 1-D arrays so that callers
(the shared-memory and ring collectives in ``terrapipe.comm``) can stream a large message through
cache-sized pieces and overlap chunks with copies. Nothing here allocates.

Dtypes: float32, float64, int32, int64 natively; float16 and bfloat16 travel as ``uint16`` bit
patterns (see :mod:`terrapipe.kernels.floats`) and are accumulated in float32, rounded once on
store. ``avg`` is ``sum`` followed by :func:`divide` by the number of contributors (floor
division for integers), so a multi-step reduction rounds the average exactly once.

The compiled kernels take integer op codes; :func:`reduce_into`, :func:`reduce_many_into` and
:func:`divide` are the checked Python entry points that map dtypes and op names onto them.

Why one module: the reduction kernels share the op codes, the tile size and the 16-bit
accumulation helpers; each is short, and together they are what a collective calls.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .floats import BF16, F16, from_f32, to_f32

__all__ = [
    "SUM",
    "PROD",
    "MIN",
    "MAX",
    "AVG",
    "OPS",
    "op_code",
    "reduce_rows_into",
    "allreduce_rows",
    "reduce_native",
    "reduce_16",
    "reduce_many_native",
    "reduce_many_16",
    "reduce_pair",
    "divide_float",
    "divide_int",
    "divide_16",
    "reduce_into",
    "reduce_many_into",
    "divide",
    "kernel_dtype",
    "TILE",
]

SUM = 0
PROD = 1
MIN = 2
MAX = 3
AVG = 4  # SUM in the kernels; the caller divides once at the end

OPS = {"sum": SUM, "prod": PROD, "min": MIN, "max": MAX, "avg": AVG}

# Elements per tile in the multi-source kernels: small enough that the destination tile stays in
# L1 while every source is folded into it, large enough for the vector loop to amortise.
TILE = 2048


def op_code(op: str | int) -> int:
    """Map an op name (``"sum"``, ``"avg"``, ``"min"``, ``"max"``, ``"prod"``) to its code."""
    code = OPS.get(op) if isinstance(op, str) else None
    if code is not None:  # the common case first: a lower-case name
        return code
    if isinstance(op, (int, np.integer)) and int(op) in OPS.values():
        return int(op)
    try:
        return OPS[str(op).lower()]
    except KeyError:
        raise ValueError(f"op: unknown reduction {op!r}; expected one of {sorted(OPS)}") from None


@njit(nogil=True, cache=True, inline="always")
def _combine(a, b, op):
    # min/max propagate NaN like np.minimum / np.maximum.
    if op == PROD:
        return a * b
    # Bitwise | (not ``or``): no short-circuit branch, so the select vectorizes.
    if op == MIN:
        return a if (a < b) | (a != a) else b
    if op == MAX:
        return a if (a > b) | (a != a) else b
    return a + b


# NOTE [chunk views]: every kernel first slices its chunk (``dst[offset:offset+length]``) and then
# loops from 0. Indexing the full array from ``offset`` instead leaves LLVM unable to prove the
# loop free of aliasing/overflow and it does not vectorize: measured 2x slower on float32 sums.


@njit(nogil=True, cache=True, inline="always")
def _fold(d, s, op):
    """``d op= s`` elementwise over ``d``'s length (native dtypes): :func:`_pair_native` with
    ``d`` as its output and left operand (one array to LLVM, so the loop vectorizes); inlined
    into each caller."""
    _pair_native(d, d, s, op, 0)


@njit(nogil=True, cache=True)
def reduce_native(dst, src, op, offset, length):
    """``dst[offset:offset+length] = op(dst, src)`` for float32/float64/int32/int64 (1-D).

    The op branch sits outside each loop so every loop body is a single vectorizable operation.
    """
    _fold(dst[offset : offset + length], src[offset : offset + length], op)


@njit(nogil=True, cache=True)
def reduce_16(dst, src, op, offset, length, kind):
    """``dst op= src`` on uint16-held float16 (``kind=F16``) or bfloat16 (``kind=BF16``) chunks,
    computed in float32 and rounded to nearest even once per element: :func:`_pair_16` with
    ``dst`` as its output and left operand."""
    d = dst[offset : offset + length]
    _pair_16(d, d, src[offset : offset + length], op, kind)


@njit(nogil=True, cache=True)
def reduce_many_native(dst, srcs, op, offset, length):
    """``dst[i] = op(srcs[0, i], ..., srcs[k-1, i])`` for ``i`` in the chunk (native dtypes).

    ``srcs`` is 2-D ``(k, n)``: typically one row per rank of a shared-memory segment. ``dst``
    may be one of the rows (exactly, not a partial overlap). The chunk is walked in L1-sized
    tiles with the source loop outside the element loop, so the inner loop vectorizes and each
    ``dst`` tile is written back once.
    """
    k = srcs.shape[0]
    if k == 0 or length == 0:
        return
    # dst may be one of the rows (a rank's own slot in shared memory): then that row is the
    # starting value and is not folded in twice. Found by address, once per call.
    first = 0
    addr = dst[offset:].ctypes.data
    for r in range(k):
        if srcs[r, offset:].ctypes.data == addr:
            first = r
    for t0 in range(offset, offset + length, TILE):
        t1 = min(t0 + TILE, offset + length)
        n = t1 - t0
        d = dst[t0:t1]
        s0 = srcs[first, t0:t1]
        for i in range(n):
            d[i] = s0[i]
        for r in range(k):
            if r != first:
                _fold(d, srcs[r, t0:t1], op)


@njit(nogil=True, cache=True)
def reduce_rows_into(dst, srcs, op, offset, length):
    """``dst[j] = op(srcs[0, offset + j], ..., srcs[k-1, offset + j])`` for ``j < length``
    (native dtypes): :func:`reduce_many_native` into an array of its own (a caller's output,
    never one of the rows), so a result needs no second pass to reach it. ``dst``: 1-D, at
    least ``length`` elements, written only there. Same tiling, same order of operations."""
    k = srcs.shape[0]
    if length == 0:
        return
    for t0 in range(0, length, TILE):
        t1 = min(t0 + TILE, length)
        n = t1 - t0
        d = dst[t0:t1]
        s0 = srcs[0, offset + t0:offset + t1]
        for i in range(n):
            d[i] = s0[i]
        for r in range(1, k):
            _fold(d, srcs[r, offset + t0:offset + t1], op)


@njit(nogil=True, cache=True)
def allreduce_rows(rows, me, op, offset, length, divisor):
    """Every row's ``[offset, offset + length)`` = op over all rows of those columns, divided by
    ``divisor`` (true division for floats, floor division for integers; 1: none), for native
    dtypes. ``rows``: 2-D ``(k, n)``, one row per rank of a shared-memory segment, all written;
    ``me``: the row that accumulates, whose value comes first in every fold. The caller owns
    these columns of every row for the call (no other rank reads or writes them meanwhile).

    Why: a rank's part of an in-place allreduce over node-shared rows, in one pass. Each tile is
    reduced into ``rows[me]`` while it sits in L1, divided there, and stored into the other rows
    from L1, so a byte is read once and written once per row (reduce, divide and copy-back as
    three passes move about 1.75x as much at two ranks). Same order of operations as
    :func:`reduce_many_native` then :func:`divide`: the bytes are theirs."""
    k = rows.shape[0]
    if length == 0:
        return
    mine = rows[me]
    q = rows.dtype.type(divisor)
    for t0 in range(offset, offset + length, TILE):
        t1 = min(t0 + TILE, offset + length)
        n = t1 - t0
        d = mine[t0:t1]
        for r in range(k):
            if r != me:
                _fold(d, rows[r, t0:t1], op)
        if divisor != 1:
            _divide(d, q)
        for r in range(k):
            if r != me:
                o = rows[r, t0:t1]
                for i in range(n):
                    o[i] = d[i]


def _divide(d, q):
    """``d /= q`` in place: true division for floats (torch's avg), floor division for integers
    (NumPy's ``//``); chosen when compiled, from ``d``'s dtype."""


@overload(_divide, inline="always")
def _divide_typed(d, q):
    if isinstance(d.dtype, types.Integer):
        def floor(d, q):
            for i in range(d.shape[0]):
                d[i] = d[i] // q
        return floor

    def true(d, q):
        for i in range(d.shape[0]):
            d[i] = d[i] / q
    return true


@njit(nogil=True, cache=True, inline="always")
def _many_16_of(dst, srcs, op, offset, length, kind, acc):
    """:func:`reduce_many_16`'s loops for one format, passed as a constant (the conversions'
    choice folds away, NOTE [conversions as intrinsics] in floats.py)."""
    k = srcs.shape[0]
    for t0 in range(offset, offset + length, TILE):
        t1 = min(t0 + TILE, offset + length)
        n = t1 - t0
        s0 = srcs[0, t0:t1]
        for i in range(n):
            acc[i] = to_f32(s0[i], kind)
        for r in range(1, k):
            s = srcs[r, t0:t1]
            if op == SUM or op == AVG:
                for i in range(n):
                    acc[i] += to_f32(s[i], kind)
            else:
                for i in range(n):
                    acc[i] = _combine(acc[i], to_f32(s[i], kind), op)
        d = dst[t0:t1]
        for i in range(n):
            d[i] = from_f32(acc[i], kind)


@njit(nogil=True, cache=True)
def reduce_many_16(dst, srcs, op, offset, length, kind, acc):
    """Multi-source reduce on uint16-held float16/bfloat16: every element is accumulated over all
    ``k`` sources in float32 and rounded once, so the result never passes through intermediate
    16-bit roundings. ``acc`` is caller-owned float32 scratch of at least ``TILE`` elements
    (or ``length`` if smaller), reused tile by tile."""
    if srcs.shape[0] == 0:
        return
    if kind == F16:
        _many_16_of(dst, srcs, op, offset, length, F16, acc)
    else:
        _many_16_of(dst, srcs, op, offset, length, BF16, acc)


def _pair(dst, first, second, op, kind):
    """``dst = first op second``, chosen when compiled from ``dst``'s dtype (uint16: 16-bit)."""


@njit(nogil=True, cache=True, inline="always")
def _pair_native(dst, first, second, op, kind):
    """``dst = first op second`` for native dtypes (``kind``: none, taken as the 16-bit loop's)."""
    n = dst.shape[0]
    if op == SUM or op == AVG:
        for i in range(n):
            dst[i] = first[i] + second[i]
    elif op == PROD:
        for i in range(n):
            dst[i] = first[i] * second[i]
    elif op == MIN:
        for i in range(n):
            dst[i] = _combine(first[i], second[i], MIN)
    else:
        for i in range(n):
            dst[i] = _combine(first[i], second[i], MAX)


@njit(nogil=True, cache=True, inline="always")
def _pair_16_of(dst, first, second, op, kind):
    """:func:`_pair_16`'s loops for one format, passed as a constant: its conversions then
    inline without a branch per element."""
    if op == SUM or op == AVG:
        for i in range(dst.shape[0]):
            dst[i] = from_f32(to_f32(first[i], kind) + to_f32(second[i], kind), kind)
    else:
        for i in range(dst.shape[0]):
            dst[i] = from_f32(_combine(to_f32(first[i], kind), to_f32(second[i], kind), op), kind)


@njit(nogil=True, cache=True, inline="always")
def _pair_16(dst, first, second, op, kind):
    """``dst = first op second`` on uint16-held 16-bit floats, in float32, rounded once; the
    format's branch outside the loops."""
    if kind == F16:
        _pair_16_of(dst, first, second, op, F16)
    else:
        _pair_16_of(dst, first, second, op, BF16)


# NOTE [pair kernels]
#     1. An output that is one of the operands is passed to the loop as itself: LLVM then sees
#        one array where it would check two for overlap, fail the check and run the scalar loop
#        (3-6x slower on float32 and bfloat16, 64K elements). So reduce_pair has three loops,
#        one per case (into its first operand, into its second, apart), each a compiled
#        function of its own over one or two arrays.
#     2. Why functions of their own and not three inlined copies of the loop in one: Numba
#        inlines ``inline="always"`` functions by copying their IR into the caller, and the cost
#        grows with each level and each copy. Three inlined copies of the 16-bit loop (itself two
#        formats of inlined conversions) took 23 s to compile for uint16 on a 2-core Xeon, and
#        one copy in each of three functions 9 s in all, the loops as fast (64K elements, every
#        case and format). Numba spends that time copying IR, not in LLVM.
#        A rank's first collective across nodes waits for it, and so does every cold CI run.


@njit(nogil=True, cache=True)
def _native_into_first(dst, second, op, kind):
    """``dst = dst op second`` (native dtypes; NOTE [pair kernels])."""
    _pair_native(dst, dst, second, op, kind)


@njit(nogil=True, cache=True)
def _native_into_second(dst, first, op, kind):
    """``dst = first op dst`` (native dtypes; NOTE [pair kernels])."""
    _pair_native(dst, first, dst, op, kind)


@njit(nogil=True, cache=True)
def _native_apart(dst, first, second, op, kind):
    """``dst = first op second``, ``dst`` neither operand (native dtypes; NOTE [pair kernels])."""
    _pair_native(dst, first, second, op, kind)


@njit(nogil=True, cache=True)
def _16_into_first(dst, second, op, kind):
    """``dst = dst op second`` (uint16-held 16-bit floats; NOTE [pair kernels])."""
    _pair_16(dst, dst, second, op, kind)


@njit(nogil=True, cache=True)
def _16_into_second(dst, first, op, kind):
    """``dst = first op dst`` (uint16-held 16-bit floats; NOTE [pair kernels])."""
    _pair_16(dst, first, dst, op, kind)


@njit(nogil=True, cache=True)
def _16_apart(dst, first, second, op, kind):
    """``dst = first op second``, ``dst`` neither operand (16-bit; NOTE [pair kernels])."""
    _pair_16(dst, first, second, op, kind)


@overload(_pair, inline="always")
def _pair_typed(dst, first, second, op, kind):
    if dst.dtype == types.uint16:
        into_first, into_second, apart = _16_into_first, _16_into_second, _16_apart
    else:
        into_first, into_second, apart = _native_into_first, _native_into_second, _native_apart

    def by_aliasing(dst, first, second, op, kind):
        if dst.ctypes.data == first.ctypes.data:
            into_first(dst, second, op, kind)
        elif dst.ctypes.data == second.ctypes.data:
            into_second(dst, first, op, kind)
        else:
            apart(dst, first, second, op, kind)
    return by_aliasing


@njit(nogil=True, cache=True)
def reduce_pair(dst, first, second, op, kind):
    """``dst[i] = op(first[i], second[i])``, ``first`` the left operand (min/max keep its NaN and
    its signed zero on ties, so the order is part of the result's bits). All three 1-D of one
    dtype and ``dst``'s length: native, or uint16-held 16-bit floats of format ``kind``
    accumulated in float32 and rounded once (the bits :func:`reduce_many_16` gives for two
    sources). ``dst`` may be ``first`` or ``second`` (the same elements, not a shifted overlap).

    Why: a round of the reduce-scatter between nodes (NOTE [MPI from compiled code] 8 in
    comm/transports/mpi_native.py) reduces its own data, wherever it lies, with the peer's
    message in place, where the rows' kernels would need both copied into one array first."""
    _pair(dst, first, second, op, kind)


@njit(nogil=True, cache=True)
def divide_float(dst, divisor, offset, length):
    """``dst /= divisor`` on a chunk of a float32/float64 array (true division, like torch's avg)."""
    _divide(dst[offset : offset + length], dst.dtype.type(divisor))


@njit(nogil=True, cache=True)
def divide_int(dst, divisor, offset, length):
    """``dst //= divisor`` on a chunk of an int32/int64 array (floor division, like NumPy)."""
    _divide(dst[offset : offset + length], dst.dtype.type(divisor))


@njit(nogil=True, cache=True)
def divide_16(dst, divisor, offset, length, kind):
    """``dst /= divisor`` on uint16-held float16/bfloat16, in float32, rounded once."""
    d = dst[offset : offset + length]
    q = np.float32(divisor)
    if kind == F16:
        for i in range(length):
            d[i] = from_f32(to_f32(d[i], F16) / q, F16)
    else:
        for i in range(length):
            d[i] = from_f32(to_f32(d[i], BF16) / q, BF16)


# --- checked entry points -------------------------------------------------------------------

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))


def kernel_dtype(arr: np.ndarray, dtype: str | None = None) -> tuple[np.ndarray, int]:
    """Return ``(view, kind)``: the array as the kernels see it and its 16-bit kind (0 = native).

    ``dtype="bfloat16"`` marks a uint16 array as bfloat16 bits; float16 arrays are viewed as
    uint16. Raises ``TypeError`` naming the dtype for anything the kernels do not handle.
    """
    if dtype == "bfloat16":
        if arr.dtype != np.uint16:
            raise TypeError(f"dtype='bfloat16' needs uint16 bit patterns, got {arr.dtype}")
        return arr, BF16
    if dtype is not None and np.dtype(dtype) != arr.dtype:
        raise TypeError(f"dtype={dtype!r} does not match the array's dtype {arr.dtype}")
    if arr.dtype == np.float16:
        return arr.view(np.uint16), F16
    if arr.dtype in _NATIVE:
        return arr, 0
    raise TypeError(
        f"unsupported dtype {arr.dtype}: expected float32, float64, float16, int32, int64 "
        "or uint16 with dtype='bfloat16'"
    )


def _chunk(n: int, offset: int, length: int | None) -> tuple[int, int]:
    if length is None:
        length = n - offset
    if offset < 0 or length < 0 or offset + length > n:
        raise ValueError(f"chunk [offset={offset}, length={length}) is outside an array of {n}")
    return offset, length


def _flat(name: str, arr: np.ndarray) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return arr


def reduce_into(
    dst: np.ndarray,
    src: np.ndarray,
    op: str | int = "sum",
    *,
    offset: int = 0,
    length: int | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """``dst[offset:offset+length] op= src[offset:offset+length]``, in place on ``dst``.

    dst, src: 1-D arrays of the same dtype and length (any stride). ``op="avg"`` only sums: call
    :func:`divide` once all contributions are in. Returns ``dst``.
    """
    _flat("dst", dst)
    _flat("src", src)
    if dst.dtype != src.dtype:
        raise TypeError(f"dst dtype {dst.dtype} != src dtype {src.dtype}")
    if dst.shape != src.shape:
        raise ValueError(f"dst shape {dst.shape} != src shape {src.shape}")
    code = op_code(op)
    offset, length = _chunk(dst.shape[0], offset, length)
    d, kind = kernel_dtype(dst, dtype)
    s, _ = kernel_dtype(src, dtype)
    if kind:
        reduce_16(d, s, code, offset, length, kind)
    else:
        reduce_native(d, s, code, offset, length)
    return dst


def reduce_many_into(
    dst: np.ndarray,
    srcs: np.ndarray,
    op: str | int = "sum",
    *,
    offset: int = 0,
    length: int | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """``dst[i] = op(srcs[0, i], ..., srcs[k-1, i])`` over the chunk. srcs: 2-D ``(k, n)``."""
    _flat("dst", dst)
    if not isinstance(srcs, np.ndarray) or srcs.ndim != 2:
        raise ValueError(f"srcs: expected a 2-D (k, n) array, got {getattr(srcs, 'shape', srcs)}")
    if srcs.dtype != dst.dtype:
        raise TypeError(f"dst dtype {dst.dtype} != srcs dtype {srcs.dtype}")
    if srcs.shape[1] != dst.shape[0]:
        raise ValueError(f"srcs rows have {srcs.shape[1]} elements, dst has {dst.shape[0]}")
    code = op_code(op)
    offset, length = _chunk(dst.shape[0], offset, length)
    d, kind = kernel_dtype(dst, dtype)
    s, _ = kernel_dtype(srcs, dtype)
    if kind:
        acc = np.empty(min(length, TILE), np.float32)
        reduce_many_16(d, s, code, offset, length, kind, acc)
    else:
        reduce_many_native(d, s, code, offset, length)
    return dst


def divide(
    dst: np.ndarray,
    divisor: int | float,
    *,
    offset: int = 0,
    length: int | None = None,
    dtype: str | None = None,
) -> np.ndarray:
    """``dst /= divisor`` over the chunk, the second half of ``avg``. Integers floor-divide."""
    _flat("dst", dst)
    if divisor == 0:
        raise ZeroDivisionError("divisor must be non-zero")
    offset, length = _chunk(dst.shape[0], offset, length)
    d, kind = kernel_dtype(dst, dtype)
    if kind:
        divide_16(d, divisor, offset, length, kind)
    elif d.dtype.kind == "f":
        divide_float(d, divisor, offset, length)
    else:
        divide_int(d, int(divisor), offset, length)
    return dst
