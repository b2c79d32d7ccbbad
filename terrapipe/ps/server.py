"""The server thread of a rank's shard: answers requests from ranks on other nodes.

Ranks on the owner's node never come here (NOTE [node shards] 2). The thread polls for headers
and yields between polls, so it costs nothing measurable while no other node asks, and it never
waits for its own rank's training: it only takes the chunk locks, which are held for one chunk's
copy at a time.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from ..kernels import shard as kshard
from .layout import Layout
from .node_shards import NodeShards
from .wire import ACK, DATA, HEADER, HEADER_WORDS, REPLY, STOP, Peer, wait_requests

__all__ = ["ShardServer"]


class ShardServer:
    """Serves rank ``rank``'s shard of ``shards`` over ``comm`` (the tensor's own duplicate of
    the group communicator) to ``peers`` (one :class:`Peer` per group rank), on a daemon thread.
    ``error`` holds the first failure (a client that died mid-request), reported by the tensor.
    """

    def __init__(self, comm, rank: int, shards: NodeShards, layout: Layout, dtype: np.dtype,
                 peers: list[Peer], timeout: float, name: str) -> None:
        from mpi4py import MPI

        self._MPI, self.comm, self.rank = MPI, comm, rank
        self.shards, self.layout, self.dtype = shards, layout, np.dtype(dtype)
        self.peers, self.timeout, self.name = peers, timeout, name
        self.error: str | None = None
        self._chunk_in = np.empty(layout.chunk, self.dtype)
        self._chunk_out = [np.empty(layout.chunk, self.dtype) for _ in range(2)]
        self.served = 0
        self._thread = threading.Thread(target=self._loop, name=f"terrapipe-ps-server-{name}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        MPI = self._MPI
        hdr = np.empty(HEADER_WORDS, np.int64)
        status = MPI.Status()
        while True:
            req = self.comm.Irecv(hdr, source=MPI.ANY_SOURCE, tag=HEADER)
            pause = 0.0
            while not req.Test(status):
                time.sleep(pause)
                pause = min(pause * 2 + 2e-5, 1e-3)
            if int(hdr[0]) == STOP:
                return
            client = status.Get_source()
            try:
                self._serve(client, hdr.copy())
                self.served += 1
            except Exception as e:  # noqa: BLE001 - reported by the tensor, the thread serves on
                if self.error is None:
                    self.error = f"server of rank {self.rank}'s shard: {e}"
                print(f"terrapipe.ps {self.name}: {self.error}", file=sys.stderr, flush=True)

    def _serve(self, client: int, hdr: np.ndarray) -> None:
        MPI = self._MPI
        rule, want, lo, n, seq = int(hdr[0]), bool(hdr[1]), int(hdr[2]), int(hdr[3]), int(hdr[5])
        scale = self.dtype.type(hdr[4:5].view(np.float64)[0])
        peer = self.peers[client]
        what = f"{self.name}: request {seq} from rank {client}"
        sends: list = []
        chunk = self.layout.chunk
        first = lo // chunk
        for i, start in enumerate(range(lo, lo + n, chunk)):
            stop = min(start + chunk, lo + n)
            m = stop - start
            src = None
            if rule in (kshard.ADD, kshard.COPY):
                src = self._chunk_in[:m]
                wait_requests(MPI, [self.comm.Irecv(src, source=client, tag=DATA)], self.timeout,
                              what, peer)
            out = None
            if want:
                out = self._chunk_out[i % 2][:m]
                if len(sends) == 2:  # the buffer's previous reply must have left
                    wait_requests(MPI, [sends.pop(0)], self.timeout, what, peer)
            self.shards.apply(self.rank, start, stop, first + i, rule, scale, src, out, what)
            if want:
                sends.append(self.comm.Isend(out, dest=client, tag=REPLY))
        if not want:
            sends.append(self.comm.Isend(np.array([seq], np.int64), dest=client, tag=ACK))
        wait_requests(MPI, sends, self.timeout, what, peer)

    def stop(self) -> None:
        """Stop the thread (after the collective barrier of NOTE [shard wire protocol] 4)."""
        if self._thread.is_alive():
            stop = np.zeros(HEADER_WORDS, np.int64)
            stop[0] = STOP
            self.comm.Send(stop, dest=self.comm.Get_rank(), tag=HEADER)
            self._thread.join()
