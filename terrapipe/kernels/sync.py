"""Step counters in memory shared between processes: acquire loads, release stores, bounded spins,
and sleeping on a counter until a peer advances it (futex).

A compiled loop that polls an array element may read it once and keep the value in a register:
nothing in the loop tells LLVM that another process writes it. These kernels load and store the
counters atomically (``load atomic ... acquire`` / ``store atomic ... release``), which keeps the
loads inside the loop and orders them against the data around them. On x86-64 both are plain
``mov`` instructions, so a poll costs what a load costs.

Ordering contract (what NOTE [board protocol] in ``terrapipe.comm.transports.board`` builds on): every store a
process makes before :func:`store_release` of a counter is visible to a process that
:func:`load_acquire` s that counter's new value (or a later one) before it reads that data.

NOTE [sleeping on a counter]
    1. Why: a rank that waits milliseconds for a peer (DDP's bucket whose peer is still in
       backward, a rank that arrives late) should not spin. Where ranks outnumber free cores,
       as two ranks of backward plus two reduction threads on two cores do, a spinning waiter
       takes the core its own rank's backward needs. So past a short spin a waiter sleeps in
       the kernel (``FUTEX_WAIT``) on the counter it waits for.
    2. Protocol, per counter ``steps[q]`` with a count of sleepers ``sleepers[q]`` beside it.
       The waiter adds itself to ``sleepers[q]`` (a sequentially consistent read-modify-write),
       loads ``steps[q]`` again, and sleeps only if it is still short, on the low 32 bits of
       the value it saw. The publisher stores its counter (sequentially consistent), then
       loads its ``sleepers``, and only if it is non-zero issues ``FUTEX_WAKE``. Each side's
       first access is ordered before its second, so either the waiter sees the new step, or
       the publisher sees the sleeper and wakes it. A wake that comes before the waiter is in
       the kernel is not lost: ``FUTEX_WAIT`` returns at once when the word no longer holds
       the value it was given.
    3. Cost when nobody sleeps: the publisher's store becomes an ``xchg`` (x86-64), plus one
       load from the cache line its counter is in. No system call.
    4. Every sleep has a timeout (the caller's), after which the caller looks at the clock, at
       its peers' liveness, and drives MPI's progress (NOTE [MPI progress] 4 in
       ``terrapipe.comm.algorithms.ring``), then sleeps again.
    5. ``futex(2)`` is reached through libc's ``syscall()``, resolved by symbol in the process
       (as ``terrapipe.comm.transports.cma`` resolves ``process_vm_readv``), so the kernels can be cached
       on disk. ``syscall()`` is variadic in C; the declaration here passes integers only,
       which the x86-64 and AArch64 Linux implementations read from the registers a
       fixed-argument call fills. Elsewhere ``CAN_SLEEP`` is False and waiters only yield.
"""

from __future__ import annotations

import platform
import sys

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["load_acquire", "load_seq_cst", "store_release", "store_seq_cst", "fetch_add", "address_of",
           "compare_exchange", "spin_until", "yield_until", "release_step", "publish_step", "rows_equal",
           "sleep_until", "sig_digest", "sig_digests", "tables_agree", "CAN_SLEEP"]

# futex(2): its system call number per architecture (NOTE [sleeping on a counter] 5).
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower(), -1)
CAN_SLEEP = sys.platform.startswith("linux") and _SYS_FUTEX > 0
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the counters are shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF
_sched_yield = types.ExternalFunction("sched_yield", types.intc())
_syscall = types.ExternalFunction(
    "syscall", types.intp(types.intp, types.intp, types.intp, types.intp, types.intp, types.intp, types.intp))


def _element_pointer(context, builder, arrty, arr, idx, idxty):
    ary = context.make_array(arrty)(context, builder, arr)
    index = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)


def _int64_cell(arr, idx, *values) -> bool:
    """Whether the arguments type as (1-D int64 array, integer index, integer values...)."""
    return (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1
            and isinstance(idx, types.Integer) and all(isinstance(v, types.Integer) for v in values))


