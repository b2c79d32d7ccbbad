"""Step counters in memory shared between processes: acquire loads, release stores, bounded spins.

A compiled loop that polls an array element may read it once and keep the value in a register:
nothing in the loop tells LLVM that another process writes it. These kernels load and store the
counters atomically (``load atomic ... acquire`` / ``store atomic ... release``), which keeps the
loads inside the loop and orders them against the data around them. On x86-64 both are plain
``mov`` instructions, so a poll costs what a load costs.

Ordering contract (what NOTE [board protocol] in ``terrapipe.comm.shm`` builds on): every store a
process makes before :func:`store_release` of a counter is visible to a process that
:func:`load_acquire` s that counter's new value (or a later one) before it reads that data.
"""

from __future__ import annotations

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["load_acquire", "store_release", "compare_exchange", "spin_until", "release_step",
           "publish_step", "rows_equal"]


def _element_pointer(context, builder, arrty, arr, idx, idxty):
    ary = context.make_array(arrty)(context, builder, arr)
    index = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)


@intrinsic
def load_acquire(typingctx, arr, idx):
    """``arr[idx]`` of a 1-D int64 array, read with acquire ordering (never hoisted out of a loop)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1
            and isinstance(idx, types.Integer)):
        return None
    sig = types.int64(arr, idx)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, arr, idx, value):
    """``arr[idx] = value`` on a 1-D int64 array with release ordering: every earlier store of
    this thread is visible to whoever acquires the new value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1
            and isinstance(idx, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.void(arr, idx, value)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(val, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, desired):
    """Atomically ``if arr[idx] == expected: arr[idx] = desired``; True when it swapped.

    ``arr``: 1-D int64 (shared memory). Sequentially consistent on success (a lock taken with
    it orders the critical section's loads after it), acquire on failure; one ``lock cmpxchg``
    on x86-64. The building block of the chunk locks in :mod:`terrapipe.kernels.shard`.
    """
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1
            and isinstance(idx, types.Integer) and isinstance(expected, types.Integer)
            and isinstance(desired, types.Integer)):
        return None
    sig = types.boolean(arr, idx, expected, desired)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        cmp = context.cast(builder, args[2], signature.args[2], types.int64)
        val = context.cast(builder, args[3], signature.args[3], types.int64)
        pair = builder.cmpxchg(ptr, cmp, val, "seq_cst", "acquire")
        return builder.extract_value(pair, 1)

    return sig, codegen


@njit(nogil=True, cache=True)
def spin_until(steps, target, max_spins):
    """Poll until every ``steps[i] >= target`` (True) or ``max_spins`` polls have passed (False).

    ``steps``: 1-D int64, one counter per process. Bounded, so the caller can look at the clock
    and at its peers' liveness between rounds (a compiled loop cannot be interrupted).
    """
    n = steps.shape[0]
    for _ in range(max_spins):
        ready = True
        for i in range(n):
            if load_acquire(steps, i) < target:
                ready = False
                break
        if ready:
            return True
    return False


@njit(nogil=True, cache=True)
def release_step(steps, me, step):
    """``steps[me] = step`` with release ordering (see the module's ordering contract)."""
    store_release(steps, me, step)


@njit(nogil=True, cache=True)
def publish_step(sig_slot, me, sig, steps, step):
    """Write ``sig`` (1-D int64) into row ``me`` of ``sig_slot`` (2-D int64, zero-filling the rest
    of the row), then release ``steps[me] = step``: a peer that sees the step sees the signature
    and every store made before this call (the data copied into the segment)."""
    row = sig_slot[me]
    k = sig.shape[0]
    for i in range(row.shape[0]):
        row[i] = sig[i] if i < k else 0
    store_release(steps, me, step)


@njit(nogil=True, cache=True)
def rows_equal(table):
    """Index of the first row of a 2-D array that differs from row 0, or -1 if all are equal."""
    for r in range(1, table.shape[0]):
        for i in range(table.shape[1]):
            if table[r, i] != table[0, i]:
                return r
    return -1
