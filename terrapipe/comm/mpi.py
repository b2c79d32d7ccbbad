"""The MPI transport: collectives over one mpi4py communicator.

Used between nodes (one communicator per local rank across nodes, for the hierarchical shm
allreduce), for every collective when MPI is forced or nodes differ in rank count, and on one
node for messages where MPI beats the shared segment (``Group._route``). Large allreduces run
as our chunked ring (comm/ring.py) with the JIT reduction kernels; smaller ones as MPI's own
allreduce, or for 16-bit formats an allgather reduced here with float32 accumulation.

Every request is polled, never waited on blindly: a wait that outlasts the timeout raises
CollectiveTimeoutError naming the ranks it waits for. NOTE [MPI progress] in ring.py says why a
rank keeps MPI's progress engine turning while it waits elsewhere, and why the transport ends
with a barrier in which every rank progresses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from .. import settings, timeline
from ..kernels import reduce as kreduce
from .errors import CollectiveTimeoutError
from .ring import CHUNK_BYTES, ring_allreduce, segments
from .transport import NO_GATE, Fused, Transport, divide

__all__ = ["MpiTransport", "RING_BYTES"]

# At or above this many bytes an allreduce over MPI runs as our chunked ring (NOTE [ring
# schedule]); below it MPI's own allreduce. Measured by benchmarks.allreduce --algorithms.
RING_BYTES = settings.SETTINGS["TERRAPIPE_RING_BYTES"].default  # without the setting or tune()
_SPINS_BEFORE_YIELD = 200


class MpiTransport(Transport):
    """Collectives over ``comm`` (mpi4py). ``members[i]``: the group rank of rank i of ``comm``;
    ``timeout``: seconds a request may take; ``late_hint()``: (group ranks, why) known to be
    late from elsewhere (the node's board), or None, to name in a timeout."""

    name = "mpi"

    def __init__(self, comm, members: list[int], timeout: float,
                 late_hint: Callable[[], tuple[list[int], str] | None] = lambda: None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.ring_comm = comm.Dup()  # ring traffic never meets MPI's own or the user's messages
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.members = members
        self.timeout = timeout
        self._late_hint = late_hint
        self._done_sends: list = []  # the ring's done messages not known complete (NOTE [MPI progress] 3)
        self.ring_bytes = settings.get("TERRAPIPE_RING_BYTES")  # this large or larger: the ring (tune())
        self.chunk_bytes = CHUNK_BYTES  # the ring's message size (tune())
        self._ring_scratch = np.empty(2 * CHUNK_BYTES, np.uint8)  # the ring's receive buffers
        self._acc = np.empty(kreduce.TILE, np.float32)

    # -- waiting ------------------------------------------------------------------------------
    def wait(self, req, what: str, peer: int | None = None) -> None:
        """Poll ``req`` until done, or raise CollectiveTimeoutError after the timeout naming the
        ranks it waits for (``peer``: the one rank of ``comm`` it depends on, if one)."""
        if not req.Test():
            self.wait_all([req], what, peer)

    def wait_all(self, reqs: list, what: str, peer: int | None = None) -> None:
        Testall = self._MPI.Request.Testall
        start = time.monotonic()
        spins = 0
        while not Testall(reqs):
            spins += 1
            if spins <= _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # ranks may outnumber cores
            if spins % 256:
                continue
            hint = self._late_hint()
            died = hint is not None and hint[1] == "died"  # no use waiting out the timeout
            if died or time.monotonic() - start > self.timeout:
                for req in reqs:
                    try:
                        req.Cancel()
                    except self._MPI.Exception:
                        pass  # a collective's request cannot be cancelled; it is abandoned
                late, why = hint if died else self._late_ranks(peer)
                names = ", ".join(f"rank {r}" for r in late)
                cause = "a peer died" if died else f"Timed out after {self.timeout:g}s"
                raise CollectiveTimeoutError(f"{what}: {cause} in MPI waiting for {names} ({why})", late)

    def _late_ranks(self, peer: int | None) -> tuple[list[int], str]:
        hint = self._late_hint()
        if hint is not None:
            return hint
        if peer is not None:
            return [self.members[peer]], "its peer in this transfer"
        me = self.members[self.rank]
        return [r for r in self.members if r != me], "one of these never arrived"

    def progress(self) -> None:
        """One turn of MPI's progress engine (NOTE [MPI progress] 4 in ring.py)."""
        self.ring_comm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG)

    # -- collectives ---------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        sigs = np.empty((self.size, sig.shape[0]), np.int64)
        self.wait(self.comm.Iallgather(sig, sigs), coll)
        check(sigs, self.members)

    def allreduce(self, srcs: Fused, dsts: Fused, op, dtype, kind, ckind=0, root=-1, gate=NO_GATE) -> None:
        gate.ready(srcs.n)
        out = dsts.only()
        mine = root < 0 or root == self.members[self.rank]
        # Reduce straight in the destination when it is one flat array this rank may overwrite.
        direct = (out is not None and not ckind and out.dtype == np.dtype(dtype) and out.flags.c_contiguous
                  and mine)
        if direct:
            buf = out
            src = srcs.only()
            if src is None or src.ctypes.data != out.ctypes.data:
                srcs.read(0, srcs.n, buf)
        else:
            buf = np.empty(srcs.n, dtype)
            srcs.read(0, srcs.n, buf, ckind)
        self.allreduce_array(buf, op, kind, "allreduce")
        if op == kreduce.AVG:
            divide(buf, self.size, kind)
        if not direct and mine:
            dsts.write(0, buf, ckind)
        gate.wrote(srcs.n)

    def allreduce_array(self, buf: np.ndarray, op: int, kind: int, what: str,
                        ring: bool | None = None) -> None:
        """In place on ``buf`` (1-D, C-contiguous; uint16 bits for ``kind``); ``avg`` sums (the
        caller divides, by the size of the whole group when this is its cross-node part).
        ``ring``: our ring (True) or MPI's own allreduce (False); default by ``ring_bytes``."""
        if ring if ring is not None else buf.nbytes >= self.ring_bytes:
            ring_allreduce(self.ring_comm, buf, op, kind,
                           lambda req, w, peer: self.wait(req, f"{what}: {w}", peer), self._done_sends,
                           self._ring_scratch, self.chunk_bytes)
        elif kind:
            gathered = np.empty((self.size, buf.shape[0]), buf.dtype)
            self.wait(self.comm.Iallgather(buf, gathered), what)
            kreduce.reduce_many_16(buf, gathered, op, 0, buf.shape[0], kind, self._acc)
        else:
            MPI = self._MPI
            mop = {kreduce.SUM: MPI.SUM, kreduce.AVG: MPI.SUM, kreduce.PROD: MPI.PROD,
                   kreduce.MIN: MPI.MIN, kreduce.MAX: MPI.MAX}[op]
            with timeline.span("comm", "MPI allreduce"):
                self.wait(self.comm.Iallreduce(MPI.IN_PLACE, buf, mop), what)

    def tune(self, ring_bytes: int | None, chunk_bytes: int | None) -> None:
        """Set the ring's threshold and chunk (bytes) for the collectives that follow; every
        rank must set the same values at the same point of its collective sequence."""
        if ring_bytes is not None:
            self.ring_bytes = int(ring_bytes)
        if chunk_bytes is not None:
            self.chunk_bytes = int(chunk_bytes)
            if self._ring_scratch.shape[0] < 2 * self.chunk_bytes:
                self._ring_scratch = np.empty(2 * self.chunk_bytes, np.uint8)

    def broadcast(self, flat, root) -> None:
        self.wait(self.comm.Ibcast(flat, root=self.members.index(root)), "broadcast")

    def allgather(self, flat, out, root=-1) -> None:
        if root >= 0:
            local_root = self.members.index(root)
            recv = out if self.rank == local_root else None
            self.wait(self.comm.Igather(flat, recv, root=local_root), "gather")
        else:
            self.wait(self.comm.Iallgather(flat, out), "allgather")

    def scatter(self, full, out, root) -> None:
        local_root = self.members.index(root)
        self.wait(self.comm.Iscatter(full if self.rank == local_root else None, out, root=local_root),
                  "scatter")

    def reduce_scatter(self, flat, out, op, kind) -> None:
        # Through a full allreduce: simple, and correct for every dtype and topology.
        tmp = flat.copy()
        self.allreduce_array(tmp, op, kind, "reduce_scatter")
        lo, hi = segments(flat.shape[0], self.size)[self.rank]
        out[...] = tmp[lo:hi]
        if op == kreduce.AVG:
            divide(out, self.size, kind)

    def barrier(self) -> None:
        self.wait(self.comm.Ibarrier(), "barrier")

    def send(self, flat, dest, tag) -> None:
        self.wait(self.comm.Isend(flat, dest=self.members.index(dest), tag=tag), f"send to rank {dest}",
                  self.members.index(dest))

    def recv(self, flat, source, tag) -> None:
        self.wait(self.comm.Irecv(flat, source=self.members.index(source), tag=tag),
                  f"recv from rank {source}", self.members.index(source))

    def close(self) -> None:
        """Every rank progresses MPI until every rank got here (NOTE [MPI progress] 3): the done
        messages and MPI's own sends still waiting on a peer complete before MPI goes."""
        reqs, self._done_sends = self._done_sends, []
        try:
            self.wait_all(reqs + [self.comm.Ibarrier()], "closing the group")
        except CollectiveTimeoutError:
            pass  # a peer died or never closed: nothing is left to protect, and exit must go on