def _atomic_load(name: str, order: str, doc: str):
    """An intrinsic ``name(arr, idx)``: ``arr[idx]`` of a 1-D int64 array, loaded atomically
    with memory order ``order``."""
    def typer(typingctx, arr, idx):
        if not _int64_cell(arr, idx):
            return None

        def codegen(context, builder, signature, args):
            ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            return builder.load_atomic(ptr, order, 8)

        return types.int64(arr, idx), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _atomic_store(name: str, order: str, doc: str):
    """An intrinsic ``name(arr, idx, value)``: ``arr[idx] = value`` on a 1-D int64 array,
    stored atomically with memory order ``order``."""
    def typer(typingctx, arr, idx, value):
        if not _int64_cell(arr, idx, value):
            return None

        def codegen(context, builder, signature, args):
            ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            val = context.cast(builder, args[2], signature.args[2], types.int64)
            builder.store_atomic(val, ptr, order, 8)
            return context.get_dummy_value()

        return types.void(arr, idx, value), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


load_acquire = _atomic_load(
    "load_acquire", "acquire",
    """``arr[idx]`` of a 1-D int64 array, read with acquire ordering (never hoisted out of a loop).""")
load_seq_cst = _atomic_load(
    "load_seq_cst", "seq_cst",
    """``arr[idx]`` of a 1-D int64 array, sequentially consistent (the second access of either
    side of NOTE [sleeping on a counter] 2; a plain ``mov`` on x86-64, as an acquire load is).""")
store_release = _atomic_store(
    "store_release", "release",
    """``arr[idx] = value`` on a 1-D int64 array with release ordering: every earlier store of
    this thread is visible to whoever acquires the new value.""")
store_seq_cst = _atomic_store(
    "store_seq_cst", "seq_cst",
    """``arr[idx] = value`` on a 1-D int64 array, sequentially consistent: release ordering,
    and no later load of this thread is performed before it (``xchg`` on x86-64).""")


@intrinsic
def fetch_add(typingctx, arr, idx, delta):
    """Atomically ``arr[idx] += delta`` on a 1-D int64 array, sequentially consistent; returns
    the value before (``lock xadd`` on x86-64)."""
    if not _int64_cell(arr, idx, delta):
        return None
    sig = types.int64(arr, idx, delta)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return sig, codegen


