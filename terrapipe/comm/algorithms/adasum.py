"""Adasum across a group's ranks: each tensor combined pairwise up a tree of ranks
(kernels/adasum.py has the rule), by vector halving and distance doubling.

NOTE [adasum by halves]
    1. What it computes. Among 2^k ranks Adasum is a tree: at level L = 1, 2, 4, ... each
       block of 2L consecutive ranks combines its left half's result (the ranks whose bit L is
       clear) with its right half's, each tensor by its own coefficients. Four ranks give
       adasum(adasum(g0, g1), adasum(g2, g3)). This is Horovod's definition (its
       vector-halving distance-doubling Adasum of ``op=hvd.Adasum``), and the steps below are
       its steps, so a job moving from Horovod gets the same result up to rounding.
    2. Vector halving. At level L a rank and its partner (rank ^ L) hold the same range of the
       fused vector. The left one keeps the range's first half (the shorter, when the length
       is odd), the right one the second half, and each gives the partner the half it gives
       up. Both halves cross at once, as an allgather in the pair's own group, over whatever
       transport the pair has (shared memory on a node, TCP or MPI across nodes). Each rank
       sends N/2 + N/4 + ... = N (n - 1) / n elements in all, a ring's reduce-scatter.
    3. The coefficients come from the block's whole vectors. A tensor's a.b, |a|^2 and |b|^2
       are over the whole vectors, but each of the block's 2L ranks holds one piece of them.
       So each rank's shares, per tensor, ordered (a.b, |left|^2, |right|^2), are allgathered
       in the block's group and summed there in rank order. Every rank of the block then
       derives the same coefficients, bit for bit.
    4. After the last level every rank holds its own piece of the result. One allgather over
       the group gives every rank every piece (a ring's allgather: N (n - 1) / n again). Each
       element was computed once, by one rank, so the result is the same on every rank, bit
       for bit.
    5. The pairs' and blocks' groups are split off the group at its first Adasum, inside that
       collective (so in issue order on every rank), and closed with the group
       (``Group.derived``). Where a pair or block is the whole group (the last level's block;
       the pair, at two ranks), the group itself serves. That is 2 log2(n) - 2 groups: none at
       2 ranks, 2 at 4. Their scratch buffers are the plan's, reused from call to call.
    6. A power of two of ranks only: Horovod's rule (its PyTorch frontend refuses the others).
    7. A failure in a pair's or block's group names that group's ranks; the error says which
       ranks of this group they are.
    8. Small messages go another way. Steps 2 to 4 take 2 log2(n) + 1 exchanges, each a
       collective's fixed cost; where the ranks' vectors together are at most ``GATHER_BYTES``,
       one exchange brings every rank every vector and each computes the whole tree, in the
       same order and with sums that keep their order (NOTE [which sums may be reordered] in
       kernels/adasum.py), so again every rank holds the same bits. The exchange is an
       allreduce (sum) of n rows, each rank's vector in its own row and zeros elsewhere: a sum
       of one value and zeros is that value, so it gathers exactly (a -0.0 arrives as 0.0, on
       every rank alike), through the one-shot and its agreement in one step; a small
       allgather is slower (``python -m benchmarks.adasum``'s ``gathered`` case, an allgather
       and the tree in NumPy, took 45 / 251 us at 4 KiB and 2 / 4 ranks, this way 18 / 120;
       2026-12-04, a 2-core AMD EPYC family 25 model 17). The crossover with the halving,
       from ``python -m benchmarks.adasum -n 2`` and ``-n 4``
       (``benchmarks/results/adasum_n{2,4}_2026-12-04.json``), is 512 KiB
       gathered: at 2 ranks the gather took 129 us at 128 KiB a rank (halves 152) and 343 at
       512 KiB (halves 216); at 4 ranks 553 us at 128 KiB (halves 712).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...kernels import adasum as kadasum
from ...kernels import reduce as kreduce
from .. import select
from ..buffers import Buffer
from ..errors import CollectiveTimeoutError, CommError

__all__ = ["allreduce", "pieces", "Called", "GATHER_BYTES"]

# NOTE [adasum by halves] 8: at most this many bytes gathered a rank (the rank count times the
# fused vector), a call goes by one allgather and the whole tree on every rank instead.
GATHER_BYTES = 512 << 10


class Called(NamedTuple):
    """What a call's signature is made of (Group.signature): its dtype, elements and shape."""

    dtype_name: str
    size: int
    shape: tuple


