"""One-shot collectives of a small message through rows of shared memory, in one compiled call:
the allreduce, and the allgather, gather and broadcast that only copy.

For small messages the cost of an allreduce is its fixed overhead, not its bytes, so every step
runs in one call: copy the message into this process's row, publish the collective's signature
and a new step (release), poll until every peer reached the step (acquire), check that all
signatures agree, and reduce all rows into the output (every process reduces the whole message,
so nobody waits a second time; never into its shared row, which the others are still reading),
dividing for ``avg``. Native rows are reduced straight into ``dst``; 16-bit rows go through
private scratch and are then widened or copied out.

Layouts: ``rows`` is the C-contiguous ``(p, row_len)`` array of the node's rows, the message
occupies ``rows[:, h:h+n]``; ``board`` is the ``(p, words)`` int64 table of
``terrapipe.comm.transports.board.Board``: column 0 holds each process's step counter, column
``SLEEPERS_COL`` how many processes sleep on it (NOTE [sleeping on a counter] in sync.py),
columns ``[sig_col, sig_col + len(sig))`` the signature slot of this step. (Few arguments on purpose:
each array argument costs about 0.1 us of dispatch, a large part of a 4 KiB allreduce.)
``scratch`` is a private row of ``rows``' dtype and length; ``acc`` float32 scratch of at least
``reduce.TILE`` elements.

The copying ones (:func:`oneshot_gather`, :func:`oneshot_broadcast`) move bytes: their messages
and ``rows`` are uint8 whatever the caller's dtype (one compiled kernel for every dtype; a copy
needs no type), and they take no scratch.

Returns: ``-1`` done; ``r >= 0`` the signature of row ``r`` differs from row 0 (nothing was
reduced); ``WAITING`` (-2) when a peer had not arrived within ``spins`` polls: the caller waits
(looking at the clock and at its peers' liveness), checks the signatures and calls
:func:`finish`. The row must not be written again before every peer has passed a later step
(the caller alternates halves of the row: NOTE [row halves] in ``terrapipe.comm.transports.shm``).
"""

from __future__ import annotations

from numba import njit, types
from numba.extending import overload

from .floats import compress, decompress
from .reduce import divide_16, divide_float, divide_int, reduce_many_16, reduce_many_native, reduce_rows_into
from .sync import publish_step, rows_equal, spin_until

__all__ = ["WAITING", "SLEEPERS_COL", "oneshot_allreduce", "finish", "collect", "oneshot_gather",
           "gather_rows", "oneshot_broadcast", "copy_row"]

WAITING = -2
SLEEPERS_COL = 3  # the board's column counting the processes asleep on each step counter


# The three layouts (native rows; 16-bit rows; float32 sent as 16-bit) differ only in how data goes
# into a row, how rows are reduced and how the result comes out. Those three steps are chosen from
# the argument types when the kernel is compiled, so one kernel serves every layout and the choice
# costs nothing at run time (Numba types every branch of a runtime ``if``, so a flag cannot do it).

def _transfer(src, dst, kind):
    """``dst[:] = src``: float32 into uint16 bits of 16-bit ``kind`` (rounded), those bits back
    into float32 (exact), or a plain copy when the dtypes are the same."""
    raise NotImplementedError("compiled use only")


def _reduce_rows(scratch, rows, op, h, n, divisor, kind, acc):
    """``scratch[h:h+n] = op over rows[:, h:h+n]``, divided once by ``divisor`` when > 1."""
    raise NotImplementedError("compiled use only")


@overload(_transfer, inline="always")
def _transfer_impl(src, dst, kind):
    if src.dtype == dst.dtype:
        def copy(src, dst, kind):
            for i in range(src.shape[0]):
                dst[i] = src[i]
        return copy
    if dst.dtype == types.uint16:
        return lambda src, dst, kind: compress(src, dst, kind)
    return lambda src, dst, kind: decompress(src, dst, kind)


@overload(_reduce_rows, inline="always")
def _reduce_rows_impl(scratch, rows, op, h, n, divisor, kind, acc):
    if rows.dtype == types.uint16:
        def bits16(scratch, rows, op, h, n, divisor, kind, acc):
            reduce_many_16(scratch, rows, op, h, n, kind, acc)
            if divisor > 1:
                divide_16(scratch, divisor, h, n, kind)
        return bits16
    divide = divide_int if isinstance(rows.dtype, types.Integer) else divide_float

    def native(scratch, rows, op, h, n, divisor, kind, acc):
        reduce_many_native(scratch, rows, op, h, n)
        if divisor > 1:
            divide(scratch, divisor, h, n)
    return native


def _reduce_out(dst, rows, op, h, n, divisor, kind, scratch, acc):
    """``dst[:n]`` = op over ``rows[:, h:h+n]`` (divided once by ``divisor`` when > 1)."""
    raise NotImplementedError("compiled use only")


@overload(_reduce_out, inline="always")
def _reduce_out_impl(dst, rows, op, h, n, divisor, kind, scratch, acc):
    if rows.dtype == dst.dtype and rows.dtype != types.uint16:
        # Native: straight into dst, tile by tile (no second pass over a scratch row).
        divide = divide_int if isinstance(rows.dtype, types.Integer) else divide_float

        def direct(dst, rows, op, h, n, divisor, kind, scratch, acc):
            reduce_rows_into(dst, rows, op, h, n)
            if divisor > 1:
                divide(dst, divisor, 0, n)
        return direct

    def staged(dst, rows, op, h, n, divisor, kind, scratch, acc):
        _reduce_rows(scratch, rows, op, h, n, divisor, kind, acc)
        _transfer(scratch[h:h + n], dst, kind)
    return staged


