"""The one-shot allreduce: a small allreduce and its agreement in one compiled call
(kernels/oneshot.py) over the node's shared segment. Each rank publishes its data and signature
together in its row (one board step), and every rank reduces the whole message from every row
into a private scratch row, never into its own shared row, which the others are still reading.
One barrier where the other algorithms pay two or more; each rank reads p x n bytes, so it wins
for small messages only (NOTE [algorithm selection] 5 in comm/select.py).

NOTE [symmetric completion]
    A rank must not do first-call work after a collective's meeting point that its peers skip.
    In the one-shot, only a rank that arrived early and waited calls
    :func:`~terrapipe.kernels.oneshot.finish`; compiled lazily there (hundreds of milliseconds
    on a cold cache, milliseconds to load from a warm one), it left the collective that much
    later than the rank that arrived last, so a rank's next step started late and Horovod's
    barrier test, which times a barrier from the previous collective's return on each rank,
    measured a barrier shorter than the peer's sleep. So a plan compiles every kernel it may
    run after the meeting before its rank publishes (kernels/entry.py).
"""

from __future__ import annotations

import numpy as np

from ...kernels import entry_point, oneshot
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync

__all__ = ["allreduce", "plan", "limit", "ONESHOT_READ_BYTES", "ONESHOT_SPINS"]

# The one-shot allreduce (one barrier: data and signature published together, every rank reduces
# the whole message) has each rank read p x n bytes; it beats MPICH's Allreduce and our other
# paths while that stays within ONESHOT_READ_BYTES (measured here: at 2 ranks up to 2 MiB,
# 279 vs 337 us, not at 4 MiB; at 4 ranks up to 1 MiB, 404 vs 619 us, not at 2 MiB).
ONESHOT_READ_BYTES = 4 << 20
# Polls before a one-shot allreduce leaves its compiled call to wait while yielding the core.
ONESHOT_SPINS = 2000


def limit(shm) -> int:
    """The largest allreduce (bytes as exchanged) the one-shot takes on ``shm``'s node: half a
    row (a message fits a row half, NOTE [row halves] in comm/transports/shm.py), and at most
    ``ONESHOT_READ_BYTES`` read per rank."""
    return min(shm.row_bytes // 2, ONESHOT_READ_BYTES // max(shm.local_size, 1))


def allreduce(shm, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, coll: str,
              sig: np.ndarray, check) -> None:
    """``dst`` = op over every local rank's ``src``, with the agreement on ``sig`` (``check(sigs,
    ranks)`` raises on a mismatch). ``src``/``dst``: 1-D, ``dtype`` (the rows' dtype), or
    float32 over uint16 rows of 16-bit format ``kind`` (sent rounded). One node only; at most
    :func:`limit` bytes exchanged."""
    plan(shm, dtype, op, kind, coll, sig, check)(src, dst)


def plan(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check):
    """:func:`allreduce` with everything but the arrays fixed: a function ``(src, dst)``, one per
    signature (kept on the transport for the general path and the latency path alike,
    comm/select.py), which calls the compiled overload directly once it knows the argument
    types (skipping Numba's per-call type dispatch). Its attributes split a call in two for
    the latency path, which keeps the first half's answer: ``in_place(x)``, how a call in place
    on arrays like ``x`` runs, and ``run(src, dst, how)``, the call."""
    plans = shm.plans
    key = (dtype, op, kind, coll, sig.tobytes())
    made = plans.get(key)
    if made is None:
        if len(plans) > 256:
            plans.clear()
        made = plans[key] = _build(shm, dtype, op, kind, coll, sig, check)
    return made


def _build(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check):
    rows, scratch = shm.rows(dtype), shm.private_row(dtype)
    half = rows.shape[1] // 2
    board, me, acc = shm.board, shm.local_rank, shm.acc
    table, timeout = board.table, shm.timeout
    divisor = shm.size if op == kreduce.AVG else 1
    compiled = {}

    def call(src: np.ndarray, dst: np.ndarray) -> None:
        run(src, dst, in_place(src) if src is dst else _how(src, dst))

    def in_place(x: np.ndarray):
        """How a call in place on arrays like ``x`` runs, for :func:`run`: its kernels, compiled
        and looked up once per type (the latency path keeps them, comm/select.py)."""
        flags = x.flags
        key = (x.dtype, flags.c_contiguous, flags.writeable)
        fns = compiled.get(key)
        if fns is None:
            fns = compiled[key] = _compile(x, x)
        return fns

    def _how(src: np.ndarray, dst: np.ndarray):
        key = (src.dtype, src.flags.c_contiguous, src.flags.writeable, dst.dtype, dst.flags.c_contiguous)
        fns = compiled.get(key)
        if fns is None:
            fns = compiled[key] = _compile(src, dst)
        return fns

    def _compile(src: np.ndarray, dst: np.ndarray):
        """Both kernels a call of these types may run, before its rank publishes (NOTE
        [symmetric completion]). What Numba's type of an array depends on: dtype, layout,
        writeability."""
        h, step, col = 0, 1, 1  # any: only their types count here
        args = (src, dst, rows, h, me, table, col, sig, step, op, divisor, kind, scratch, acc,
                ONESHOT_SPINS, 0)
        return (entry_point(oneshot.oneshot_allreduce, args),
                entry_point(oneshot.finish, (dst, rows, h, op, divisor, kind, scratch, acc)))

    def run(src: np.ndarray, dst: np.ndarray, fns) -> None:
        """The call, with the kernels for arrays like these (:func:`in_place`)."""
        h = shm.next_half() * half
        step, col = board.reserve()
        state = fns[0](src, dst, rows, h, me, table, col, sig, step, op, divisor, kind, scratch, acc,
                       ONESHOT_SPINS, 0)
        if state == oneshot.WAITING:
            board.wait(step, timeout, coll)
            state = ksync.rows_equal(board.sigs(step))
            if state < 0:
                fns[1](dst, rows, h, op, divisor, kind, scratch, acc)
        if state >= 0:
            check(board.sigs(step), board.ranks)

    call.in_place = in_place
    call.run = run
    return call
