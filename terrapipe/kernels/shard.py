"""Chunks of a parameter-server shard: take the chunk's lock, apply an update rule, read, release.

A shard is a 1-D array (float32, float64, int32 or int64) in memory that several processes map
(``terrapipe.ps``). It is cut into chunks; chunk ``k`` is guarded by the spin lock word
``locks[k * LOCK_STRIDE]`` (one cache line per lock, so a rank spinning on one chunk does not
slow the traffic on its neighbour). A lock word is 0 when free, else the token of its holder
(its rank + 1), so a waiter that gives up can name who holds it.

Rules (``rule``): ``ADD`` ``shard += scale * src`` (``scale == 1`` adds exactly, so integer
sums are exact), ``COPY`` ``shard = src``, ``ZERO`` ``shard = 0``, ``NONE`` leaves the shard as
it is. With a non-empty ``out`` the chunk is then copied out under the same lock: a pull never
sees half of a concurrent push to a chunk, and a push-pull is atomic per chunk.
"""

from __future__ import annotations

from numba import njit

from .sync import compare_exchange, load_acquire, store_release

__all__ = ["ADD", "COPY", "ZERO", "NONE", "RULES", "LOCK_STRIDE", "apply_rule", "locked_apply",
           "holder"]

ADD = 0
COPY = 1
ZERO = 2
NONE = 3
RULES = {"add": ADD, "copy": COPY, "zero": ZERO}
LOCK_STRIDE = 8  # int64 words per lock: one 64-byte cache line


@njit(nogil=True, cache=True)
def apply_rule(shard, src, out, rule, scale):
    """Apply ``rule`` to ``shard`` (1-D, the chunk's elements) with ``src`` (same length and
    dtype; ignored for ZERO and NONE), then copy the result into ``out`` unless it is empty.

    ``scale`` has the shard's dtype (an integer for integer shards). Caller holds the lock."""
    n = shard.shape[0]
    if rule == ADD:
        if scale == 1:
            for i in range(n):
                shard[i] += src[i]
        else:
            for i in range(n):
                shard[i] += scale * src[i]
    elif rule == COPY:
        for i in range(n):
            shard[i] = src[i]
    elif rule == ZERO:
        for i in range(n):
            shard[i] = 0
    if out.shape[0] != 0:
        for i in range(n):
            out[i] = shard[i]


@njit(nogil=True, cache=True)
def locked_apply(locks, lock, token, spins, shard, src, out, rule, scale):
    """:func:`apply_rule` under lock ``lock`` of ``locks`` (1-D int64, shared).

    Tries to take the lock ``spins`` times. Returns -1 when it applied the rule (and released
    the lock), else the token found in the lock word on the last try (0: it was just released),
    so the caller can yield, look at the clock and at the holder's liveness, and call again: a
    compiled loop cannot be interrupted.
    """
    word = lock * LOCK_STRIDE
    for _ in range(spins):
        if load_acquire(locks, word) == 0 and compare_exchange(locks, word, 0, token):
            apply_rule(shard, src, out, rule, scale)
            store_release(locks, word, 0)
            return -1
    return load_acquire(locks, word)


@njit(nogil=True, cache=True)
def holder(locks, lock):
    """The token in lock ``lock``'s word (0: free)."""
    return load_acquire(locks, lock * LOCK_STRIDE)
