"""A reproducible storm of collectives with exact results, shared by the stress test and the soak.

Every rank draws the same schedule from one seed: allreduce (sum, avg, max), broadcast,
allgather, reduce_scatter, jit_allreduce, Adasum (of orthogonal vectors: exact; up to 16 MiB)
and in-place allreduces of pieces of a node-shared array (up to 4 MB; across nodes in 4 MiB
chunks), sync and async mixed (a quarter of the operations sync on some ranks and async on
others) with up to ``outstanding`` async operations
in flight, NumPy arrays and torch tensors, sizes across every path threshold of comm (the
one-shot allreduce up to 2 MiB at 2 ranks and 1 MiB at 4, which are also the shared-memory row
halves; the single-copy allreduce of private memory from 2 MiB; the shared-array path from
512 KiB; the ring's 512 KiB chunks and its 1 MiB start under forced MPI; the old one-shot limit
at 64 KiB) with odd lengths on both sides, up to ``max_bytes``. Inputs are small integers in
float32 (and int64, bfloat16), so every sum is exact and each result is compared bit for bit.

    python -m tests.comm.stress --minutes 5          # under mpiexec: the soak (make soak)
"""

from __future__ import annotations

import argparse
import resource
import time
from collections import deque

import numpy as np
import torch

import terrapipe.comm as comm

KIB, MIB = 1 << 10, 1 << 20
# Bytes of float32 messages: each threshold of comm/group.py with its neighbours, odd lengths.
SIZES = [0, 4, 28, 4 * KIB, 64 * KIB - 4, 64 * KIB, 64 * KIB + 4, 512 * KIB - 4, 512 * KIB + 4,
         MIB - 4, MIB, MIB + 4, 2 * MIB - 4, 2 * MIB, 2 * MIB + 4, 4 * 1_000_003, 16 * MIB + 12, 64 * MIB]
OPS = ("allreduce", "allreduce", "allreduce", "broadcast", "allgather", "gather", "reduce_scatter",
       "jit_allreduce", "shared allreduce", "adasum")
# In-place allreduces of pieces of a node-shared array (NOTE [shared arrays] in
# comm/algorithms/shared.py): one slot per operation that can be in flight at once, each piece
# at most this long.
SHARED_SLOT_BYTES = 4 * 1_000_003 + 64
_PATTERN_PERIOD = 13


class _Expect:
    """One issued operation: its handle (or, when sync, its result), and what it must produce:
    ``wants[k]`` in ``targets[k]`` (the arrays reduced in place), or in the result itself when
    ``targets`` is None (a want of None: the result is None)."""

    def __init__(self, what: str, handle, targets: list | None, wants: list[np.ndarray]) -> None:
        self.what, self.handle, self.targets, self.wants = what, handle, targets, wants

    def finish(self, sync: bool = False) -> None:
        result = self.handle if sync else self.handle.wait()
        for got, want in zip(self.targets or [result], self.wants, strict=True):
            _same(got, want, self.what)


def _values(pattern: np.ndarray, n: int, shift: float, dtype: str, as_torch: bool):
    """pattern[:n] + shift as ``dtype``, a NumPy array or a torch tensor (bfloat16: torch)."""
    base = pattern[:n] + np.float32(shift)
    if dtype == "bfloat16":
        return torch.from_numpy(base).bfloat16()
    arr = base.astype(dtype)
    return torch.from_numpy(arr) if as_torch else arr


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return np.asarray(x)


def _same(got, want: np.ndarray | None, what: str) -> None:
    if want is None:  # a gather's result off its root
        assert got is None, f"{what}: expected None off the root, got {type(got).__name__}"
        return
    got = _numpy(got).reshape(-1).astype(want.dtype, copy=False)
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"{what}: element {bad} is {got[bad]}, expected {want[bad]}")


