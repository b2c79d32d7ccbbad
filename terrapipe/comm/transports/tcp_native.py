"""libc's socket calls from compiled code: a whole schedule of transfers on the TCP ring's two
streams (comm/transports/tcp.py) in one compiled call, without the GIL, Python only where a
chunk is to be reduced or a wait has run long.

NOTE [a ring's schedule in compiled code]
    1. Why. Driving the streams from Python cost a few tens of microseconds of interpreter per
       wake (a ``select``, a ``send`` or ``recv_into`` per request, the requests' bookkeeping),
       and held the GIL the whole time, against the thread of the rank that works on the next
       part of the message meanwhile (NOTE [overlap across nodes] in
       comm/algorithms/segment.py). Where ranks outnumber cores (two emulated machines of two
       ranks on two cores) every rank's CPU is the others' wall time: over 10gbit, a 64 MiB
       allreduce took 49 ms of CPU per rank, 20 of them in user space.
    2. What. A schedule is two tables (:func:`ring_schedule`, :func:`allgather_schedule`): the
       sends, in the order they go down the stream to the right (byte offset from the message's
       base, length), and the receives, in the order they come up the stream from the left
       (offset; length; whether it lands in the caller's spare buffer, for the caller to reduce
       into the message there; how many sends may go once it is in; which send must have gone
       before it is read).
       A stream keeps its bytes in order, so that is all the matching there is: no tags, no
       requests (NOTE [a ring over TCP] 2 in comm/transports/tcp.py).
    3. How. :func:`advance` writes what the stream to the right takes and reads what the one
       from the left holds, both non-blocking, and sleeps in ``poll`` on what it waits for
       (an exchange polls a while first: clause 11), until the schedule is done. A receive
       into the spare buffer that is complete hands back to the caller (REDUCE, the
       receive's index in ``st``), who reduces it and calls again;
       it is compiled once, in bytes, not once per dtype (its reductions are the caller's
       kernels): a first run compiles it once per process, on every rank at once.
    4. Nothing in compiled code decides to give up. Past ``until_ns`` (the caller's nap) it
       returns PENDING with its place in ``st``, and the caller, in Python, asks whether the
       timeout passed (and names the peer waited for: its left neighbour while a receive is
       due, else its right one) before calling it again. A stream that fails or that the peer
       closed returns CLOSED_LEFT or CLOSED_RIGHT with the errno in ``st`` (0 for an orderly
       close): the caller names that peer. A shutdown from another thread (an abort) wakes the
       ``poll`` and ends the call the same way.
    5. A receive waits for its bytes in ``poll`` with ``SO_RCVLOWAT`` set to what it still lacks,
       at most ``lowat`` bytes (NOTE [a ring over TCP] 7): the kernel wakes the call once that
       much has arrived, not at every segment. The option is set only where it changes: its
       last value and the stream it was set on are in ``st``, which lives as long as the
       streams. Recursive doubling waits on a stream per round (clause 9); where only the
       value was kept, a wait on the next round's stream for as many bytes as the last one
       asked of the previous stream left that stream's older, larger threshold in place, and
       it slept until the nap (tests/comm/test_tcp.py, regression).
    6. A receive that lands where this rank sent from earlier in the schedule (the ring's
       all-gather, in place over a segment it sent during the reduce-scatter) is read only once
       that send has gone (NOTE [ring schedule] 3 in comm/algorithms/ring.py): a send is done
       once the kernel holds its bytes, so the bytes it sent cannot be overwritten in its
       buffer.
    7. A transfer may be framed: its length is not in the table but in the message, an int64
       at a byte offset from ``base`` that the table names (``W_LEN_AT``, ``R_LEN_AT``; -1:
       the table's length), less ``R_LEN_LESS`` for a receive (the frame counts the bytes
       before it too). So a message whose length only its sender knew crosses whole: its
       head, a fixed size, is one receive, the rest another whose length the head just
       brought, and forwarding it sends what arrived (:func:`framed_schedule`, the exchange of
       NOTE [agreement across nodes] in comm/transports/shm.py, whose ranks may have called
       different collectives or sizes). A frame outside [0, the table's length] ends the
       call with BAD_FRAME before any byte of it is read: the table's length is the most the
       receive's buffer holds, so a stream that lost its place never writes past a row.
    8. A schedule may be started in one compiled call and finished in another: the one-shot
       across nodes (NOTE [one-shot across nodes] 13 in comm/algorithms/oneshot_nodes.py)
       starts its exchange inside its own compiled call, which gives up at a short deadline
       and leaves the rest, with the timeout and the blame, to the transport in Python. So
       ``st`` says whether a schedule is open (started, not yet DONE: :func:`under_way`),
       and the transport goes on with it rather than start it again.
    9. Among a power of two of four or more ranks the exchange of NOTE [agreement across
       nodes] goes by recursive doubling (:func:`doubling`), as over MPI (clause 3 there): in
       round k a rank and rank ``rank ^ 2**k``, over a stream of their own, swap their halves'
       tables and their payloads, the payloads reduced on the way lower half first, so a link
       carries log2(nodes) payloads where the ring's allgather sent nodes - 1, one after
       another through every rank. Each round is a framed schedule (clause 7) on that one
       stream, both ways, the message ``[2**k tables][payload]`` in the pair's row of this
       rank's half, its length in the first table's frame row. ``st[S_ROUND]`` is the round
       under way, so a call that ran out of time (PENDING) or failed is gone on with, or named,
       from where it stood (clause 8). At 4 emulated machines x 1 over 1gbit, a 4 KiB
       one-shot across nodes took 208-245 us around the ring and 92-102 by rounds (NOTE
       [one-shot across nodes] 13 in comm/algorithms/oneshot_nodes.py).
    10. From ``st[S_HALVING]`` bytes of payload (0: never) the rounds carry halves, as over MPI
       (NOTE [MPI from compiled code] 8 in comm/transports/mpi_native.py): in round k a rank
       sends, after its half's tables, the half of its block the peer keeps
       (``mpi_native.halving_block``) and reduces the half it keeps, the lower rank's data
       first; after the last round every rank holds every table, and where every one agrees
       (every rank judges alike: a group that disagrees stops there on every rank, and the
       streams stay in step) the allgather's rounds (``st[S_PHASE]`` 1), from the largest
       distance down, swap finished blocks into place, unframed, their lengths known to both
       sides. A link carries 2 (size - 1) / size of the payload, 1.5 x at 4 machines, where
       whole rounds carry log2(size) x; each block is reduced on one rank and copied to the
       others, in the order whole rounds add them, so the bits are the same either way. Halving
       costs twice the rounds, so it wins from a payload that grows with the link's rate: the
       threshold is measured when the group is made, as over MPI
       (``NodeTables.choose_halving``, comm/transports/base.py): 20-31 KiB over 1gbit and 46
       KiB over 2.5 and 10gbit in the groups of 2026-12-03. At 4 machines x 1 under torchrun
       (AMD EPYC, 2 cores, pinned, interleaved), us whole / by halves: over 1gbit 16 KiB 269-276 /
       325-360, 32 KiB 538-545 / 408-432 (the links' bound by halves 393), 64 KiB 934-3771 /
       805-819 (786); over 10gbit 64 KiB 475 / 390.
    11. An exchange's wait polls before it sleeps, as every wait on a peer does (NOTE [waiting
       for a peer] 2-3 in comm/wait.py): for ``spin_ns`` from when nothing moved it asks
       ``poll`` with no timeout, yielding the core between asks, and only then sleeps in it.
       The exchanges (recursive doubling, the framed schedule of the agreement, an allgather
       of rows below the ring's threshold) pass ``st[S_SPIN_NS]``, EXCHANGE_SPIN_NS unless
       ``TERRAPIPE_WAIT=spin`` (then until each nap); the ring's large transfers pass 0: their
       waits last milliseconds and they sleep at once, as clause 5 wants. A round of a few
       KiB should cost its wire time, but a rank that slept woke tens of microseconds after its
       bytes were in, and an exchange paid that at every round: at 4 machines x 1 under
       torchrun over 1gbit, interleaved (AMD EPYC, 2 cores, 2026-12-04), us, sleeping at
       once / after 50 us / after 200 us: 4 KiB whole rounds 183 / 131 / 140, by halves 267 /
       201 / 240; 16 KiB by halves 280 / 232 / 217, whole rounds 269-275 every way, which the
       link bounds (``python -m benchmarks.exchange_wait``). The group's halving threshold,
       measured with these waits, fell to 15.7 KiB, and a torchrun job's 16 KiB allreduce at
       4 x 1 took 205 us against MPICH's 203 (277 against 219 before, docs/benchmarks.md).

Why one module: the libc functions bound by name, the tables' layout and the compiled loop that
reads them are one contract (the columns of the tables, the slots of ``st``); the transport
that owns the streams and raises the errors is comm/transports/tcp.py.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from ..message import segments
from .board import TABLE_COLS
from .mpi_native import halving_block

__all__ = ["EXCHANGE_SPIN_NS", "advance", "start", "under_way", "doubling", "new_round_tables",
           "ring_schedule", "allgather_schedule", "framed_schedule", "new_state", "DONE", "PENDING",
           "REDUCE", "CLOSED_LEFT", "CLOSED_RIGHT", "STALLED", "BAD_FRAME", "S_SENT", "S_RECEIVED",
           "S_ERRNO", "S_POLLS", "S_OPEN", "S_ROUND", "S_PHASE", "S_HALVING", "S_SPIN_NS", "S_LOWAT",
           "S_LOWAT_FD", "W_OFFSET", "W_BYTES", "W_LEN_AT", "N_W", "R_OFFSET", "R_BYTES", "R_REDUCE",
           "R_RELEASES", "R_AFTER_SEND", "R_LEN_AT", "R_LEN_LESS", "N_R", "N_ST"]

DONE, PENDING, REDUCE, CLOSED_LEFT, CLOSED_RIGHT, STALLED, BAD_FRAME = range(7)

# st's slots (int64): the send under way (its index) and its bytes sent, the receive under way
# and its bytes received, how many sends may go, whether receive S_RECEIVED was handed back to
# be reduced (REDUCE), the errno of a failed stream, the polls this schedule slept in (for
# tests), then, kept across schedules, SO_RCVLOWAT as last set and the stream it was set on
# (clause 5), whether a schedule was started and has not run to its end (clause 8), the round
# of a recursive doubling under way (its distance, 1, 2, 4, ...; 0: none) and its phase (0 the
# tables' and the reduce-scatter's, 1 the allgather's), the smallest payload that recursive
# doubling reduce-scatters and allgathers (0: none; clause 10), and how long an exchange's
# waits poll before they sleep (clause 11).
S_SENT, S_SENT_BYTES, S_RECEIVED, S_RECEIVED_BYTES, S_MAY_SEND, S_HANDED, S_ERRNO, S_POLLS, S_LOWAT, \
    S_LOWAT_FD, S_OPEN, S_ROUND, S_PHASE, S_HALVING, S_SPIN_NS, N_ST = range(16)
_PER_SCHEDULE = S_LOWAT  # slots [0, S_LOWAT) start over with each schedule

# The sends' columns: offset, bytes, where its frame is (clause 7: -1, none; else the send's
# bytes are the int64 there).
W_OFFSET, W_BYTES, W_LEN_AT, N_W = range(4)
# The receives' columns: offset, bytes (framed: the most it may be), whether it lands in the
# caller's spare buffer for the caller to reduce into the message at that offset (REDUCE), the
# sends that may go once it is in (a count from the first), the send that must have gone before
# it is read (-1: none), where its frame is (clause 7: -1, none; else the receive's bytes are
# the int64 there less R_LEN_LESS).
R_OFFSET, R_BYTES, R_REDUCE, R_RELEASES, R_AFTER_SEND, R_LEN_AT, R_LEN_LESS, N_R = range(8)

_EAGAIN, _EINTR = 11, 4  # Linux's (EWOULDBLOCK is EAGAIN there)
_MSG_NOSIGNAL = 0x4000  # a closed stream fails the send with EPIPE, not the process with SIGPIPE
_POLLIN, _POLLOUT = 0x1, 0x4
_SOL_SOCKET, _SO_RCVLOWAT = 1, 18
_CLOCK_MONOTONIC = 1  # time.monotonic_ns reads the same clock

_send = types.ExternalFunction("send", types.intp(types.intc, types.uintp, types.uintp, types.intc))
_recv = types.ExternalFunction("recv", types.intp(types.intc, types.uintp, types.uintp, types.intc))
_poll = types.ExternalFunction("poll", types.intc(types.uintp, types.uint64, types.intc))
_setsockopt = types.ExternalFunction("setsockopt", types.intc(types.intc, types.intc, types.intc, types.uintp,
                                                              types.uint32))
_errno_location = types.ExternalFunction("__errno_location", types.uintp())
_clock_gettime = types.ExternalFunction("clock_gettime", types.intc(types.intc, types.uintp))
_sched_yield = types.ExternalFunction("sched_yield", types.intc())

# How long a wait of an exchange polls, yielding the core between polls, before it sleeps in
# ``poll`` (clause 11; ``st[S_SPIN_NS]``, which the streams' owner sets): longer than a 16 KiB
# round's wire time over 1gbit.
EXCHANGE_SPIN_NS = 200_000


@intrinsic
def _load_i32(typingctx, address):
    """The int32 at integer ``address`` (errno, through ``__errno_location``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.load(ptr)

    return types.int32(address), codegen


@intrinsic
def _load_i64(typingctx, address):
    """The int64 at integer ``address`` (a transfer's frame, clause 7)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load(ptr)

    return types.int64(address), codegen


@njit(nogil=True, cache=True, inline="always")
def _failure():
    """errno after a send or receive returned -1, or 0 where it only would have blocked (or a
    signal interrupted it): try again once ``poll`` says so."""
    e = _load_i32(_errno_location())
    return 0 if e == _EAGAIN or e == _EINTR else e


@njit(nogil=True, cache=True, inline="always")
def _received(st, recvs, i):
    """Receive ``i`` is in (and reduced, if the caller reduces it): the sends it releases may go,
    and the next receive is under way."""
    st[S_MAY_SEND] = recvs[i, R_RELEASES]
    st[S_RECEIVED] = i + 1
    st[S_RECEIVED_BYTES] = 0


@njit(nogil=True, cache=True, inline="always")
def _length(most, at, less, base):
    """A transfer's length (clause 7): ``most`` (its table's) where ``at`` < 0, else the int64 at
    ``base + at`` less ``less``, or -1 where that is outside [0, most]."""
    if at < 0:
        return most
    n = _load_i64(base + at) - less
    return n if 0 <= n <= most else -1


@njit(nogil=True, cache=True, inline="always")
def _recv_bytes(recvs, i, base):
    """Receive ``i``'s length (:func:`_length` of its columns)."""
    return _length(recvs[i, R_BYTES], recvs[i, R_LEN_AT], recvs[i, R_LEN_LESS], base)