class _Plan:
    """A group's Adasum state: each level's (pair group, block group, their ranks), and scratch
    reused from call to call (a fresh 64 MiB buffer a call costs its page faults, 10 ms)."""

    def __init__(self, g) -> None:
        self.levels, L = [], 1
        while L < g.size:
            pair_ranks = sorted((g.rank, g.rank ^ L))
            base = g.rank - g.rank % (2 * L)
            block_ranks = list(range(base, base + 2 * L))
            pair = g if g.size == 2 else g.split(g.rank & ~L)
            block = pair if L == 1 else g if 2 * L == g.size else g.split(base)
            self.levels.append((pair, block, pair_ranks, block_ranks))
            L <<= 1
        self._g = g
        self._scratch: dict[tuple[str, str], np.ndarray] = {}

    def scratch(self, what: str, n: int, dtype) -> np.ndarray:
        """(n,) of ``dtype``, this plan's own for ``what`` (grown when too short)."""
        key = (what, np.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[key] = np.empty(max(n, 1), dtype)
        return buf[:n]

    def close(self) -> None:
        for pair, block, _, _ in self.levels:
            for sub in (pair, block):
                if sub is not self._g:
                    sub.close()
        self.levels, self._scratch = [], {}


def _plan(g) -> _Plan:
    """``g``'s plan, made at its first Adasum (collective: clause 5)."""
    plan = g.derived.get("adasum")
    if plan is None:
        plan = g.derived["adasum"] = _Plan(g)
    return plan


def pieces(n: int, size: int) -> list[tuple[int, int]]:
    """The range ``[lo, hi)`` of an ``n``-element vector each of ``size`` ranks (a power of two)
    holds after the last level (NOTE [adasum by halves] 2)."""
    out = []
    for r in range(size):
        lo, hi, L = 0, n, 1
        while L < size:
            mid = lo + (hi - lo) // 2
            lo, hi = (lo, mid) if not r & L else (mid, hi)
            L <<= 1
        out.append((lo, hi))
    return out


def allreduce(g, fused: np.ndarray, bounds: np.ndarray, kind: int, sig) -> None:
    """Adasum of ``fused`` over ``g``'s ranks, in place.

    fused: (N,) float32 / float64, or uint16 bits of float16 / bfloat16 (``kind``
    kernels.F16 / BF16, else 0); the tensors of one dtype end to end. bounds: (k + 1,) int64,
    the tensors' offsets in it. sig: what every rank must have called alike (dtype_name, size,
    shape: the tensors' lengths), agreed here before any data moves. Runs inside the group's
    collective (its executor), so it calls comm/select.py directly."""
    plan = _plan(g)
    k = bounds.shape[0] - 1
    shares = np.empty((k, 3), np.float64)
    mine_c, their_c = np.empty(k, np.float64), np.empty(k, np.float64)
    n_all = fused.shape[0]
    if g.size * fused.nbytes <= GATHER_BYTES:  # clause 8
        rows = plan.scratch("rows", g.size * n_all, fused.dtype).reshape(g.size, n_all)
        rows[...] = 0
        rows[g.rank] = fused
        flat = rows.reshape(-1)
        # The latency path where it applies (a sync call of a native dtype), else the general
        # one; both sign the call alike, so ranks may take either.
        called = Called(sig.dtype_name, flat.shape[0], sig.shape)
        if kind or not select.allreduce_small(g, flat, kreduce.SUM, "adasum_allreduce", 0, sig.shape):
            select.allreduce_views(g, [flat], [flat], kreduce.SUM, kind, coll="adasum_allreduce",
                                   sig_buf=called)
        if kind:
            kadasum.tree_16(rows, bounds, shares, mine_c, their_c, kind)
        else:
            kadasum.tree(rows, bounds, shares, mine_c, their_c)
        fused[...] = rows[0]
        return
    g.agree("adasum_allreduce", kreduce.SUM, sig)
    lo, hi = 0, n_all
    for level, (pair, block, pair_ranks, block_ranks) in enumerate(plan.levels):
        L = 1 << level
        left = not g.rank & L
        mid = lo + (hi - lo) // 2
        keep_lo, keep_hi = (lo, mid) if left else (mid, hi)
        give_lo, give_hi = (mid, hi) if left else (lo, mid)
        width = hi - mid  # the longer half: the pair's rows are one length
        if give_hi - give_lo == width:
            row = fused[give_lo:give_hi]
        else:
            row = plan.scratch("half", width, fused.dtype)
            row[:give_hi - give_lo] = fused[give_lo:give_hi]
            row[give_hi - give_lo:] = 0
        both = _gather(pair, row, f"the halves of ranks {pair_ranks} at level {L}", pair_ranks,
                       plan.scratch("pair", 2 * width, fused.dtype))
        mine = fused[keep_lo:keep_hi]
        theirs = both[1 - pair.rank][:keep_hi - keep_lo]  # a pair's group is ordered by rank
        if kind:
            kadasum.dot_and_norms_16(mine, theirs, keep_lo, bounds, shares, kind)
        else:
            kadasum.dot_and_norms(mine, theirs, keep_lo, bounds, shares)
        if not left:  # clause 3: the left vector's norm first on every rank
            shares[:, [1, 2]] = shares[:, [2, 1]]
        every = _gather(block, shares.reshape(-1), f"the shares of ranks {block_ranks[0]}-{block_ranks[-1]} "
                        f"at level {L}", block_ranks, np.empty(block.size * 3 * k, np.float64))
        kadasum.coefficients(every.sum(axis=0).reshape(k, 3), left, mine_c, their_c)
        if kind:
            kadasum.combine_16(mine, mine_c, theirs, their_c, keep_lo, bounds, kind)
        else:
            kadasum.combine(mine, mine_c, theirs, their_c, keep_lo, bounds)
        lo, hi = keep_lo, keep_hi
    # Clause 4: every rank's piece to every rank.
    ranges = pieces(n_all, g.size)
    width = max(e - s for s, e in ranges)
    row = plan.scratch("piece", width, fused.dtype)
    row[:hi - lo] = fused[lo:hi]
    row[hi - lo:] = 0
    every = _gather(g, row, "the pieces of the result", list(range(g.size)),
                    plan.scratch("pieces", g.size * width, fused.dtype))
    for q, (s, e) in enumerate(ranges):
        if q != g.rank:
            fused[s:e] = every[q, :e - s]


def _gather(grp, row: np.ndarray, what: str, ranks: list[int], into: np.ndarray) -> np.ndarray:
    """(grp.size, len(row)) in ``into`` (flat, that long): every rank of ``grp``'s ``row``; an
    error names ``ranks`` (the group's members as ranks of the group Adasum runs on: NOTE
    [adasum by halves] 7)."""
    out = into.reshape(grp.size, row.shape[0])
    try:
        select.allgather(grp, Buffer(row, "adasum"), out)
    except CollectiveTimeoutError as e:
        raise CollectiveTimeoutError(f"adasum_allreduce: {what}: {e} (ranks {ranks} of this group, in order)",
                                     [ranks[q] for q in e.ranks if 0 <= q < len(ranks)]) from e
    except CommError as e:
        raise type(e)(f"adasum_allreduce: {what}: {e} (ranks {ranks} of this group, in order)") from e
    return out
