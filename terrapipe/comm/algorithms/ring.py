"""Chunked ring allreduce over the MPI transport's point-to-point (comm/transports/mpi.py),
reducing received chunks with the JIT kernels.

Runs large allreduces on one node when each rank has a core, the cross-node parts of the
hierarchical allreduce, and allreduces when collectives go flat over MPI (NOTE [algorithm
selection] in comm/select.py). Bandwidth-optimal: each rank sends and receives 2 (p - 1) / p of
the buffer, whatever p.

NOTE [ring schedule]
    1. The buffer is cut into p segments (:func:`segments`). Reduce-scatter: at step s = 0 ..
       p-2, rank r sends segment (r - s) mod p to rank r + 1 and receives segment (r - s - 1)
       mod p from r - 1, combining it into its own copy; after p - 1 steps rank r holds the full
       result of segment (r + 1) mod p. All-gather: at step s rank r sends segment (r + 1 - s)
       mod p and stores the received segment (r - s) mod p. Numbered as one run of 2(p - 1)
       steps t, step t sends segment (r - t) mod p and receives (r - t - 1) mod p: what step t
       receives is what step t + 1 sends. Messages between two ranks on one communicator and
       tag arrive in order, so one tag serves every step; callers give the ring a communicator
       no one else sends on.
    2. A segment travels in chunks, and the steps are pipelined by chunk: chunk k of step t + 1
       is sent as soon as chunk k of step t has arrived (and, reducing, been combined), not once
       the whole of step t has. A rank's receives follow its left neighbour's sends in order,
       one posted ahead of the one it waits for; two receive buffers let chunk k + 1 arrive
       while chunk k is reduced. Waiting for a whole step first left the link idle for a chunk
       at every one of the 2(p - 1) step boundaries, a chunk's transfer plus its reduction,
       which at 4 nodes of one rank is 2(p - 1) chunks of each segment's few.
    3. The all-gather receives in place, over a segment this rank sent during the
       reduce-scatter (step t's segment was step t + 1 - p's): the receive is posted only after
       that send completed. It has in practice (its bytes went around the ring before these
       came back), but MPI lets a send read its buffer until the request says it is done.
    4. A receive's wait tests its request ``RING_POLLS`` times between yields of the core, not
       once (MpiTransport.wait): a chunk of half a MiB moves only as this rank's own calls into
       MPI push it (NOTE [MPI progress] 1), and a yield between every test left it waiting for
       the core while the link was idle. 4 nodes x 1 over 10gbit, 2-core Xeon,
       ``comm.allreduce`` float32 sum, per-round medians of 7 (3) interleaved rounds,
       2026-11-27, the speed-up over one test a yield at 4 / 16 / 64 MiB: 8 tests 1.05 / 1.13 /
       1.23x, 32 tests 1.12 / 1.08 / 1.24x, 128 tests 1.08 / 1.12 / 1.22x; at 4 MiB MPICH's
       allreduce took 9.75 ms, one test a yield 10.83, 32 tests 9.35. Over 1gbit (16 MiB),
       where the link sets the pace, level (1.01x at 32, 0.91x at 128). MPI's own blocking
       ``Wait`` was slower than any (51.5 ms at 16 MiB against 39.5 for a test and a yield from
       Python) and would not notice a dead peer.

NOTE [MPI progress]
    1. MPI promises only that of a matched send and receive *one* completes by itself (the
       standard's progress rule); the other may need its process to call into MPI again. MPICH
       (ch4, rendezvous for large messages) completes a sender's ``Isend`` only once the receiver's
       progress engine has acknowledged the transfer, after the receiver's ``Irecv`` completed.
    2. So a rank that leaves the ring once its own requests are done can strand its left
       neighbour's last sends: it spins on the shared-memory board, or sits in MPI_Finalize's
       barrier, making no progress call, while that neighbour waits for its sends forever (a 64
       MiB allreduce in a loop hung this way). The ring therefore ends with a handshake: a rank
       sends an empty *done* message to its right neighbour once every one of its own data sends
       has completed, and leaves only after the done message from its left neighbour arrived. When
       ``ring_allreduce`` returns, no rank's data send depends on this rank any more.
    3. A done message's own send may in turn wait for the right neighbour's progress, so it is not
       waited for here: the request goes to ``pending``, which the next ring call reaps and the
       group completes, with every rank progressing, in its closing barrier.
    4. Waits outside MPI (the board's wait in comm/transports/board.py) call a progress function between spin
       rounds, so MPI's own collectives (whose sends may depend on a peer in the same way) and the
       done messages complete while a rank waits on shared memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ... import timeline
from ...kernels import reduce as kreduce
from ..message import NO_GATE, Fused, divide, reduce_flat, segments
from ..transports.mpi import CHUNK_BYTES

__all__ = ["RING_TAG", "DONE_TAG", "allreduce", "allreduce_array", "ring_allreduce", "segments"]

RING_TAG = 7201
DONE_TAG = 7202
_EMPTY = np.empty(0, np.uint8)  # the done message: no payload, only its arrival counts
# Tests of a ring receive's request between yields of the core (NOTE [ring schedule] 4).
RING_POLLS = 32


def allreduce(mpi, srcs: Fused, dsts: Fused, op: int, dtype, kind: int, ckind: int = 0, root: int = -1,
              gate=NO_GATE) -> None:
    """``dsts`` = op over every rank's ``srcs`` through the ring over MpiTransport ``mpi`` (the
    agreement has run); ``root`` >= 0: only that rank's ``dsts`` is written (a reduce)."""
    gate.ready(srcs.n)

    def reduce(buf: np.ndarray) -> None:
        allreduce_array(mpi, buf, op, kind, "allreduce")
        if op == kreduce.AVG:
            divide(buf, mpi.size, kind)

    reduce_flat(srcs, dsts, dtype, ckind, root < 0 or root == mpi.members[mpi.rank], reduce)
    gate.wrote(srcs.n)