@intrinsic
def address_of(typingctx, arr, idx):
    """The address of ``arr[idx]`` (1-D array of any layout) as an integer."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(idx, types.Integer)):
        return None
    sig = types.intp(arr, idx)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        return builder.ptrtoint(ptr, context.get_value_type(types.intp))

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, desired):
    """Atomically ``if arr[idx] == expected: arr[idx] = desired``; True when it swapped.

    ``arr``: 1-D int64 (shared memory). Sequentially consistent on success (a lock taken with
    it orders the critical section's loads after it), acquire on failure; one ``lock cmpxchg``
    on x86-64. The building block of the chunk locks in :mod:`terrapipe.kernels.shard`.
    """
    if not _int64_cell(arr, idx, expected, desired):
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
def yield_until(steps, target, spins, yields):
    """:func:`spin_until` with the core yielded between rounds of ``spins`` polls, at most
    ``yields`` times: True once every ``steps[i] >= target``, else False. For a wait that is
    usually short where ranks outnumber cores: the peer waited for may need this core, and the
    rounds between yields cost no Python (NOTE [waiting for a peer] in comm/wait.py)."""
    for _ in range(yields):
        if spin_until(steps, target, spins):
            return True
        _sched_yield()
    return spin_until(steps, target, spins)


@njit(nogil=True, cache=True, inline="always")
def _advance(steps, sleepers, me, step):
    """``steps[me] = step``, then wake whoever sleeps on it (NOTE [sleeping on a counter] 2)."""
    store_seq_cst(steps, me, step)
    if load_seq_cst(sleepers, me) != 0:
        _syscall(_SYS_FUTEX, address_of(steps, me), _FUTEX_WAKE, _WAKE_ALL, 0, 0, 0)


@njit(nogil=True, cache=True)
def release_step(steps, sleepers, me, step):
    """``steps[me] = step`` with release ordering (see the module's ordering contract), waking
    the peers that sleep on it. ``sleepers``: 1-D int64 beside ``steps``, one count per process
    (NOTE [sleeping on a counter] 2)."""
    _advance(steps, sleepers, me, step)


@njit(nogil=True, cache=True)
def publish_step(sig_slot, me, sig, steps, sleepers, step):
    """Write ``sig`` (1-D int64) into row ``me`` of ``sig_slot`` (2-D int64, zero-filling the rest
    of the row), then release ``steps[me] = step`` and wake its sleepers: a peer that sees the
    step sees the signature and every store made before this call (the data copied into the
    segment)."""
    row = sig_slot[me]
    k = sig.shape[0]
    for i in range(row.shape[0]):
        row[i] = sig[i] if i < k else 0
    _advance(steps, sleepers, me, step)


@njit(nogil=True, cache=True)
def sleep_until(steps, sleepers, target, timeout):
    """Sleep until the first counter below ``target`` changes, or ``timeout`` passes (NOTE
    [sleeping on a counter] 2); True when every ``steps[i] >= target`` already. A wake-up does
    not mean the target is reached: the caller polls again.

    steps, sleepers: 1-D int64, one per process (shared). timeout: int64 ``(2,)``, a relative
    ``struct timespec`` (seconds, nanoseconds), private."""
    for q in range(steps.shape[0]):
        if load_acquire(steps, q) >= target:
            continue
        fetch_add(sleepers, q, 1)
        seen = load_seq_cst(steps, q)
        if seen < target:
            _syscall(_SYS_FUTEX, address_of(steps, q), _FUTEX_WAIT, seen & 0xFFFFFFFF, timeout.ctypes.data,
                     0, 0)
        fetch_add(sleepers, q, -1)
        return False
    return True


@njit(nogil=True, cache=True)
def rows_equal(table):
    """Index of the first row of a 2-D array that differs from row 0, or -1 if all are equal."""
    for r in range(1, table.shape[0]):
        for i in range(table.shape[1]):
            if table[r, i] != table[0, i]:
                return r
    return -1


@njit(nogil=True, cache=True)
def sig_digest(sig):
    """A 64-bit digest of ``sig`` (1-D int64, a collective's signature): the same on every
    process and machine (no per-process seed), and where two signatures differ their digests
    differ but for a chance of 2**-64. Each word is mixed by splitmix64's finalizer into a
    running state, so a difference in any word, or words swapped, changes the result."""
    h = np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(sig.shape[0])
    for i in range(sig.shape[0]):
        z = h + np.uint64(sig[i]) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = z ^ (z >> np.uint64(31))
    return np.int64(h)


@njit(nogil=True, cache=True)
def sig_digests(sigs, out, col):
    """``out[r, col]`` = :func:`sig_digest` of row r of ``sigs`` ((rows, words) int64) for every
    row; ``out`` (rows or more, cols) int64, the caller's."""
    for r in range(sigs.shape[0]):
        out[r, col] = sig_digest(sigs[r])


@njit(nogil=True, cache=True)
def tables_agree(words, head, cols, ref):
    """Whether every rank named in every table of ``words`` agrees with ``ref``.

    ``words``: (messages, width) int64, one message per row (an exchange's inbox, NOTE
    [agreement across nodes] in comm/transports/shm.py), each beginning with a table of
    ``head`` words: rows of ``cols`` words, a rank's signature words then its group rank, or -1
    in the last word for a padding row, which is skipped. ``ref``: (cols - 1,) int64, the
    signature to agree with. All read only, owned by the caller."""
    sig = cols - 1
    for m in range(words.shape[0]):
        for r in range(0, head, cols):
            if words[m, r + sig] < 0:
                continue
            for i in range(sig):
                if words[m, r + i] != ref[i]:
                    return False
    return True
