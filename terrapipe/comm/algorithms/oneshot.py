"""The one-shot collectives: a small collective and its agreement in one compiled call
(kernels/oneshot.py) over the node's shared segment. Each rank publishes its data and signature
together in its row (one board step). In the allreduce every rank reduces the whole message
from every row into a private scratch row, never into its own shared row, which the others are
still reading: one barrier where the other algorithms pay two or more; each rank reads p x n
bytes, so it wins for small messages only (NOTE [algorithm selection] 5 in comm/select.py).
The allgather, the gather and the broadcast (:func:`gather_plan`, :func:`broadcast_plan`) only
copy: every rank (the broadcast's root) publishes its bytes with its signature and the ranks
that receive copy the rows out, one board step where the segment's way pays the agreement's
and then its chunk's; the reduce-scatter (:func:`reduce_scatter`) is the allreduce's call with
each rank reducing only its part (NOTE [one-shot copies]).

NOTE [one-shot copies]
    1. What the segment's way of an allgather or broadcast costs a small message is its two
       board steps (the agreement, then the chunk's barrier) and the Python around each, not
       its bytes: at 2 ranks a 4 KiB allgather took 30 us that way and a broadcast 22, where
       MPICH's took 4.6 and 5.2; the one-shot takes 10.0 and 5.5, and from 64 KiB to half a
       row runs level with MPICH or ahead (``python -m benchmarks.collectives``,
       ``collectives_n{2,4}_2026-12-04.json``).
    2. So they take the allreduce's shape: the signature published with the data in one
       board step, in one compiled call, a plan per signature holding everything but the
       arrays (for the latency paths, comm/select.py ``gather_small``, ``broadcast_small``
       and ``reduce_scatter_small``, and the general path alike, so ranks may mix the two).
    3. They move bytes: every dtype is its uint8 view, one kernel for all.
    4. Up to half a row (a message is one row half, NOTE [row halves] in
       comm/transports/shm.py): the segment's single chunk, with one board step fewer and no
       Python per chunk; larger ones take the segment's chunks (or single-copy, from
       ``single_copy.MIN_BYTES``). Unlike the allreduce, no ``ONESHOT_READ_BYTES`` bound: an
       allgather's rank reads p x n bytes whichever way it runs.
    5. A gather's ranks all publish, as in the allgather; only its root copies out. A
       broadcast's other ranks publish only their signatures.
    6. A reduce-scatter of up to half a row is the allreduce's one-shot with each rank
       reducing only its own part of the message (the kernel's ``lo``, as the one-shot across
       nodes reduces a local rank's part): one board step where the segment's way paid the
       agreement's and two per chunk (data in, parts reduced), and each rank reads p parts of
       its length, n bytes in all. 16-bit floats are reduced in float32 in the kernel, where
       the segment's way ran a whole allreduce for them. Private arrays go single-copy first,
       from ``single_copy.REDUCE_SCATTER_MIN_BYTES`` (1 MiB). At 2 ranks a 64 B reduce-scatter
       took 27.9 us the segment's way, MPICH's 4.0 and the one-shot 6.2; from 64 to 512 KiB the
       one-shot runs at 1.6-1.9x MPICH's speed (``collectives_n2_2026-12-04.json``).

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

__all__ = ["allreduce", "reduce_scatter", "plan", "limit", "half_row_limit", "gather_plan",
           "broadcast_plan",
           "ONESHOT_READ_BYTES", "ONESHOT_SPINS"]

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


def half_row_limit(shm) -> int:
    """The largest allgather, gather, broadcast or reduce-scatter (bytes each rank contributes;
    the broadcast's message) the one-shot takes on ``shm``'s node: half a row (NOTE [one-shot
    copies] 4 and 6)."""
    return shm.row_bytes // 2


def allreduce(shm, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, coll: str,
              sig: np.ndarray, check) -> None:
    """``dst`` = op over every local rank's ``src``, with the agreement on ``sig`` (``check(sigs,
    ranks)`` raises on a mismatch). ``src``/``dst``: 1-D, ``dtype`` (the rows' dtype), or
    float32 over uint16 rows of 16-bit format ``kind`` (sent rounded). One node only; at most
    :func:`limit` bytes exchanged."""
    plan(shm, dtype, op, kind, coll, sig, check)(src, dst)


def plan(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check, lo: int = 0):
    """:func:`allreduce` with everything but the arrays fixed: a function ``(src, dst)``, one per
    signature (kept on the transport for the general path and the latency path alike,
    comm/select.py), which calls the compiled overload directly once it knows the argument
    types (skipping Numba's per-call type dispatch). Its attributes split a call in two for
    the latency path, which keeps the first half's answer: ``in_place(x)``, how a call in place
    on arrays like ``x`` runs, and ``run(src, dst, how)``, the call. ``lo``: ``dst`` receives
    elements ``[lo, lo + len(dst))`` of the result only, the whole message still published
    (the one-shot reduce-scatter: :func:`reduce_scatter`)."""
    return _cached(shm, (dtype, op, kind, coll, sig.tobytes(), lo),
                   lambda: _build(shm, dtype, op, kind, coll, sig, check, lo))


def _cached(shm, key: tuple, build):
    """The plan kept on ``shm`` under ``key``, made by ``build()`` the first time (at most a few
    hundred kept: a job's calls have few distinct signatures)."""
    plans = shm.plans
    made = plans.get(key)
    if made is None:
        if len(plans) > 256:
            plans.clear()
        made = plans[key] = build()
    return made


def _settle(board, state: int, step: int, timeout: float, coll: str, check) -> bool:
    """After a one-shot's compiled call that did not return done (-1): ``state`` WAITING, a peer
    was late (wait for it as every wait does, then compare the signatures), or the first row
    whose signature differs (``check`` raises, naming every rank's call). True when the caller's
    finishing kernel must still run: it waited, and every signature agrees."""
    late = state == oneshot.WAITING
    if late:
        board.wait(step, timeout, coll)
        state = ksync.rows_equal(board.sigs(step))
    if state >= 0:
        check(board.sigs(step), board.ranks)
    return late


def reduce_scatter(shm, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int,
                   sig: np.ndarray, check, lo: int) -> None:
    """``dst`` = elements ``[lo, lo + len(dst))`` of op over every local rank's ``src`` (this
    rank's part of a reduce-scatter), with the agreement on ``sig``: every rank publishes its
    whole message and reduces its own part of it, one board step, each rank reading p parts
    of its length (NOTE [one-shot copies] 6). Arrays as in :func:`allreduce`, ``dst`` apart
    from ``src``; the message at most :func:`half_row_limit` bytes."""
    plan(shm, dtype, op, kind, "reduce_scatter", sig, check, lo)(src, dst)


def _build(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check, lo: int):
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
                       ONESHOT_SPINS, lo)
        if state != -1 and _settle(board, state, step, timeout, coll, check):
            fns[1](dst, rows, h + lo, op, divisor, kind, scratch, acc)

    call.in_place = in_place
    call.run = run
    return call


def gather_plan(shm, coll: str, sig: np.ndarray, check, root: int = -1):
    """The one-shot allgather (``root`` -1) or gather to group rank ``root`` (NOTE [one-shot
    copies]): a function ``(src, out)``, ``src`` this rank's message as 1-D uint8 (n bytes),
    ``out`` (group size, n) uint8, C-contiguous, written on every rank (allgather) or the root's
    only (gather). ``sig``: the call's signature; ``check(sigs, ranks)`` raises on a mismatch.
    One node only, n at most :func:`half_row_limit`. One per signature, kept on the transport."""
    return _cached(shm, ("gather", coll, root, sig.tobytes()),
                   lambda: _build_gather(shm, coll, sig, check, root))


def broadcast_plan(shm, sig: np.ndarray, check, root: int):
    """The one-shot broadcast from group rank ``root`` (NOTE [one-shot copies]): a function
    ``(x)``, ``x`` the message as 1-D uint8, read on the root (it may be read-only there) and
    written in place on the others (where a read-only ``x`` takes part in the call and then
    raises ValueError, so the peers complete it). Arguments as in :func:`gather_plan`."""
    return _cached(shm, ("broadcast", root, sig.tobytes()), lambda: _build_broadcast(shm, sig, check, root))


def _build_gather(shm, coll: str, sig: np.ndarray, check, root: int):
    rows = shm.rows(np.uint8)
    half = rows.shape[1] // 2
    board, me = shm.board, shm.local_rank
    table, timeout = board.table, shm.timeout
    order = np.asarray(board.ranks, np.int64)
    collect = root < 0 or shm.rank == root
    compiled = {}

    def call(src: np.ndarray, out: np.ndarray) -> None:
        # src: the caller's bytes, C-contiguous, perhaps read-only; out: always a new array's
        # (C-contiguous, writeable), so only src's writeability changes the kernels' types.
        key = src.flags.writeable
        fns = compiled.get(key)
        if fns is None:  # both kernels, before this rank publishes (NOTE [symmetric completion])
            args = (src, out, rows, 0, me, table, 1, sig, 1, ONESHOT_SPINS, order, collect)
            fns = compiled[key] = (entry_point(oneshot.oneshot_gather, args),
                                   entry_point(oneshot.gather_rows, (out, rows, 0, order)))
        h = shm.next_half() * half
        step, col = board.reserve()
        state = fns[0](src, out, rows, h, me, table, col, sig, step, ONESHOT_SPINS, order, collect)
        if state != -1 and _settle(board, state, step, timeout, coll, check) and collect:
            fns[1](out, rows, h, order)

    return call


def _build_broadcast(shm, sig: np.ndarray, check, root: int):
    rows = shm.rows(np.uint8)
    half = rows.shape[1] // 2
    board, me = shm.board, shm.local_rank
    table, timeout = board.table, shm.timeout
    lroot = board.ranks.index(root)
    nothing = np.empty(0, np.uint8)  # the side of the call a rank does not use
    compiled = {}

    def call(x: np.ndarray) -> None:
        read_only = me != lroot and not x.flags.writeable
        src, dst = (x, nothing) if me == lroot else (nothing, shm.private_row(np.uint8)[:x.shape[0]]
                                                     if read_only else x)
        key = (src.flags.writeable, dst.flags.writeable)  # both C-contiguous (see gather's)
        fns = compiled.get(key)
        if fns is None:  # NOTE [symmetric completion]
            args = (src, dst, rows, 0, me, table, 1, sig, 1, ONESHOT_SPINS, lroot)
            fns = compiled[key] = (entry_point(oneshot.oneshot_broadcast, args),
                                   entry_point(oneshot.copy_row, (dst, rows, 0, lroot)))
        h = shm.next_half() * half
        step, col = board.reserve()
        state = fns[0](src, dst, rows, h, me, table, col, sig, step, ONESHOT_SPINS, lroot)
        if state != -1 and _settle(board, state, step, timeout, "broadcast", check) and me != lroot:
            fns[1](dst, rows, h, lroot)
        if read_only:
            raise ValueError(f"broadcast: x is read-only on rank {shm.rank}, which receives rank "
                             f"{root}'s data (the peers completed the call)")

    return call