def allreduce_array(mpi, buf: np.ndarray, op: int, kind: int, what: str) -> None:
    """:func:`ring_allreduce` over MpiTransport ``mpi``'s ring communicator, with its timeout,
    done messages, scratch and tuned chunk size: in place on ``buf``, summing for ``avg``."""
    ring_allreduce(mpi.ring_comm, buf, op, kind,
                   lambda req, w, peer: mpi.wait(req, f"{what}: {w}", peer, polls=RING_POLLS), mpi.done_sends,
                   mpi.ring_scratch, mpi.chunk_bytes)


def ring_allreduce(comm, buf: np.ndarray, op: int, kind: int,
                   wait: Callable[[object, str, int], None], pending: list,
                   scratch: np.ndarray | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """In place: ``buf`` = op over every rank's ``buf`` (AVG sums; the caller divides).

    comm: an mpi4py communicator reserved for this traffic; buf: 1-D C-contiguous, native
    float32/float64/int32/int64, or uint16 holding float16/bfloat16 (``kind``: kreduce.F16 or
    BF16; sums accumulate in float32 and round once per step); wait(request, what, peer):
    completes an MPI request with rank ``peer`` of ``comm`` or raises (the caller's timeout).
    Same length and dtype on every rank.
    ``pending``: the caller's list of this communicator's outstanding done-message sends (NOTE
    [MPI progress] 3); completed ones are dropped here, this call's is appended. ``scratch``:
    uint8, at least 2 * ``chunk_bytes``, owned by the caller for the call: the two receive
    buffers of the reduce-scatter (allocated per call when None: fresh pages, page faults).
    """
    p, r = comm.Get_size(), comm.Get_rank()
    n = buf.shape[0]
    if p == 1 or n == 0:
        return
    pending[:] = [req for req in pending if not req.Test()]
    parts = segments(n, p)
    right, left = (r + 1) % p, (r - 1) % p
    chunk = max(1, chunk_bytes // buf.itemsize)
    m = min(chunk, parts[0][1] - parts[0][0])
    if scratch is None or scratch.shape[0] < 2 * chunk * buf.itemsize:
        scratch = np.empty(2 * chunk * buf.itemsize, np.uint8)
    half = chunk * buf.itemsize
    spare = [scratch[k * half:(k + 1) * half].view(buf.dtype)[:m] for k in range(2)]
    steps = 2 * (p - 1)  # NOTE [ring schedule] 1: step t sends segment (r - t) mod p

    def chunks(t: int) -> list[tuple[int, int]]:  # the chunks of the segment step t sends
        a, b = parts[(r - t) % p]
        return [(c, min(c + chunk, b)) for c in range(a, b, chunk)]

    # NOTE [ring schedule] 2: chunk k's send of step t + 1 goes as soon as its receive of step t
    # is in; the receives in the order the left neighbour sends them.
    recvs = [(t, k, a, b) for t in range(steps) for k, (a, b) in enumerate(chunks(t + 1))]
    sends = {(0, k): comm.Isend(buf[a:b], right, RING_TAG) for k, (a, b) in enumerate(chunks(0))}

    def post(i: int):
        t, k, a, b = recvs[i]
        if t < p - 1:  # reduce-scatter: into a spare buffer
            dst = spare[i % 2][:b - a]
        else:  # all-gather: into place, once the send that read it is done (NOTE [ring schedule] 3)
            wait(sends.pop((t + 1 - p, k)), "ring allreduce (reduce-scatter) sending", right)
            dst = buf[a:b]
        return comm.Irecv(dst, left, RING_TAG), dst

    def postable(i: int) -> bool:  # an all-gather receive's send issued (not yet, where segments are empty)
        t, k = recvs[i][:2]
        return t < p - 1 or (t + 1 - p, k) in sends

    with timeline.span("comm", "ring allreduce"):
        inflight = post(0)
        for i, (t, k, a, b) in enumerate(recvs):
            req, dst = inflight
            wait(req, f"ring allreduce ({_PHASES[t >= p - 1]}) receiving", left)
            ahead = i + 1 < len(recvs) and postable(i + 1)
            if ahead:  # the next chunk arrives while this one is reduced
                inflight = post(i + 1)
            if t < p - 1:
                if kind:
                    kreduce.reduce_16(buf[a:b], dst, op, 0, b - a, kind)
                else:
                    kreduce.reduce_native(buf[a:b], dst, op, 0, b - a)
            if t + 1 < steps:
                sends[(t + 1, k)] = comm.Isend(buf[a:b], right, RING_TAG)
            if not ahead and i + 1 < len(recvs):
                inflight = post(i + 1)
        for (t, _), req in sends.items():
            wait(req, f"ring allreduce ({_PHASES[t >= p - 1]}) sending", right)
    # NOTE [MPI progress] 2: every send of this rank has completed.
    done = comm.Irecv(_EMPTY, left, DONE_TAG)
    pending.append(comm.Isend(_EMPTY, right, DONE_TAG))
    wait(done, "ring allreduce (done)", left)


_PHASES = ("reduce-scatter", "all-gather")
