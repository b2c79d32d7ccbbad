"""MPI's C API called from compiled code: the exchange between nodes of an agreement (and of the
one-shot's partials with it) in one compiled call, with no Python per message or per poll.

NOTE [MPI from compiled code]
    1. Why. The smallest allreduces across nodes are latency: a board step on each node and one
       exchange between nodes (NOTE [one-shot across nodes] in comm/algorithms/oneshot_nodes.py).
       Through mpi4py the exchange was Python per request, per poll and per status, and
       where ranks share cores (emulated nodes, a busy machine) every rank's CPU is the others'
       wall time: at 2 nodes x 2 ranks on two cores a 4 KiB allreduce took 110 us of CPU per
       rank and call, half of it in Python's interpreter, where MPICH's own allreduce took 54
       (its wall time 109 us to our 220: twice the CPU per rank, as both are CPU-bound there).
    2. How. The functions are resolved by name from the MPI library mpi4py loaded (its
       extension module's dependencies, through ctypes) and registered with llvmlite
       (``add_symbol``) before anything here is called; the compiled code calls them by name
       (``numba.types.ExternalFunction``), as comm/transports/cma.py calls
       ``process_vm_readv``, so Numba's on-disk cache holds it: an address baked into the code
       would not survive a new process.
    3. Which MPI. Handles are int32, as in MPICH's ABI (MPICH, Intel MPI, MVAPICH, Cray MPICH),
       the MPI this project ships with (the ``mpich`` wheel). Where they are not (Open MPI's
       handles are pointers) :func:`bind` returns None and the transport's Python exchange
       runs: the same messages, the same errors, slower.
    4. One state machine for both exchanges (to every other rank, or by recursive doubling,
       NOTE [agreement across nodes] 2-3 in comm/transports/shm.py): :func:`advance` posts a
       round, polls it (``MPI_Testall``, then ``sched_yield`` between polls: no spinning
       before the first yield, NOTE [waiting for a peer] 2 in comm/wait.py) and goes on to the
       next round, until the exchange is done or it has yielded ``spins`` times. Then it returns
       PENDING with its state in ``st``, and the caller, in Python, asks whether a peer died or
       the timeout passed (comm/wait.py) before calling it again: a wait that fails is named
       and cancelled by the same code as before, and nothing in compiled code sleeps or
       decides to give up.
    5. Done, it checks every table against this rank's signature and every message's length
       (DONE or DISAGREE): the Python that describes a mismatch runs only on one.
       :func:`advance` works in bytes and hands each reduction back to its caller (REDUCE, then
       :func:`reduce_step` in the payload's dtype): it is compiled once, not once per dtype,
       for its compilation takes seconds (on a first run, on every rank at once).
    6. An MPI error code comes back negative (the communicators return errors: mpi4py's
       default); the caller raises it with MPI's text for it.
    7. Recursive doubling's first phase is the tables' (NOTE [agreement across nodes] 3): in
       round k this rank and rank ``rank ^ k`` swap their halves' tables so far, each message
       with the payload it carries in that round (the tables before it from the lower rank of
       the pair, after it from the upper: clause 10). After log2(size) rounds every rank
       holds every table, whatever the payloads were, so every rank decides alike whether the
       group agrees; a rank in another collective (another payload, or none) still meets its
       peers round for round and raises the same mismatch.
    8. A payload of at least ``cfg[C_HALVING]`` bytes (clause 9) goes by reduce-scatter and allgather
       instead of whole in each round: in round k a rank sends the half of its block that the peer
       keeps (the upper half where bit k of the peer's rank is set, :func:`halving_block`) and reduces the
       half it keeps, the lower rank's data first; once every table agrees (only then: a group that
       disagrees stops after the first phase, on every rank), the allgather's rounds, from the
       largest distance down, swap finished blocks into place. A link carries 1.5 x the payload at
       4 nodes (2 (size - 1) / size), not 2 x: what MPICH's allreduce does there from a few KiB.
       Every block is reduced on one rank and copied to the others, so every rank holds the same
       bits. Among 4 emulated nodes over 1gbit links (2-core Xeon, float32, both ways and MPICH's
       allreduce interleaved in one run), us at 12 / 16 / 24 / 32 KiB: doubling 208 / 280 / 418 /
       554, halving 226 / 270 / 316 / 419, MPICH 154 / 200 / 312 / 414. Links there move a KiB in
       8.2 us, so both are bound by the bytes a link carries.
    9. Where the two cross depends on the links: halving saves bytes and costs log2(size) more
       rounds, so it wins from a payload that grows with the link's rate (and with what a round
       costs where ranks share cores). Measured interleaved in one run each (4 emulated nodes,
       2-core Xeon, float32, us doubling / halving): over 1gbit 12 KiB 206 / 157 and 8 KiB 107 /
       151; over 2.5gbit 16 KiB 133 / 205 and 32 KiB near even. No constant fits both, so the
       transport between nodes measures it when a group is made (``NodeTables.choose_halving``,
       comm/transports/base.py; ``TERRAPIPE_HALVING_BYTES`` sets it instead): each rank times
       loops of both exchanges at 4, 8, 16, 32 and 64 KiB in the steady state of a training loop
       (each loop after exchanges that send 384 KiB a rank: a shaped link's burst allowance, or
       a switch's buffers, spent; before that, doubling's extra bytes went at burst speed and it
       looked faster than it is), the slowest rank's times travel to every rank (in table rows
       the check skips), and the threshold is where halving's lead begins for good,
       interpolated (``halving_threshold``). Every rank so holds the same threshold: a rank
       halving where its peer doubles would meet it with messages of other lengths. In three
       groups each it chose 7.9-13.1 KiB over 1gbit links and 24-38 KiB over 2.5gbit; a first
       group's took 0.5-0.9 s, with the one-time costs a first collective pays otherwise (the
       compiled exchange loaded, MPI's connections made).
    10. What the reduce-scatter copies. Every round's reduction is made where this rank's data
       lies, with the peer's message where MPI received it (``reduce_step``, operands in rank
       order): its own half is no longer copied beside the peer's first. Its message is sent
       from its data, not copied out: in each pair of a round the lower rank's tables go
       before its payload, the upper's after it (in every round, whatever the payload, so a
       rank met by another collective still finds the tables, at the front or the end of what
       it received), written over the bytes of its kept half next to the half it sends, which
       are saved in its row of ``pair`` and put back once the send is done (or abandoned);
       where a kept half is shorter than the tables, the message is copied as before. Given
       ``user`` (the one-shot across nodes of one rank a node, NOTE [one-shot across nodes]
       11 in comm/algorithms/oneshot_nodes.py), the first round reads the caller's array
       itself, the reductions go to this rank's payload, the last round's (every table known
       by then, and checked first) into that array, and the allgather fills the rest there:
       nothing in it is written before the group agrees (a mismatch leaves it whole; the
       tables borrowed from it are put back). Among 4 emulated nodes of one rank over 10gbit
       links (2-core Xeon, float32 sum, 7 rounds interleaved with MPICH's allreduce,
       2026-11-27), us at 64 / 128 / 256 / 512 KiB, ``comm.allreduce`` / MPICH: before 216 /
       403 / 720 / 1514 against 168 / 287 / 527 / 1044 (1.29-1.45x), 4.5 copies of the message
       a call beyond MPICH's; with the rounds' copies gone and this rank's block copied into
       the caller's array at the end, 183 / 390 / 675 / 1230 against 168 / 339 / 597 / 1110
       (1.09-1.15x). What is left is about the time MPICH's own rounds take when driven from
       Python with ``Testall`` and a yield between polls (a blocking ``Sendrecv`` ran
       1.03-1.07x of its allreduce, the polled one 1.08-1.16x; polling 16 times a yield gained
       nothing).

Why one module: the functions bound by name, the compiled code that calls them and the object
that holds one communicator's handles and state are one contract (the slots of ``cfg`` and
``st``, the requests' layout); split, each file would depend on the other's private layout.
"""