def run(group: comm.Group, seed: int, n_ops: int, max_bytes: int = 64 * MIB, outstanding: int = 8) -> int:
    """Issue ``n_ops`` collectives on ``group`` (every rank the same schedule) and check each.
    Returns the number of operations run."""
    r, p = group.rank, group.size
    sizes = [s for s in SIZES if s <= max_bytes]
    pattern = (np.arange(max(sizes) // 4 + 1) % _PATTERN_PERIOD).astype(np.float32)
    rng = np.random.default_rng(seed)
    inflight: deque[_Expect] = deque()
    done = 0
    slots = outstanding + 2
    region = group.shared_array(slots * SHARED_SLOT_BYTES)
    for i in range(n_ops):
        kind = OPS[rng.integers(len(OPS))]
        nbytes = int(sizes[rng.integers(len(sizes))])
        if kind in ("allgather", "gather"):
            nbytes = min(nbytes, 4 * MIB)  # p copies come back
        if kind == "shared allreduce":
            nbytes = min(nbytes, SHARED_SLOT_BYTES - 64)
        if kind == "adasum":
            if p & (p - 1):  # a power of two of ranks only (every rank draws the same p)
                kind = "allreduce"
            nbytes = min(nbytes, 16 * MIB)
        n = nbytes // 4
        small = nbytes <= MIB
        dtype = ("float32", "int64", "bfloat16")[rng.integers(3)] if small else "float32"
        as_torch = bool(rng.integers(2))
        async_op = bool(rng.integers(2))
        if rng.integers(4) == 0:  # sync here, async there: a local choice, the same collective
            async_op = async_op != bool(r % 2)
        shift = float(rng.integers(5))
        what = f"op {i}: {kind} of {n} {dtype} ({'torch' if as_torch else 'numpy'}, " \
               f"{'async' if async_op else 'sync'}) at {p} ranks"
        everyone = pattern[:n] * p + np.float32(p * shift + p * (p - 1) / 2)
        if kind == "allreduce":
            op = ("sum", "avg", "max")[rng.integers(3)]
            x = _values(pattern, n, shift + r, dtype, as_torch)
            want = {"sum": everyone, "avg": everyone / p,
                    "max": pattern[:n] + np.float32(shift + p - 1)}[op]
            if dtype == "int64" and op == "avg":
                want = np.floor(want)
            expect = _Expect(what, comm.allreduce(x, op, async_op=async_op, group=group), [x], [want])
        elif kind == "broadcast":
            root = int(rng.integers(p))
            x = _values(pattern, n, shift + (r if r != root else 100), dtype, as_torch)
            want = pattern[:n] + np.float32(shift + 100)
            expect = _Expect(what, comm.broadcast(x, root, async_op=async_op, group=group), [x], [want])
        elif kind == "allgather":
            x = _values(pattern, n, shift + r, dtype, as_torch)
            want = np.concatenate([pattern[:n] + np.float32(shift + q) for q in range(p)])
            expect = _Expect(what, comm.allgather(x, async_op=async_op, group=group), None, [want])
        elif kind == "gather":
            root = int(rng.integers(p))
            x = _values(pattern, n, shift + r, dtype, as_torch)
            want = np.concatenate([pattern[:n] + np.float32(shift + q) for q in range(p)])
            expect = _Expect(what, comm.gather(x, root, async_op=async_op, group=group), None,
                             [want if r == root else None])
        elif kind == "reduce_scatter":
            x = _values(pattern, n, shift + r, dtype, as_torch)
            want = np.array_split(everyone, p)[r]
            expect = _Expect(what, comm.reduce_scatter(x, "sum", async_op=async_op, group=group), None,
                             [want])
        elif kind == "shared allreduce":  # a piece of the shared array, where every rank has it
            at = int(i % slots * SHARED_SLOT_BYTES + 4 * rng.integers(16))
            x = np.empty(n, np.float32) if region is None else region[at:at + 4 * n].view(np.float32)
            x[:] = pattern[:n] + np.float32(shift + r)
            if as_torch:
                x = torch.from_numpy(x)
            expect = _Expect(what + " (shared)", comm.allreduce(x, "sum", async_op=async_op, group=group),
                             [x], [everyone])
        elif kind == "adasum":
            # Three tensors, each rank's nonzero only where the index is its rank modulo p: the
            # vectors are orthogonal, so every coefficient is exactly 1 and the result is exactly
            # their sum, each element its owner's value (comm/algorithms/adasum.py).
            cuts = sorted(int(c) for c in rng.integers(0, n + 1, 2))
            parts = [(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], n)]
            full = pattern[:n] + np.float32(shift)
            mine = np.where(np.arange(n) % p == r, full, np.float32(0))
            wide = "float64" if dtype == "int64" else dtype
            ts = [_values(mine[a:b], b - a, 0.0, wide, as_torch) for a, b in parts]
            expect = _Expect(what, comm.adasum_allreduce(ts, async_op=async_op, group=group), ts,
                             [full[a:b] for a, b in parts])
        else:  # jit_allreduce of a bucket: three tensors of the drawn total size
            cuts = sorted(int(c) for c in rng.integers(0, n + 1, 2))
            parts = [(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], n)]
            ts = [torch.from_numpy(pattern[a:b] + np.float32(shift + r)) for a, b in parts]
            wants = [everyone[a:b] / p for a, b in parts]
            expect = _Expect(what, comm.jit_allreduce(ts, "avg", async_op=async_op, group=group), ts, wants)
        if async_op:
            inflight.append(expect)
            while len(inflight) > outstanding:
                inflight.popleft().finish()
        else:
            # A sync call returns after every earlier async call completed (issue order).
            while inflight:
                assert inflight[0].handle.done(), f"{inflight[0].what} not done after later sync {what}"
                inflight.popleft().finish()
            expect.finish(sync=True)
        done += 1
    while inflight:
        inflight.popleft().finish()
    if region is not None:
        group.release_shared(region)
    return done