@njit(nogil=True, cache=True, inline="always")
def _meet(board, sig_col, me, sig, step, spins):
    steps = board[:, 0]
    slot = board[:, sig_col:sig_col + sig.shape[0]]
    publish_step(slot, me, sig, steps, board[:, SLEEPERS_COL], step)
    if not spin_until(steps, step, spins):
        return WAITING
    return rows_equal(slot)


@njit(nogil=True, cache=True)
def finish(dst, rows, h, op, divisor, kind, scratch, acc):
    """Reduce ``rows[:, h:h+n]`` (n = ``dst.shape[0]``) into ``dst``: native rows
    (float32/float64/int32/int64; floor division for integers) or uint16-held 16-bit floats of
    format ``kind`` accumulated in float32 and rounded once; a float32 ``dst`` over uint16 rows
    receives the widened result."""
    _reduce_out(dst, rows, op, h, dst.shape[0], divisor, kind, scratch, acc)


@njit(nogil=True, cache=True)
def oneshot_allreduce(src, dst, rows, h, me, board, sig_col, sig, step, op, divisor, kind, scratch, acc,
                      spins, lo):
    """The whole allreduce: ``src`` and ``dst`` 1-D (may alias) of ``rows``' dtype, or float32
    over uint16 rows (sent rounded to 16-bit ``kind``). Arguments as in :func:`finish` and the
    module's layouts. ``lo``: reduce only elements ``[lo, lo + len(dst))`` of the message into
    ``dst`` (a part of it, as the one-shot across nodes does, NOTE [one-shot across nodes] in
    comm/algorithms/oneshot_nodes.py); the whole message is still published."""
    n = src.shape[0]
    _transfer(src, rows[me, h:h + n], kind)
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1:
        finish(dst, rows, h + lo, op, divisor, kind, scratch, acc)
    return state


@njit(nogil=True, cache=True)
def collect(dst, rows, h, part, kind):
    """``dst[j*part : (j+1)*part] = rows[j, h + j*part : ...]`` for every row j (the last part
    ending at ``len(dst)``): each rank's finished part of a message, out of the node's rows
    (NOTE [one-shot across nodes] 5 in comm/algorithms/oneshot_nodes.py). ``dst`` of ``rows``'
    dtype, or float32 over uint16 rows of 16-bit ``kind`` (widened). Read only: ``rows``."""
    n = dst.shape[0]
    for j in range(rows.shape[0]):
        lo = min(j * part, n)
        hi = min(lo + part, n)
        _transfer(rows[j, h + lo:h + hi], dst[lo:hi], kind)


@njit(nogil=True, cache=True, inline="always")
def _copy(src, dst):
    """``dst[:] = src`` for 1-D arrays of one length: a loop over 1-D views (2-D indexing with
    an offset, ``rows[q, h + i]``, kept LLVM from turning it into a vector copy: a 64 KiB
    allgather took 156 us at 2 ranks that way, MPICH's 18)."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(nogil=True, cache=True)
def gather_rows(out, rows, h, order):
    """``out[order[q], :] = rows[q, h : h + n]`` for every local row q (n = ``out.shape[1]``).
    ``out``: (group size, n) uint8, C-contiguous, written; ``rows``: uint8, read only; ``order``:
    int64, the group rank of each local row (on one node, every row of ``out`` is some row's)."""
    n = out.shape[1]
    for q in range(order.shape[0]):
        _copy(rows[q, h:h + n], out[order[q]])


@njit(nogil=True, cache=True)
def oneshot_gather(src, out, rows, h, me, board, sig_col, sig, step, spins, order, collect):
    """The whole allgather of this rank's ``src`` (1-D uint8, n bytes) into ``out`` ((group size,
    n) uint8, written where ``collect``: every rank for an allgather, the root for a gather),
    rows as in :func:`gather_rows`, the rest as in the module's layouts. Every rank publishes
    its bytes with its signature, so a gather costs the root what an allgather does and the
    others one copy."""
    _copy(src, rows[me, h:h + src.shape[0]])
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1 and collect:
        gather_rows(out, rows, h, order)
    return state


@njit(nogil=True, cache=True)
def copy_row(x, rows, h, q):
    """``x[:] = rows[q, h : h + len(x)]``: a peer's published bytes. ``x``: 1-D uint8, written;
    ``rows``: uint8, read only."""
    _copy(rows[q, h:h + x.shape[0]], x)


@njit(nogil=True, cache=True)
def oneshot_broadcast(src, dst, rows, h, me, board, sig_col, sig, step, spins, root):
    """The whole broadcast from local row ``root``: that rank publishes its ``src`` (1-D uint8,
    read only) with its signature, the others only their signatures, and then copy the root's
    row into their ``dst`` (1-D uint8, written). The root's ``dst`` and the others' ``src`` are
    not touched (the root's message may be read-only: it is only read). Arguments as in
    :func:`oneshot_gather`."""
    if me == root:
        _copy(src, rows[me, h:h + src.shape[0]])
    state = _meet(board, sig_col, me, sig, step, spins)
    if state == -1 and me != root:
        copy_row(dst, rows, h, root)
    return state
