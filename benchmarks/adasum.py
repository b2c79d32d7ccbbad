"""Adasum across ranks: comm.adasum_allreduce (vector halving, distance doubling: NOTE [adasum
by halves]) against the average it replaces and against Adasum done the obvious way, in one run.

    python -m benchmarks.adasum -n 2 [--max-mib 64] [--rounds 5]

Cases, interleaved per size (float32, every rank its own values):

* ``adasum``: ``comm.adasum_allreduce(x)``, what ``hvd.allreduce(op=hvd.Adasum)`` runs, and its
  two ways forced: ``halves`` (vector halving) and ``one_gather`` (one allgather, then the
  whole tree on every rank), which set the crossover ``GATHER_BYTES`` (NOTE [adasum by
  halves] 8);
* ``average``: ``comm.allreduce(x, "avg")``, the reduction Adasum takes the place of. Adasum
  moves the same bytes (a reduce-scatter, then an allgather: 2 (n - 1) / n of the message a
  rank) plus a few small allgathers of dot products a level, and reads each element three times
  a level (its dot product and norms, then the scaled sum), so this is its floor;
* ``gathered``: every rank's vector allgathered, then the tree of pairwise Adasums computed in
  NumPy on every rank (what one writes without the halving: n times the message a rank, and the
  whole tree's arithmetic on every rank).

A sample is the slowest rank's mean over ``--steps`` calls; reported: medians, GB/s of the
message, and the median of each round's ratios (drift between rounds cancels out of those).
"""

from __future__ import annotations

import statistics

from .common import (
    format_table,
    interleave_ranks,
    rank_sweep_args,
    report_from_rank0,
    save,
    sweep_over_ranks,
)

CASES = ("adasum", "halves", "one_gather", "average", "gathered")


def _gathered(comm, x):
    import numpy as np

    xs = [v.astype(np.float64) for v in comm.allgather(x)]
    while len(xs) > 1:
        nxt = []
        for a, b in zip(xs[::2], xs[1::2], strict=True):
            d = a @ b
            nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
        xs = nxt
    x[...] = xs[0]


def _worker(max_mib: int, rounds: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import terrapipe.comm as comm
    from terrapipe.comm.algorithms import adasum as way

    selected = way.GATHER_BYTES
    comm.init()
    mpi = MPI.COMM_WORLD
    sizes = [4 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 64 << 20]
    sizes = [s for s in sizes if s <= max_mib << 20]
    results = {}
    for nbytes in sizes:
        x = np.random.default_rng(mpi.rank).normal(size=nbytes // 4).astype(np.float32)
        steps = max(2, min(200, (4 << 20) // nbytes * 4))

        def step(case, x=x):
            if case in ("adasum", "halves", "one_gather"):
                way.GATHER_BYTES = {"adasum": selected, "halves": 0, "one_gather": 1 << 40}[case]
                comm.adasum_allreduce(x)
            elif case == "average":
                comm.allreduce(x, "avg")
            else:
                _gathered(comm, x)

        for c in CASES:  # warm-up: compiles, makes the pairs' groups
            step(c)
        results[nbytes] = interleave_ranks(step, CASES, rounds, steps, mpi)
    if mpi.rank == 0:
        report_from_rank0({"p": mpi.size, "samples": {str(k): v for k, v in results.items()}})


def main(argv: list[str] | None = None) -> None:
    args = rank_sweep_args(__doc__, argv)
    data = sweep_over_ranks("benchmarks.adasum", args, _worker)
    if data is None:
        return
    rows, table = [], {}
    for size, samples in data["samples"].items():
        nbytes = int(size)
        med = {c: statistics.median(v) for c, v in samples.items()}
        per_round = {f"{c}/adasum": statistics.median(o / a for a, o in zip(samples["adasum"], samples[c],
                                                                             strict=True))
                     for c in CASES[1:]}
        table[size] = {"median_s": med, "ratios_per_round_median": per_round,
                       "gb_per_s": {c: nbytes / t / 1e9 for c, t in med.items()}}
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        rows.append([label] + [f"{1e6 * med[c]:.0f}" for c in CASES]
                    + [f"{nbytes / med['adasum'] / 1e9:.2f}", f"{per_round['average/adasum']:.2f}",
                       f"{per_round['gathered/adasum']:.2f}"])
    print(f"\n{data['p']} ranks, float32, median of {args.rounds} interleaved rounds")
    print(format_table(["size"] + [f"{c} us" for c in CASES] + ["adasum GB/s", "average/adasum",
                                                                "gathered/adasum"], rows))
    result = {"ranks": data["p"], "sizes": table, "samples_s": data["samples"]}

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [int(s) for s in table]
        for c in CASES:
            ax.plot(xs, [table[s]["gb_per_s"][c] for s in table], marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel("GB/s of the message")
        ax.set_title(f"Adasum, {data['p']} ranks (CPU)")
        ax.legend()
        return fig

    for f in save(f"adasum_n{data['p']}", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