def groups_under_test(world: comm.Group) -> dict[str, comm.Group]:
    """The world, a split into halves (pairs at 4 ranks, single ranks at 2) and a duplicate."""
    return {"world": world, "split": world.split(world.rank % 2), "duplicate": world.split(0)}


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-mib", type=int, default=256)
    args = ap.parse_args()
    world = comm.init(timeout=120)
    SIZES.append(256 * MIB)
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    total, rounds, rss = 0, 0, []
    groups = groups_under_test(world)
    while True:
        for name, g in groups.items():
            total += run(g, seed=rounds, n_ops=200 if name == "world" else 50, max_bytes=args.max_mib * MIB)
        rounds += 1
        rss.append(_rss_mib())
        # Every rank stops after the same round: agree on it.
        stop = np.array([time.monotonic() > deadline], np.int32)
        comm.allreduce(stop, "max")
        if world.rank == 0:
            print(f"soak: round {rounds}, {total} operations, {time.monotonic() - start:.0f}s, "
                  f"resident {rss[-1]:.0f} MiB", flush=True)
        if stop[0]:
            break
    # The first rounds grow the resident set by what every path keeps once it has run (staging
    # buffers, the allocator's arenas, sizes drawn for the first time); a leak keeps growing.
    # So the growth that counts is over the second half of the rounds.
    half = rss[len(rss) // 2]
    summary = np.array([total, rss[0], half, rss[-1], max_rss_mib()], np.float64)
    every = comm.allgather(summary)
    for g in groups.values():
        if g is not world:
            g.close()
    if world.rank == 0:
        for q, (ops, first, middle, last, peak) in enumerate(every):
            print(f"soak: rank {q}: {int(ops)} operations in {rounds} rounds, resident after round 1 "
                  f"{first:.0f} MiB, after round {len(rss) // 2 + 1} {middle:.0f} MiB, at the end "
                  f"{last:.0f} MiB (growth over the second half {last - middle:+.0f} MiB), "
                  f"peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
