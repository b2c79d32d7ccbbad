"""One-shot allreduce of a small message through rows of shared memory, in one compiled call.

For small messages the cost of an allreduce is its fixed overhead, not its bytes, so every step
runs in one call: copy the message into this process's row, publish the collective's signature
and a new step (release), poll until every peer reached the step (acquire), check that all
signatures agree, reduce all rows into private scratch (every process reduces the whole message,
so nobody waits a second time), divide for ``avg``, and copy the result out.

Layouts: ``rows`` is the C-contiguous ``(p, row_len)`` array of the node's rows, the message
occupies ``rows[:, h:h+n]``; ``board`` is the ``(p, words)`` int64 table of
``terrapipe.comm.shm.Board``: column 0 holds each process's step counter, columns
``[sig_col, sig_col + len(sig))`` the signature slot of this step. (Few arguments on purpose:
each array argument costs about 0.1 us of dispatch, a large part of a 4 KiB allreduce.)
``scratch`` is a private row of ``rows``' dtype and length; ``acc`` float32 scratch of at least
``reduce.TILE`` elements.

Returns: ``-1`` done; ``r >= 0`` the signature of row ``r`` differs from row 0 (nothing was
reduced); ``WAITING`` (-2) when a peer had not arrived within ``spins`` polls: the caller waits
(looking at the clock and at its peers' liveness), checks the signatures and calls the matching
``finish_*`` kernel. The row must not be written again before every peer has passed a later step
(the caller alternates halves of the row: NOTE [row halves] in ``terrapipe.comm.group``).
"""

from __future__ import annotations

from numba import njit

from .floats import compress, decompress
from .reduce import divide_16, divide_float, divide_int, reduce_many_16, reduce_many_native
from .sync import publish_step, rows_equal, spin_until

__all__ = ["WAITING", "oneshot_native", "oneshot_16", "oneshot_compressed",
           "finish_native", "finish_16", "finish_compressed"]

WAITING = -2


@njit(nogil=True, cache=True, inline="always")
def _meet(board, sig_col, me, sig, step, spins):
    steps = board[:, 0]
    slot = board[:, sig_col:sig_col + sig.shape[0]]
    publish_step(slot, me, sig, steps, step)
    if not spin_until(steps, step, spins):
        return WAITING
    return rows_equal(slot)


@njit(nogil=True, cache=True)
def finish_native(dst, rows, h, op, divisor, is_int, scratch):
    """Reduce ``rows[:, h:h+n]`` (n = ``dst.shape[0]``, float32/float64/int32/int64) into ``dst``;
    ``divisor`` > 1 divides once (floor division when ``is_int``)."""
    n = dst.shape[0]
    reduce_many_native(scratch, rows, op, h, n)
    if divisor > 1:
        if is_int:
            divide_int(scratch, divisor, h, n)
        else:
            divide_float(scratch, divisor, h, n)
    out = scratch[h:h + n]
    for i in range(n):
        dst[i] = out[i]


@njit(nogil=True, cache=True)
def oneshot_native(src, dst, rows, h, me, board, sig_col, sig, step, op, divisor, is_int, scratch,
                   spins):
    """The whole allreduce for native dtypes: ``src``/``dst`` 1-D of ``rows``' dtype (may alias)."""
    n = src.shape[0]
    row = rows[me, h:h + n]
    for i in range(n):
        row[i] = src[i]
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1:
        finish_native(dst, rows, h, op, divisor, is_int, scratch)
    return state


@njit(nogil=True, cache=True)
def finish_16(dst, rows, h, op, divisor, kind, scratch, acc):
    """Reduce uint16-held float16/bfloat16 rows (``kind``) into ``dst`` (uint16) in float32."""
    n = dst.shape[0]
    reduce_many_16(scratch, rows, op, h, n, kind, acc)
    if divisor > 1:
        divide_16(scratch, divisor, h, n, kind)
    out = scratch[h:h + n]
    for i in range(n):
        dst[i] = out[i]


@njit(nogil=True, cache=True)
def oneshot_16(src, dst, rows, h, me, board, sig_col, sig, step, op, divisor, kind, scratch, acc,
               spins):
    """The whole allreduce for float16/bfloat16 held as uint16 (``src``, ``dst``, ``rows``)."""
    n = src.shape[0]
    row = rows[me, h:h + n]
    for i in range(n):
        row[i] = src[i]
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1:
        finish_16(dst, rows, h, op, divisor, kind, scratch, acc)
    return state


@njit(nogil=True, cache=True)
def finish_compressed(dst, rows, h, op, divisor, kind, scratch, acc):
    """As :func:`finish_16`, then widen the 16-bit result into float32 ``dst``."""
    n = dst.shape[0]
    reduce_many_16(scratch, rows, op, h, n, kind, acc)
    if divisor > 1:
        divide_16(scratch, divisor, h, n, kind)
    decompress(scratch[h:h + n], dst, kind)


@njit(nogil=True, cache=True)
def oneshot_compressed(src, dst, rows, h, me, board, sig_col, sig, step, op, divisor, kind, scratch,
                       acc, spins):
    """The whole allreduce of float32 ``src`` sent as 16-bit ``kind`` (float16/bfloat16) and
    accumulated in float32; the result is widened back into float32 ``dst``."""
    n = src.shape[0]
    compress(src, rows[me, h:h + n], kind)
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1:
        finish_compressed(dst, rows, h, op, divisor, kind, scratch, acc)
    return state