def new_state(spin_ns: int = EXCHANGE_SPIN_NS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pair of streams' ``st`` (int64, N_ST; its exchanges' waits poll ``spin_ns`` before
    they sleep, clause 11), ``cells`` (int32 scratch: two ``pollfd`` and the socket option's
    value) and ``clock`` (int64 scratch: a ``timespec``), for :func:`advance`."""
    st = np.zeros(N_ST, np.int64)
    st[S_SPIN_NS] = spin_ns
    return st, np.zeros(8, np.int32), np.zeros(2, np.int64)


@njit(nogil=True, cache=True)
def advance(st, sends, recvs, right, left, base, spare, lowat, spin_ns, until_ns, cells, clock):
    """Run the schedule (``sends``: (n, N_W) int64; ``recvs``: (m, N_R) int64, NOTE [a ring's
    schedule in compiled code] 2, 7) on the non-blocking sockets ``right`` (written)
    and ``left`` (read), offsets from address ``base`` (the spare buffer's at address
    ``spare``). Returns DONE; REDUCE (receive ``st[S_RECEIVED]`` is in the spare buffer: reduce
    it and call again); PENDING (``until_ns``, CLOCK_MONOTONIC, passed: call again to go on);
    CLOSED_LEFT / CLOSED_RIGHT (that stream failed or closed, errno in ``st[S_ERRNO]``); STALLED
    (the schedule waits on nothing it can reach: a bad table); BAD_FRAME (a frame out of
    bounds, clause 7: the send's or receive's index in ``st``, nothing of it moved). ``st``:
    from :func:`new_state`, readied for each schedule by :func:`start`; ``lowat``: the most
    bytes a wait for a receive gathers before it wakes (clause 5); ``spin_ns``: how long a wait
    polls and yields before it sleeps (clause 11; 0: it sleeps at once). The caller keeps every
    buffer alive and unchanged but by this call until it returns DONE or fails."""
    n_sends, n_recvs = sends.shape[0], recvs.shape[0]
    if st[S_HANDED]:  # the caller reduced the receive handed back: it is in
        _received(st, recvs, st[S_RECEIVED])
        st[S_HANDED] = 0
    idle_since = 0  # when this wait began (clause 11); 0: something moved since
    while True:
        moved = False
        while st[S_SENT] < st[S_MAY_SEND]:
            j = st[S_SENT]
            done = st[S_SENT_BYTES]
            total = _length(sends[j, W_BYTES], sends[j, W_LEN_AT], 0, base)
            if total < 0:
                return BAD_FRAME
            left_bytes = total - done
            n = _send(right, base + sends[j, W_OFFSET] + done, left_bytes, _MSG_NOSIGNAL)
            if n < 0:
                st[S_ERRNO] = _failure()
                if st[S_ERRNO] == 0:
                    break
                return CLOSED_RIGHT
            moved = moved or n > 0
            if n < left_bytes:
                st[S_SENT_BYTES] = done + n
                break
            st[S_SENT] = j + 1
            st[S_SENT_BYTES] = 0
        while st[S_RECEIVED] < n_recvs:
            i = st[S_RECEIVED]
            if recvs[i, R_AFTER_SEND] >= st[S_SENT]:  # clause 6
                break
            done = st[S_RECEIVED_BYTES]
            total = _recv_bytes(recvs, i, base)
            if total < 0:
                return BAD_FRAME
            left_bytes = total - done
            if left_bytes == 0:  # a framed receive with nothing past its head
                _received(st, recvs, i)
                moved = True
                continue
            at = spare if recvs[i, R_REDUCE] else base + recvs[i, R_OFFSET]
            n = _recv(left, at + done, left_bytes, 0)
            if n == 0 and left_bytes > 0:
                st[S_ERRNO] = 0
                return CLOSED_LEFT
            if n < 0:
                st[S_ERRNO] = _failure()
                if st[S_ERRNO] == 0:
                    break
                return CLOSED_LEFT
            moved = True
            if n < left_bytes:
                st[S_RECEIVED_BYTES] = done + n
                break
            if recvs[i, R_REDUCE]:
                st[S_RECEIVED_BYTES] = done + n
                st[S_HANDED] = 1
                return REDUCE
            _received(st, recvs, i)
        if st[S_SENT] >= n_sends and st[S_RECEIVED] >= n_recvs:
            st[S_OPEN] = 0
            return DONE
        if moved:
            idle_since = 0
            continue
        # Nothing moved: sleep on what this rank waits for (clause 3), never past until_ns.
        nfds = 0
        if st[S_SENT] < st[S_MAY_SEND]:
            cells[0] = right
            cells[1] = _POLLOUT
            nfds = 1
        i = st[S_RECEIVED]
        if i < n_recvs and recvs[i, R_AFTER_SEND] < st[S_SENT]:
            want = min(_recv_bytes(recvs, i, base) - st[S_RECEIVED_BYTES], lowat)
            if want != st[S_LOWAT] or left != st[S_LOWAT_FD]:  # clause 5
                cells[4] = want
                if _setsockopt(left, _SOL_SOCKET, _SO_RCVLOWAT, cells.ctypes.data + 16, 4) == 0:
                    st[S_LOWAT] = want
                    st[S_LOWAT_FD] = left
            cells[2 * nfds] = left
            cells[2 * nfds + 1] = _POLLIN
            nfds += 1
        if nfds == 0:
            return STALLED
        _clock_gettime(_CLOCK_MONOTONIC, clock.ctypes.data)
        now = clock[0] * 1_000_000_000 + clock[1]
        if now >= until_ns:
            return PENDING
        if idle_since == 0:
            idle_since = now
        if now - idle_since < spin_ns:  # clause 11: poll without sleeping, the core yielded
            if _poll(cells.ctypes.data, nfds, 0) == 0:
                _sched_yield()
            continue
        st[S_POLLS] += 1
        _poll(cells.ctypes.data, nfds, max(1, (until_ns - now + 999_999) // 1_000_000))


@njit(nogil=True, cache=True)
def start(st: np.ndarray, first: int) -> None:
    """Ready ``st`` for a new schedule whose ``first`` sends may go before anything is
    received (the schedule's third item); the streams' slot is kept (NOTE [a ring's schedule
    in compiled code] 5)."""
    st[:_PER_SCHEDULE] = 0
    st[S_MAY_SEND] = first
    st[S_OPEN] = 1


def under_way(st: np.ndarray) -> bool:
    """Whether the last schedule started on ``st`` has not run to its end (clause 8)."""
    return bool(st[S_OPEN])


@functools.lru_cache(maxsize=64)
def ring_schedule(n: int, itemsize: int, p: int, r: int, chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The ring allreduce's schedule (NOTE [ring schedule] 1-3 in comm/algorithms/ring.py) for
    rank ``r`` of ``p`` over ``n`` elements of ``itemsize`` bytes, in chunks of ``chunk``
    elements: (sends, recvs, first) as :func:`advance` and :func:`start` read them, the tables
    read-only (cached per shape).

    Step t sends segment (r - t) mod p and receives (r - t - 1) mod p, which step t + 1 sends:
    chunk k of step t + 1 may go once chunk k of step t is in (and, reducing, reduced). The
    reduce-scatter's receives go to the spare buffer, the caller reducing each; the
    all-gather's land in place, each after the send that read its bytes (clause 6)."""
    parts = segments(n, p)
    steps = 2 * (p - 1)

    def chunks(t: int) -> list[tuple[int, int]]:
        a, b = parts[(r - t) % p]
        return [(c, min(c + chunk, b)) for c in range(a, b, chunk)]

    first = chunks(0)
    sends = [(a * itemsize, (b - a) * itemsize, -1) for a, b in first]
    recvs = []
    made = {}  # (step, chunk) -> the index of its send
    for k in range(len(first)):
        made[(0, k)] = k
    for t in range(steps):
        for k, (a, b) in enumerate(chunks(t + 1)):
            reduce = t < p - 1
            after = -1 if reduce else made[(t + 1 - p, k)]
            if t + 1 < steps:
                made[(t + 1, k)] = len(sends)
                sends.append((a * itemsize, (b - a) * itemsize, -1))
            recvs.append((a * itemsize, (b - a) * itemsize, int(reduce), len(sends), after, -1, 0))
    return _frozen(sends, N_W), _frozen(recvs, N_R), len(first)


@functools.lru_cache(maxsize=64)
def allgather_schedule(row_bytes: int, p: int, r: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The allgather around the ring of rows of ``row_bytes`` (row q of the output at q *
    ``row_bytes`` from its base) for rank ``r`` of ``p``: at step s it forwards row (r - s)
    mod p, which it received at step s - 1 (its own at step 0), and receives row (r - s - 1)
    mod p. (sends, recvs, first) as :func:`ring_schedule`'s."""
    if row_bytes == 0:
        return _frozen([], N_W), _frozen([], N_R), 0
    sends = [(((r - s) % p) * row_bytes, row_bytes, -1) for s in range(p - 1)]
    recvs = [(((r - s - 1) % p) * row_bytes, row_bytes, 0, min(s + 2, p - 1), -1, -1, 0)
             for s in range(p - 1)]
    return _frozen(sends, N_W), _frozen(recvs, N_R), 1


@functools.lru_cache(maxsize=64)
def framed_schedule(width: int, head: int, frame_at: int, p: int,
                    r: int) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`allgather_schedule` of framed messages (clause 7): row q of the output at q *
    ``width`` from its base holds rank q's message, at most ``width`` bytes, its length the
    int64 at ``frame_at`` within its first ``head`` bytes (this rank writes its own before the
    call). Each row arrives as two receives, its head and then the rest, whose length the head
    brought; each forwarded row is sent whole once both are in. (sends, recvs, first) as
    :func:`ring_schedule`'s."""
    if not 8 <= frame_at + 8 <= head <= width:
        raise ValueError(f"framed_schedule: frame at {frame_at} outside a head of {head} bytes in rows of "
                         f"{width}")
    if p == 1:
        return _frozen([], N_W), _frozen([], N_R), 0
    sends = [(((r - s) % p) * width, width, ((r - s) % p) * width + frame_at) for s in range(p - 1)]
    recvs = []
    for s in range(p - 1):
        row = ((r - s - 1) % p) * width
        recvs.append((row, head, 0, s + 1, -1, -1, 0))  # the head: no send waits on it alone
        recvs.append((row + head, width - head, 0, min(s + 2, p - 1), -1, row + frame_at, head))
    return _frozen(sends, N_W), _frozen(recvs, N_R), 1


def _frozen(rows: list, cols: int) -> np.ndarray:
    out = np.array(rows, np.int64).reshape(-1, cols)
    out.flags.writeable = False
    return out


def new_round_tables() -> tuple[np.ndarray, np.ndarray]:
    """Scratch tables of one round of :func:`doubling` (a send, a receive in two parts), filled
    by it each round: (sends, recvs) int64, the caller's, kept with the streams."""
    return np.zeros((1, N_W), np.int64), np.zeros((2, N_R), np.int64)


@njit(nogil=True, cache=True)
def doubling(st, fds, sends, recvs, inbox, head, frame, nbytes, pair, pair_t, partial, op, kind, rank, lowat,
             until_ns, cells, clock, resume):
    """The exchange of NOTE [agreement across nodes] by recursive doubling over the streams
    ``fds`` (round k's to rank ``rank ^ 2**k``, both ways; clause 9): every rank's table into
    its row of ``inbox`` ((size, width) uint8; ``head`` bytes of table a row, int64 word
    ``frame`` of it the message's length), and this rank's payload, ``inbox[rank, head:nbytes]``
    and ``partial`` (the same bytes as its dtype, or empty: tables alone), reduced with every
    rank's on the way, lower half first (``reduce_pair`` with ``op``, ``kind``), so it ends as
    the whole group's: whole in each round, or, from ``st[S_HALVING]`` bytes, halves of it,
    then an allgather once every table agrees (clause 10). ``pair``: (2, width2) uint8
    scratch, at least size / 2 tables and a payload, ``pair_t`` it as ``partial``'s dtype.
    Each rank's row's frame word ends as its message's length (head + its payload, as its
    half's round brought it). ``sends``, ``recvs``: :func:`new_round_tables`. Returns DONE,
    or what :func:`advance` returned in the round ``st[S_ROUND]`` (PENDING: call again with
    ``resume``; a failure: that round's peer to name). ``resume``: go on from ``st``; else
    start at round 1."""
    size = inbox.shape[0]
    words = inbox.view(np.int64)
    payload = nbytes - head if partial.shape[0] > 0 else 0
    item, n = partial.itemsize, partial.shape[0]
    halving = payload > 0 and 0 < st[S_HALVING] <= payload
    mine = inbox[rank, head:head + payload]
    wp = pair.shape[1]
    base = pair.ctypes.data
    if not resume:
        st[S_ROUND] = 1
        st[S_PHASE] = 0
    fresh = not resume
    while st[S_PHASE] == 0 and st[S_ROUND] < size:
        m = st[S_ROUND]
        peer = rank ^ m
        lo_mine, lo_peer = rank & ~(m - 1), peer & ~(m - 1)
        slot = 1 if rank > peer else 0
        tables = m * head
        # this round's bytes of the payload: sent [slo, shi), kept [klo, khi) (clause 10)
        slo, shi, klo, khi = 0, payload, 0, payload
        if halving:
            blo, bhi = halving_block(rank, n, m >> 1)
            mid = blo + (bhi - blo) // 2
            if rank & m:
                slo, shi, klo, khi = blo * item, mid * item, mid * item, bhi * item
            else:
                slo, shi, klo, khi = mid * item, bhi * item, blo * item, mid * item
        if fresh:  # this round's message: this half's tables, then the payload so far
            out = pair[slot]
            for i in range(m):
                out[i * head:(i + 1) * head] = inbox[lo_mine + i, :head]
            out[tables:tables + shi - slo] = mine[slo:shi]
            out.view(np.int64)[frame] = tables + shi - slo  # the message's frame (clause 7)
            sends[0, W_OFFSET] = slot * wp
            sends[0, W_BYTES] = wp
            sends[0, W_LEN_AT] = slot * wp + frame * 8
            theirs_at = (1 - slot) * wp
            recvs[0, R_OFFSET], recvs[0, R_BYTES], recvs[0, R_REDUCE] = theirs_at, tables, 0
            recvs[0, R_RELEASES], recvs[0, R_AFTER_SEND] = 1, -1
            recvs[0, R_LEN_AT], recvs[0, R_LEN_LESS] = -1, 0
            recvs[1, R_OFFSET], recvs[1, R_BYTES], recvs[1, R_REDUCE] = theirs_at + tables, wp - tables, 0
            recvs[1, R_RELEASES], recvs[1, R_AFTER_SEND] = 1, -1
            recvs[1, R_LEN_AT], recvs[1, R_LEN_LESS] = theirs_at + frame * 8, tables
            start(st, 1)
        fd = fds[_log2(m)]
        code = advance(st, sends, recvs, fd, fd, base, 0, lowat, st[S_SPIN_NS], until_ns, cells, clock)
        if code != DONE:
            return code
        theirs = pair[1 - slot]
        got = theirs.view(np.int64)[frame] - tables  # the peer's bytes of payload, as its frame says
        keep = khi - klo
        # what its message says of the peer's payload: as long as this rank's where it brought
        # what this rank keeps, else its own length (tables alone, or another collective's)
        told = head + (payload if got == keep else got)
        for i in range(m):
            inbox[lo_peer + i, :head] = theirs[i * head:(i + 1) * head]
            words[lo_peer + i, frame] = told
        if got == keep and keep > 0:  # the kept bytes' partials, lower half first
            a, b, t = klo // item, khi // item, tables // item
            lower = partial[a:b] if slot == 0 else pair_t[0, t:t + b - a]
            upper = pair_t[1, t:t + b - a] if slot == 0 else partial[a:b]
            kreduce.reduce_pair(partial[a:b], lower, upper, op, kind)
        st[S_ROUND] = m << 1
        fresh = True
    if st[S_PHASE] == 0:
        # clause 10: the allgather only where every table agrees, which every rank, holding
        # every table now, judges alike; a group that disagrees stops here on every rank
        if not halving or not ksync.tables_agree(words, head // 8, TABLE_COLS, words[rank, :TABLE_COLS - 1]):
            return _doubled(st, words, rank, frame, nbytes)
        st[S_PHASE] = 1
        st[S_ROUND] = size >> 1
    at = inbox.ctypes.data + rank * inbox.shape[1] + head  # this rank's payload, where blocks land
    while st[S_ROUND] >= 1:
        m = st[S_ROUND]
        if fresh:  # this rank's block to the rank m away, its block into place
            lo, hi = halving_block(rank, n, m)
            plo, phi = halving_block(rank ^ m, n, m)
            sends[0, W_OFFSET], sends[0, W_BYTES], sends[0, W_LEN_AT] = lo * item, (hi - lo) * item, -1
            recvs[0, R_OFFSET], recvs[0, R_BYTES], recvs[0, R_REDUCE] = plo * item, (phi - plo) * item, 0
            recvs[0, R_RELEASES], recvs[0, R_AFTER_SEND] = 1, -1
            recvs[0, R_LEN_AT], recvs[0, R_LEN_LESS] = -1, 0
            start(st, 1)
        fd = fds[_log2(m)]
        code = advance(st, sends, recvs[:1], fd, fd, at, 0, lowat, st[S_SPIN_NS], until_ns, cells, clock)
        if code != DONE:
            return code
        st[S_ROUND] = m >> 1
        fresh = True
    return _doubled(st, words, rank, frame, nbytes)


@njit(nogil=True, cache=True, inline="always")
def _log2(m):
    """k for a round's distance ``m`` = 2**k: the index of its stream."""
    k = 0
    while (1 << k) < m:
        k += 1
    return k


@njit(nogil=True, cache=True, inline="always")
def _doubled(st, words, rank, frame, nbytes):
    """:func:`doubling`'s end: this rank's frame word its message's length, no round under way."""
    words[rank, frame] = nbytes
    st[S_ROUND] = 0
    st[S_PHASE] = 0
    return DONE
