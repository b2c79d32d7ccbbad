"""Where each element of a sharded tensor lives: shard bounds per rank, chunks within a shard."""

from __future__ import annotations

__all__ = ["Layout"]


class Layout:
    """``numel`` elements split into ``size`` contiguous shards, shard ``r`` owned by group rank
    ``r`` (sizes differ by at most one element), each cut into chunks of ``chunk`` elements: the
    unit of locking (NOTE [shard chunks] in tensor.py) and of messages between nodes."""

    def __init__(self, numel: int, size: int, itemsize: int, chunk_bytes: int) -> None:
        if chunk_bytes < itemsize:
            raise ValueError(f"chunk_bytes must hold at least one element, got {chunk_bytes}")
        self.numel, self.size = int(numel), int(size)
        self.bounds = [self.numel * r // self.size for r in range(self.size + 1)]
        self.chunk = max(1, int(chunk_bytes) // int(itemsize))

    def shard(self, r: int) -> tuple[int, int]:
        """``(start, stop)`` of rank ``r``'s shard in the flat tensor."""
        return self.bounds[r], self.bounds[r + 1]

    def shard_len(self, r: int) -> int:
        return self.bounds[r + 1] - self.bounds[r]

    def nchunks(self, r: int) -> int:
        return -(-self.shard_len(r) // self.chunk)

    def chunks(self, r: int):
        """``(k, lo, hi)`` per chunk of rank ``r``'s shard, in shard-local element offsets."""
        n = self.shard_len(r)
        for k, lo in enumerate(range(0, n, self.chunk)):
            yield k, lo, min(lo + self.chunk, n)
