"""The shards of one node's ranks in one shared segment, with a spin lock per chunk.

NOTE [node shards]
    1. The segment holds a pid per local rank, then the lock words of every local shard's
       chunks (one cache line each, kernels/shard.py), then each local rank's shard, 64-byte
       aligned. Its lifetime is that of every shared segment (NOTE [shm segment lifetime] in
       comm/transports/shm.py): unlinked once mapped, so nothing outlives the job.
    2. Every rank of the node applies its own requests to any local shard directly, under the
       chunk's lock: a push on the node costs one pass over the data and never waits for the
       owner, whatever the owner is doing (training, or blocked in a collective). Requests from
       other nodes arrive at the owner's wire thread (wire_thread.py), which applies them here
       in the same way.
    3. A rank that cannot take a lock yields its core between bounded tries; when the holder's
       process is gone, the error names it (a lock is only ever held for one chunk's copy, so
       the holder dying is the only way to wait long).
"""

from __future__ import annotations

import os

import numpy as np

from ..comm import CollectiveTimeoutError, Segment, alive, wait_until
from ..kernels import shard as kshard
from .layout import Layout

__all__ = ["NodeShards"]

_SPINS = 256  # lock tries per compiled call before the caller yields (NOTE [node shards] 3)
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class NodeShards:
    """The shared memory of a node's shards (NOTE [node shards]).

    ``node_comm``: mpi4py communicator of this node's ranks of the group (None: a lone
    process, private memory); ``node_ranks[i]``: group rank of local rank i; ``rank``: this
    process's group rank. Collective over ``node_comm``.
    """

    def __init__(self, node_comm, node_ranks: list[int], rank: int, layout: Layout,
                 dtype: np.dtype, timeout: float) -> None:
        self.layout, self.dtype, self.timeout = layout, np.dtype(dtype), timeout
        self.node_ranks = list(node_ranks)
        self.token = rank + 1
        p = len(self.node_ranks)
        nlocks = sum(layout.nchunks(r) for r in self.node_ranks)
        pid_bytes = _aligned(8 * p)
        lock_bytes = _aligned(8 * kshard.LOCK_STRIDE * max(nlocks, 1))
        offsets, pos = {}, pid_bytes + lock_bytes
        first_lock, k = {}, 0
        for r in self.node_ranks:
            offsets[r] = pos
            pos += _aligned(layout.shard_len(r) * self.dtype.itemsize)
            first_lock[r] = k
            k += layout.nchunks(r)
        if node_comm is None:
            self._segment = None
            buf = np.zeros(max(pos, 64), np.uint8)
        else:
            self._segment = Segment(node_comm, pos)
            buf = self._segment.buf
        self.pids = buf[:8 * p].view(np.int64)
        self.pids[self.node_ranks.index(rank)] = os.getpid()
        self.locks = buf[pid_bytes:pid_bytes + lock_bytes].view(np.int64)
        self._first_lock = first_lock
        self.shards = {r: buf[offsets[r]:offsets[r] + layout.shard_len(r) * self.dtype.itemsize]
                       .view(self.dtype) for r in self.node_ranks}
        self._empty = np.empty(0, self.dtype)

    def holds(self, r: int) -> bool:
        """Whether group rank ``r``'s shard is in this node's segment."""
        return r in self.shards

    def apply(self, r: int, lo: int, hi: int, k: int, rule: int, scale, src: np.ndarray | None,
              out: np.ndarray | None, what: str) -> None:
        """Chunk ``k`` (elements ``[lo, hi)``) of rank ``r``'s shard: apply ``rule`` with ``src``
        (the chunk's values; None for ZERO/NONE), then copy it into ``out`` if given, under the
        chunk's lock. ``what`` names the operation in errors."""
        shard = self.shards[r][lo:hi]
        src = shard if src is None else src
        out = self._empty if out is None else out
        lock = self._first_lock[r] + k
        held = [kshard.locked_apply(self.locks, lock, self.token, _SPINS, shard, src, out, rule, scale)]
        if held[0] == -1:
            return

        def applied() -> bool:
            held[0] = kshard.locked_apply(self.locks, lock, self.token, _SPINS, shard, src, out, rule, scale)
            return held[0] == -1

        def failure(timed_out: bool) -> Exception | None:
            if held[0] == 0:  # free at the last try: nobody to name yet
                return None
            holder = int(held[0]) - 1
            pid = int(self.pids[self.node_ranks.index(holder)]) if holder in self.node_ranks else 0
            if pid and not alive(pid):
                return CollectiveTimeoutError(f"{what}: chunk {k} of rank {r}'s shard is locked by rank "
                                              f"{holder} (pid {pid}), which died", [holder])
            if timed_out:
                return CollectiveTimeoutError(
                    f"{what}: timed out after {self.timeout:g}s waiting for the lock of chunk {k} "
                    f"of rank {r}'s shard, held by rank {holder}", [holder])
            return None

        # The holder is a rank of this node applying one chunk: never sleep, yield to it.
        wait_until(applied, self.timeout, failure, sleep_after=None, check_every=64)

    def close(self) -> None:
        self.shards, self.locks, self.pids = {}, None, None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
