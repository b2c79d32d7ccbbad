"""An allgather on one node by each of terrapipe's paths, pinned, and by MPICH, with the input
left as it was and with it written before every call, all in one interleave.

    python -m benchmarks.allgather_paths -n 2 [--max-mib 4] [--rounds 7]

Why: an input never written between calls flatters single-copy, which reads the peer's input
straight from its memory and then finds the peer's lines in its own cache from the call before
(NOTE [single-copy allreduce] 6 in comm/algorithms/single_copy.py). A training step writes what
it exchanges, so the thresholds between the paths are to be judged with written inputs.

Cases, per size (float32, bytes each rank sends; into an output made once): ``oneshot``,
``segment`` and ``single_copy`` (``comm.allgather`` on groups pinned to each, where the pin can
take the size: the one-shot only up to half a row) and ``mpi`` (``Allgather``), each
``unchanged`` (the input written once) and ``written`` (every rank writes its whole input, the
same values in place, before each call), and ``write`` (that write alone, to subtract). A sample
is the slowest rank's mean over the round's calls; reported: medians and the median of each
round's ratio of single-copy and MPICH to the one-shot (the segment where the one-shot cannot
take the size). On a VM the paths through shared memory may run at one of two speeds for
minutes at a time (docs/benchmarks.md), so a run is one process's view: compare ratios within
it, and run it more than once.
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

SIZES = (512 << 10, 1 << 20, 3 << 19, 2 << 20, 4 << 20)
PATHS = ("oneshot", "segment", "single_copy", "mpi")
INPUTS = ("unchanged", "written")


def _label(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _worker(max_mib: int, rounds: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import terrapipe.comm as comm

    g = comm.init()
    mpi = MPI.COMM_WORLD
    rank, p = mpi.rank, mpi.size
    pinned = {}
    for path in PATHS[:-1]:
        pinned[path] = g.split(0)
        pinned[path].use_algorithm("allgather", path)
    results = {}
    for nbytes in [s for s in SIZES if s <= max_mib << 20]:
        x = np.full(nbytes // 4, rank + 1, np.float32)
        out = np.empty((p, x.size), np.float32)
        calls = {"mpi": lambda x=x, out=out: mpi.Allgather(x, out)}
        for path, grp in pinned.items():
            try:  # every rank selects alike, so every rank skips alike
                comm.allgather(x, out=out, group=grp)
            except comm.CommError:
                continue
            calls[path] = lambda x=x, out=out, grp=grp: comm.allgather(x, out=out, group=grp)

        def write(x=x, value=rank + 1):
            x.fill(value)  # every line of the input written: as a training step leaves it

        steps = max(10, min(200, (32 << 20) // (nbytes * p)))
        cases = tuple(f"{path} {how}" for path in PATHS if path in calls for how in INPUTS) + ("write",)

        def step(case, calls=calls, write=write):
            if case == "write":
                write()
                return
            path, how = case.split()
            if how == "written":
                write()
            calls[path]()

        for c in cases:  # warm-up: compiles, connects
            step(c)
        results[nbytes] = interleave_ranks(step, cases, rounds, steps, mpi)
        if not np.all(out == (np.arange(p, dtype=np.float32) + 1)[:, None]):
            raise AssertionError(f"allgather of {nbytes} bytes: wrong result on rank {rank}")
    for grp in pinned.values():
        grp.close()
    if rank == 0:
        report_from_rank0({"p": p, "samples": {str(k): v for k, v in results.items()}})


def main(argv: list[str] | None = None) -> None:
    args = rank_sweep_args(__doc__, argv)
    data = sweep_over_ranks("benchmarks.allgather_paths", args, _worker)
    if data is None:
        return
    table, rows = {}, []
    for size, samples in data["samples"].items():
        med = {c: statistics.median(v) for c, v in samples.items()}
        base = "oneshot" if "oneshot unchanged" in samples else "segment"
        ratios = {}
        for how in INPUTS:
            for path in ("single_copy", "mpi"):
                per_round = zip(samples[f"{base} {how}"], samples[f"{path} {how}"], strict=True)
                ratios[f"{path}/{base} {how}"] = statistics.median(t / o for o, t in per_round)
        table[size] = {"median_s": med, "ratios_per_round_median": ratios}
        for how in INPUTS:
            rows.append([_label(int(size)), how]
                        + [f"{1e6 * med[f'{p} {how}']:.0f}" if f"{p} {how}" in med else "-" for p in PATHS]
                        + [f"{ratios[f'single_copy/{base} {how}']:.2f}", f"{ratios[f'mpi/{base} {how}']:.2f}",
                           base, f"{1e6 * med['write']:.0f}"])
    print(f"\n{data['p']} ranks on one node, float32 allgather into out=, median of {args.rounds} "
          "interleaved rounds")
    print(format_table(["size", "input"] + [f"{p} us" for p in PATHS]
                       + ["single_copy/base", "mpi/base", "base", "write us"], rows))
    for f in save(f"allgather_paths_n{data['p']}", {"ranks": data["p"], "sizes": table,
                                                     "samples_s": data["samples"]}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