from __future__ import annotations

import ctypes

import numpy as np
from numba import njit, types

from ...kernels import entry_point
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from .board import TABLE_COLS

__all__ = ["bind", "supported", "Exchange", "advance", "advance_reducing", "reduce_step", "halves", "DONE",
           "PENDING", "DISAGREE", "REDUCE", "C_HALVING", "halving_block"]

PENDING, DONE, DISAGREE, REDUCE = 0, 1, 2, 3

# cfg's slots (int32): the communicator, MPI_BYTE, the tag, this rank, the size, whether by
# recursive doubling, the bytes of one MPI_Status, MPI_REQUEST_NULL, the smallest payload that
# goes by reduce-scatter and allgather (clause 8; 0: none).
C_COMM, C_BYTE, C_TAG, C_RANK, C_SIZE, C_DOUBLING, C_STATUS, C_NULL, C_HALVING, N_CFG = range(10)
# st's slots (int64): the round (the distance to the peer, 1, 2, 4, ...; 1 for the exchange to
# all), whether its requests are posted, how many there are, and the phase (0: the tables'
# rounds; 1: the allgather's, from the largest distance down).
# Then the reduction advance() asks of its caller (REDUCE): whether there is one, its elements
# [lo, hi) of this rank's payload, where the peer's message holds them, this rank's row of the
# pair (0: the lower half, whose data comes first), and where the caller's array takes part
# (clause 10): 1 this rank's data is still there, 2 the result goes there, 3 both, 0 neither
# (reduce_step()).
# Last, where a round's message borrowed bytes of this rank's kept half for its tables (clause
# 10), their offset + 1 in its data (0: none), and whether that data is the caller's array.
S_ROUND, S_POSTED, S_NREQ, S_PHASE, S_RED, S_RLO, S_RHI, S_RAT, S_SLOT, S_RUSER, S_SAVED, S_SUSER, N_ST = \
    range(13)


_i32, _ptr = types.int32, types.uintp
_Isend = types.ExternalFunction("MPI_Isend", _i32(_ptr, _i32, _i32, _i32, _i32, _i32, _ptr))
_Irecv = types.ExternalFunction("MPI_Irecv", _i32(_ptr, _i32, _i32, _i32, _i32, _i32, _ptr))
_Testall = types.ExternalFunction("MPI_Testall", _i32(_i32, _ptr, _ptr, _ptr))
_Get_count = types.ExternalFunction("MPI_Get_count", _i32(_ptr, _i32, _ptr))
_Request_get_status = types.ExternalFunction("MPI_Request_get_status", _i32(_i32, _ptr, _ptr))
_Cancel = types.ExternalFunction("MPI_Cancel", _i32(_ptr))
_sched_yield = types.ExternalFunction("sched_yield", types.intc())
_memmove = types.ExternalFunction("memmove", _ptr(_ptr, _ptr, _ptr))
_SYMBOLS = ("MPI_Isend", "MPI_Irecv", "MPI_Testall", "MPI_Get_count", "MPI_Request_get_status", "MPI_Cancel")
_bound: bool | None = None


def _int32(handle: int) -> int:
    """An MPICH handle as the int32 it is in C (mpi4py hands it out sign-extended to 64 bits)."""
    return ((handle & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def supported(MPI) -> bool:
    """Whether ``MPI`` (mpi4py's module) has MPICH's ABI: int32 communicator, datatype and
    request handles (NOTE [MPI from compiled code] 3)."""
    return all(MPI._sizeof(t) == 4 for t in (MPI.Comm, MPI.Datatype, MPI.Request))


def _resolve(MPI) -> bool:
    """Register the MPI library's functions with llvmlite, once per process (NOTE [MPI from
    compiled code] 2-3); False where its ABI is not supported or a function is missing."""
    global _bound
    if _bound is None:
        _bound = False
        if not supported(MPI):
            return False
        try:
            lib = ctypes.CDLL(MPI.__file__)  # its dependencies hold libmpi
            addresses = {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _SYMBOLS}
        except (OSError, AttributeError):
            return False
        import llvmlite.binding as llvm

        for name, address in addresses.items():
            llvm.add_symbol(name, address)
        _bound = True
    return _bound


def bind(comm, tag: int, doubling: bool, halving_bytes: int = 0):
    """An :class:`Exchange` over ``comm`` (an mpi4py communicator), or None where MPI's C API
    cannot be reached from compiled code (NOTE [MPI from compiled code] 3). ``doubling``: by
    recursive doubling (a power of two of ranks); ``halving_bytes``: payloads of at least this
    many bytes go by reduce-scatter and allgather there (clause 8; 0: never; the caller may
    set ``cfg[C_HALVING]`` later, clause 9)."""
    from mpi4py import MPI

    if not _resolve(MPI):
        return None
    return Exchange(comm, MPI, tag, doubling, halving_bytes)


@njit(nogil=True, cache=True)
def _copy(dst, at, src, start, n):
    """``dst[at:at + n] = src[start:start + n]`` (1-D uint8) by ``memmove``: a slice assignment
    cost seconds of compilation each, and a byte loop microseconds per call."""
    _memmove(dst.ctypes.data + at, src.ctypes.data + start, n)


@njit(nogil=True, cache=True)
def halving_block(me, m, upto):
    """Elements [lo, hi) of an ``m``-element payload that rank ``me`` reduces after the
    reduce-scatter's rounds of distance 1, 2, ... ``upto`` (each keeps the upper half where its
    bit of that distance is set, clause 8)."""
    lo, hi = 0, m
    k = 1
    while k <= upto:
        mid = lo + (hi - lo) // 2
        if me & k:
            lo = mid
        else:
            hi = mid
        k <<= 1
    return lo, hi


@njit(nogil=True, cache=True)
def _post_all(cfg, reqs, inbox, nbytes):
    """The exchange to all: a receive of a whole inbox row from every other rank, then this
    rank's message to each. Returns (MPI error or 0, requests posted)."""
    me, size, comm, byte, tag = cfg[C_RANK], cfg[C_SIZE], cfg[C_COMM], cfg[C_BYTE], cfg[C_TAG]
    width = inbox.shape[1]
    err = 0
    n = 0
    for q in range(size):
        if q != me:
            err |= _Irecv(inbox[q].ctypes.data, width, byte, q, tag, comm, reqs.ctypes.data + 4 * n)
            n += 1
    for q in range(size):
        if q != me:
            err |= _Isend(inbox[me].ctypes.data, nbytes, byte, q, tag, comm, reqs.ctypes.data + 4 * n)
            n += 1
    return err, n


@njit(nogil=True, cache=True)
def _agreed(words, head, me, counts, nbytes, size):
    """Whether every table known so far agrees with this rank's and every message had
    ``nbytes`` bytes."""
    agree = ksync.tables_agree(words, head // 8, TABLE_COLS, words[me, :TABLE_COLS - 1])
    for q in range(size):
        if counts[q] != nbytes:
            agree = False
    return agree


@njit(nogil=True, cache=True)
def halves(cfg, payload):
    """Whether a payload of this many bytes goes by reduce-scatter and allgather (clause 8)."""
    return cfg[C_DOUBLING] != 0 and payload > 0 and 0 < cfg[C_HALVING] <= payload


@njit(nogil=True, cache=True)
def _send_tables(cfg, st, reqs, inbox, head, pair, k, data, lo, hi, borrow):
    """Round ``k`` of the first phase (clause 7): this half's tables so far and bytes ``[lo,
    hi)`` of ``data`` (this rank's payload so far, uint8) to the rank ``k`` away, the tables
    before the payload from the lower rank of the two, after it from the upper (clause 10), and
    its message received into ``pair`` (row 0 the lower rank's message, row 1 the upper's); 2
    requests. ``borrow``: the message is sent from ``data`` itself, the tables written over the
    bytes of the kept half next to ``[lo, hi)``, which are saved in this rank's row of ``pair``
    and restored once the send is done (:func:`_restore`); else it is copied into that row."""
    me, comm, byte, tag = cfg[C_RANK], cfg[C_COMM], cfg[C_BYTE], cfg[C_TAG]
    peer = me ^ k
    base = me & ~(k - 1)
    slot = 1 if me > peer else 0
    tables = k * head
    out = pair[slot]
    if borrow:
        at = hi if slot else lo - tables  # where the tables go in data
        _copy(out, 0, data, at, tables)
        for i in range(k):
            _copy(data, at + i * head, inbox[base + i], 0, head)
        st[S_SAVED] = at + 1
        address = data.ctypes.data + (lo if slot else at)
    else:
        at = hi - lo if slot else 0
        for i in range(k):
            _copy(out, at + i * head, inbox[base + i], 0, head)
        _copy(out, 0 if slot else tables, data, lo, hi - lo)
        address = out.ctypes.data
    err = _Irecv(pair[1 - slot].ctypes.data, pair.shape[1], byte, peer, tag, comm, reqs.ctypes.data)
    err |= _Isend(address, tables + hi - lo, byte, peer, tag, comm, reqs.ctypes.data + 4)
    return err


@njit(nogil=True, cache=True)
def _restore(st, pair, slot, data, tables):
    """Put back the bytes of ``data`` a round's tables were written over (clause 10), once its
    send is done (or abandoned)."""
    if st[S_SAVED]:
        _copy(data, st[S_SAVED] - 1, pair[slot], 0, tables)
        st[S_SAVED] = 0


@njit(nogil=True, cache=True)
def _swap(cfg, reqs, base, send_lo, send_hi, recv_lo, recv_hi, peer):
    """The allgather's round (clause 8): bytes ``[send_lo, send_hi)`` from address ``base`` to
    ``peer``, its block received into ``[recv_lo, recv_hi)``; 2 requests."""
    comm, byte, tag = cfg[C_COMM], cfg[C_BYTE], cfg[C_TAG]
    err = _Irecv(base + recv_lo, recv_hi - recv_lo, byte, peer, tag, comm, reqs.ctypes.data)
    err |= _Isend(base + send_lo, send_hi - send_lo, byte, peer, tag, comm, reqs.ctypes.data + 4)
    return err


@njit(nogil=True, cache=True)
def _poll(reqs, n, cells, statuses, spins):
    """Testall, yielding between polls, at most ``spins`` yields: 1 done, 0 not yet, or minus an
    MPI error code."""
    yielded = 0
    while True:
        err = _Testall(n, reqs.ctypes.data, cells.ctypes.data, statuses.ctypes.data)
        if err:
            return -err
        if cells[0]:
            return 1
        if yielded == spins:
            return 0
        _sched_yield()
        yielded += 1


@njit(nogil=True, cache=True)
def advance(st, cfg, reqs, statuses, counts, cells, inbox, words, head, nbytes, pair, item, spins, user):
    """Take the exchange as far as it goes (NOTE [MPI from compiled code] 4-8): DONE,
    DISAGREE, PENDING (call again with the same arguments), REDUCE (call :func:`reduce_step`,
    then this again), or minus an MPI error code. In bytes: compiled once, whatever the
    payload's dtype (``item`` bytes an element; 1 where there is no payload).

    ``st``: int64 (N_ST,), the state, (1, 0, 0, 0, 0, ...) before an exchange and again after
    one. ``cfg``: int32 (N_CFG,). ``reqs``: int32 (2 x size,) requests; ``statuses``: uint8 (2
    x size x status bytes,); ``counts``: int64 (size,), each rank's message length where it
    was not the expected one (else ``nbytes``), out; ``cells``: int32 (2,) scratch.
    ``inbox``: (size, width) uint8, this rank's message in its row's first ``nbytes`` bytes
    (a table of ``head`` bytes, then the payload); ``words``: the same as int64. ``pair``:
    (2, width) uint8, recursive doubling's messages of a round (row 0 the lower half's).
    ``user``: uint8, empty, or where the payload goes by reduce-scatter and allgather the
    caller's array of its bytes (clause 10): the data is read from there and the result ends
    there, written only once every table agrees. All the caller's; the receives write
    ``inbox`` rows, ``pair`` and ``user``; by recursive doubling this rank's payload (or
    ``user``) ends as the group's reduction."""
    me, size, byte = cfg[C_RANK], cfg[C_SIZE], cfg[C_BYTE]
    doubling = cfg[C_DOUBLING] != 0
    sbytes = cfg[C_STATUS]
    payload = nbytes - head
    m = payload // item
    halving = halves(cfg, payload)
    direct = halving and user.shape[0] > 0  # clause 10
    mine = inbox[me, head:head + payload]
    if st[S_ROUND] == 1 and st[S_POSTED] == 0 and st[S_PHASE] == 0:
        for q in range(size):
            counts[q] = nbytes
    while st[S_PHASE] == 0 and st[S_ROUND] < size:
        k = st[S_ROUND]
        peer = me ^ k
        slot = 1 if me > peer else 0
        tables = k * head
        lo, hi = 0, m
        borrow = False
        if halving:  # send the half the peer keeps (clause 8)
            lo, hi = halving_block(me, m, k >> 1)
            mid = lo + (hi - lo) // 2
            # clause 10: both halves hold the tables, so both ranks send from their data
            borrow = min(mid - lo, hi - mid) * item >= tables
            if me & k:
                hi = mid
            else:
                lo = mid
        data = user if direct and k == 1 else mine
        if st[S_POSTED] == 0:
            if doubling:
                st[S_SUSER] = 1 if direct and k == 1 else 0
                err = _send_tables(cfg, st, reqs, inbox, head, pair, k, data, lo * item, hi * item, borrow)
                n = 2
            else:
                err, n = _post_all(cfg, reqs, inbox, nbytes)
            if err:
                return -err
            st[S_POSTED] = 1
            st[S_NREQ] = n
        state = _poll(reqs, st[S_NREQ], cells, statuses, spins)
        if state <= 0:
            return PENDING if state == 0 else state
        st[S_POSTED] = 0
        if not doubling:
            i = 0
            for q in range(size):
                if q != me:
                    _Get_count(statuses.ctypes.data + i * sbytes, byte, cells.ctypes.data + 4)
                    counts[q] = cells[1]
                    i += 1
            st[S_ROUND] = size
            continue
        _restore(st, pair, slot, data, tables)
        _Get_count(statuses.ctypes.data, byte, cells.ctypes.data + 4)
        got = cells[1]
        peer_base = peer & ~(k - 1)
        theirs = pair[1 - slot]
        # clause 10: the upper rank's tables end its message, whatever its payload
        toff = max(got - tables, 0) if slot == 0 else 0
        for i in range(k):
            _copy(inbox[peer_base + i], 0, theirs, toff + i * head, head)
        st[S_ROUND] = k << 1
        # The peer sends what this rank keeps: the whole payload, or the other half of the block.
        keep_lo, keep_hi = (0, m) if not halving else halving_block(me, m, k)
        expected = tables + (keep_hi - keep_lo) * item if payload > 0 else tables
        if got != expected:
            for i in range(k):  # another call's message: its tables tell which
                counts[peer_base + i] = head + max(got - tables, 0)
        elif payload > 0:  # the halves' partials of the kept block, lower first: the caller's
            # clause 10: the last round reduces into the caller's array, once every table agrees
            last_of_user = direct and k << 1 >= size
            into_user = last_of_user and _agreed(words, head, me, counts, nbytes, size)
            if not last_of_user or into_user:
                st[S_RED] = 1
                st[S_RLO] = keep_lo
                st[S_RHI] = keep_hi
                st[S_RAT] = 0 if slot == 0 else tables // item  # the peer's payload in its message
                st[S_SLOT] = slot
                st[S_RUSER] = (1 if direct and k == 1 else 0) | (2 if into_user else 0)
                return REDUCE
    if st[S_PHASE] == 0:
        agree = _agreed(words, head, me, counts, nbytes, size)
        if not agree or not halving:
            st[S_ROUND] = 1
            st[S_PHASE] = 0
            return DONE if agree else DISAGREE
        st[S_PHASE] = 1
        st[S_ROUND] = size >> 1  # every table agrees: the allgather (clause 8), in the caller's
        # array where given: this rank's block is there already (clause 10)
    base = user.ctypes.data if direct else mine.ctypes.data
    while st[S_ROUND] >= 1:
        k = st[S_ROUND]
        lo, hi = halving_block(me, m, k)
        plo, phi = halving_block(me ^ k, m, k)
        if st[S_POSTED] == 0:
            err = _swap(cfg, reqs, base, lo * item, hi * item, plo * item, phi * item, me ^ k)
            if err:
                return -err
            st[S_POSTED] = 1
            st[S_NREQ] = 2
        state = _poll(reqs, 2, cells, statuses, spins)
        if state <= 0:
            return PENDING if state == 0 else state
        st[S_POSTED] = 0
        st[S_ROUND] = k >> 1
    st[S_ROUND] = 1
    st[S_PHASE] = 0
    return DONE


@njit(nogil=True, cache=True)
def reduce_step(st, partial, user_t, pair_t, op, kind):
    """The reduction :func:`advance` asked for (REDUCE), in the payload's dtype:
    ``partial[lo:hi]`` = this rank's data there (or in ``user_t``, clause 10) and the peer's
    message in ``pair_t``, the lower half's first (:func:`~terrapipe.kernels.reduce.reduce_pair`,
    16-bit formats ``kind`` in float32, rounded once). ``partial``: this rank's payload
    (``inbox[rank, head:nbytes]``) as its dtype; ``user_t``: ``user`` as that dtype; ``pair_t``:
    ``pair`` as that dtype."""
    if st[S_RED]:
        lo, hi, at, slot, where = st[S_RLO], st[S_RHI], st[S_RAT], st[S_SLOT], st[S_RUSER]
        theirs = pair_t[1 - slot, at:at + hi - lo]
        if where == 1:  # from the caller's array into the payload
            _reduce_ordered(partial[lo:hi], user_t[lo:hi], theirs, slot, op, kind)
        elif where == 2:  # from the payload into the caller's array
            _reduce_ordered(user_t[lo:hi], partial[lo:hi], theirs, slot, op, kind)
        elif where == 3:  # the only round: from the caller's array into it
            _reduce_ordered(user_t[lo:hi], user_t[lo:hi], theirs, slot, op, kind)
        else:
            _reduce_ordered(partial[lo:hi], partial[lo:hi], theirs, slot, op, kind)
    st[S_RED] = 0


@njit(nogil=True, cache=True, inline="always")
def _reduce_ordered(out, mine, theirs, slot, op, kind):
    if slot == 0:
        kreduce.reduce_pair(out, mine, theirs, op, kind)
    else:
        kreduce.reduce_pair(out, theirs, mine, op, kind)


@njit(nogil=True, cache=True)
def advance_reducing(st, cfg, reqs, statuses, counts, cells, inbox, words, head, nbytes, pair, spins, partial,
                     pair_t, op, kind, user, user_t):
    """:func:`advance` with the reductions it asks for made here (:func:`reduce_step`), in the
    payload's dtype: DONE, DISAGREE, PENDING or minus an MPI error code, never REDUCE. Arguments
    as theirs (the element size is ``partial``'s; ``user_t``: ``user`` as its dtype)."""
    while True:
        state = advance(st, cfg, reqs, statuses, counts, cells, inbox, words, head, nbytes, pair,
                        partial.itemsize, spins, user)
        if state != REDUCE:
            return state
        reduce_step(st, partial, user_t, pair_t, op, kind)


@njit(nogil=True, cache=True)
def unfinished(cfg, reqs, n, cells, statuses, out):
    """Which of the first ``n`` requests are not complete (``MPI_Request_get_status``, which
    frees nothing): ``out[i]`` 1 or 0. Returns 0 or an MPI error code."""
    err = 0
    for i in range(n):
        err |= _Request_get_status(reqs[i], cells.ctypes.data, statuses.ctypes.data)
        out[i] = 1 - cells[0]
    return err


@njit(nogil=True, cache=True)
def cancel(cfg, reqs, n):
    """Cancel the first ``n`` requests that are not null (a send may not be cancellable: it is
    abandoned, as mpi4py's ``Cancel`` leaves it)."""
    for i in range(n):
        if reqs[i] != cfg[C_NULL]:
            _Cancel(reqs.ctypes.data + 4 * i)


class Exchange:
    """The compiled exchange of one communicator (NOTE [MPI from compiled code]): its handles,
    requests, statuses and state. Not thread-safe: the transport's calls are ordered."""

    def __init__(self, comm, MPI, tag: int, doubling: bool, halving_bytes: int) -> None:
        size = comm.Get_size()
        self.size, self.rank = size, comm.Get_rank()
        self.cfg = np.zeros(N_CFG, np.int32)
        self.cfg[C_COMM] = _int32(MPI._handleof(comm))
        self.cfg[C_BYTE] = _int32(MPI._handleof(MPI.BYTE))
        self.cfg[C_TAG] = tag
        self.cfg[C_RANK], self.cfg[C_SIZE] = self.rank, size
        self.cfg[C_DOUBLING] = int(doubling)
        self.cfg[C_STATUS] = MPI._sizeof(MPI.Status)
        self.cfg[C_NULL] = _int32(MPI._handleof(MPI.REQUEST_NULL))
        self.cfg[C_HALVING] = halving_bytes
        self.doubling = doubling
        self.st = np.zeros(N_ST, np.int64)
        self.st[S_ROUND] = 1
        self.reqs = np.full(2 * size, self.cfg[C_NULL], np.int32)
        self.statuses = np.zeros(2 * size * int(self.cfg[C_STATUS]), np.uint8)
        self.counts = np.zeros(size, np.int64)
        self.cells = np.zeros(2, np.int32)
        self.no_pair = np.zeros((2, 8), np.uint8)  # the pair where there is no recursive doubling
        self.no_user = np.zeros(0, np.uint8)  # ``user`` where the payload is only in the inbox
        self._inbox = self._words = None
        self._reducing: dict = {}  # advance_reducing's entry points, by dtype
        self._args: tuple = ()
        self._borrowed_from: tuple = ()  # start's inbox, head, nbytes, pair and user as bytes
        self._advance = self._run = None
        self.state = PENDING  # the last start's or resume's

    def start(self, inbox: np.ndarray, head: int, nbytes: int, pair: np.ndarray | None, reduction,
              spins: int, user: np.ndarray | None = None) -> int:
        """Begin an exchange of ``inbox[rank, :nbytes]`` (see :func:`advance`) and take it as
        far as it goes: DONE, DISAGREE, PENDING (then :meth:`resume`) or minus an MPI error;
        the reductions it asks for on the way are made in the same compiled call
        (:func:`advance_reducing`). ``pair``: recursive doubling's (2, width) scratch, or None.
        ``reduction``: (partial, op, kind, scratch, acc), how payloads are reduced on the way
        by recursive doubling (``partial`` this rank's payload as its dtype), or None where
        they only travel with the tables. ``user``: 1-D, C-contiguous, ``partial``'s dtype and
        length, where the payload goes by reduce-scatter and allgather (:func:`halves`), the
        caller's array the data is read from and the result written to (clause 10); else
        None."""
        pair = self.no_pair if pair is None else pair
        user_bytes = self.no_user if user is None else user.view(np.uint8)
        self._borrowed_from = (inbox, head, nbytes, pair, user_bytes)
        args = (self.st, self.cfg, self.reqs, self.statuses, self.counts, self.cells, inbox,
                self.words(inbox), head, nbytes, pair)
        if reduction is None:
            self._args = (*args, 1, spins, self.no_user)
            if self._advance is None:
                self._advance = entry_point(advance, self._args)
            self._run = self._advance
        else:
            partial, op, kind, _, _ = reduction
            user_t = partial[:0] if user is None else user
            self._args = (*args, spins, partial, pair.view(partial.dtype), op, kind, user_bytes, user_t)
            key = (partial.dtype, partial.flags.c_contiguous, user_t.flags.c_contiguous)
            self._run = self._reducing.get(key)
            if self._run is None:
                self._run = self._reducing[key] = entry_point(advance_reducing, self._args)
        return self.resume()

    def words(self, inbox: np.ndarray) -> np.ndarray:
        """``inbox`` as int64 (the transport's inbox, the same every call: the view is kept)."""
        if self._inbox is not inbox:
            self._inbox, self._words = inbox, inbox.view(np.int64)
        return self._words

    def resume(self) -> int:
        """Go on with the exchange :meth:`start` left PENDING; also kept in ``state``."""
        state = self._run(*self._args)
        if state == REDUCE:  # a payload without a reduction: the caller's error
            self.abandon()
            raise ValueError("reduction: this exchange reduces payloads on the way")
        self.state = state
        return state

    def late(self) -> list[int]:
        """Ranks of the communicator whose message this rank still waits for: every rank not
        yet heard from in the exchange to all, the peer's half in recursive doubling's round
        (the peer may itself be waiting for a rank of it)."""
        k = int(self.st[S_ROUND])
        if self.doubling:
            first = (self.rank ^ k) & ~(k - 1)
            return list(range(first, first + k))
        others = [q for q in range(self.size) if q != self.rank]
        out = np.zeros(len(others), np.int32)
        unfinished(self.cfg, self.reqs, len(others), self.cells, self.statuses, out)
        return [q for q, pending in zip(others, out, strict=True) if pending]

    def abandon(self) -> None:
        """Cancel what is posted and start the next exchange afresh (after a failure)."""
        if self.st[S_POSTED]:
            cancel(self.cfg, self.reqs, int(self.st[S_NREQ]))
        if self.st[S_SAVED]:  # a round's tables over the kept half (clause 10): put it back
            inbox, head, nbytes, pair, user = self._borrowed_from
            k = int(self.st[S_ROUND])
            data = user if self.st[S_SUSER] else inbox[self.rank, head:nbytes]
            at, tables = int(self.st[S_SAVED]) - 1, k * head
            data[at:at + tables] = pair[int(self.rank > self.rank ^ k), :tables]
        self.st[:] = 0
        self.st[S_ROUND] = 1
