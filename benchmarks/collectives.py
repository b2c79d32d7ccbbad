"""The collectives besides allreduce on one node (allgather, gather, broadcast, reduce-scatter):
terrapipe vs MPI (mpi4py + MPICH) vs torch.distributed over Gloo, in one run.

    python -m benchmarks.collectives -n 2 [--max-mib 8] [--rounds 5] [--written-input]

Cases, interleaved per size (float32, every rank its own values; a gather's and a broadcast's
root rotates from case to case, alike on every rank):

* ``comm``: ``comm.allgather(x)``, ``comm.gather(x, root)``, ``comm.broadcast(x, root)``,
  ``comm.reduce_scatter(x)`` as selected: up to half a row the one-shot (NOTE [one-shot
  copies] in comm/algorithms/oneshot.py), larger ones the segment's chunks or single-copy;
* ``out``: ``comm.allgather(x, out=...)`` and ``comm.reduce_scatter(x, out=...)`` into an
  output made once, as MPI's and Gloo's cases write theirs (``comm`` makes a new result per call);
* ``segment``: the same calls pinned to the segment (``Group.use_algorithm``): the agreement's
  board step, then the chunk's (two for a reduce-scatter), which is how they ran before the
  one-shot took them;
* ``mpi``: ``Allgather`` / ``Gather`` / ``Bcast`` / ``Reduce_scatter`` on MPI.COMM_WORLD
  (MPICH's shared-memory collectives), into buffers made once;
* ``gloo``: ``dist.all_gather_single`` (``all_gather_into_tensor``) / ``dist.gather`` /
  ``dist.broadcast`` / ``dist.reduce_scatter_single`` (``reduce_scatter_tensor``) over Gloo,
  what a torch.distributed user on CPUs has.

A size is the bytes each rank sends (a reduce-scatter's whole message; Gloo's takes the first
p x (n // p) elements). ``comm``'s results are new arrays per call, ``out``'s and MPI's and
Gloo's go to buffers made once. A sample is the slowest rank's mean over the round's
calls; reported: medians and the median of each round's ratio to ``comm`` (drift between
rounds cancels out of those). The floor: an allgather's rank reads p x n bytes, a broadcast's
n and a reduce-scatter's n (its part of every rank's message), so from a few hundred KiB they
run at the speed of copying memory.

``--written-input``: every rank writes its whole input (the same values, in place) before each
call, in every case alike, as a training step writes the gradients or parameters it then
exchanges; the write alone is a case of its own (``write``), interleaved, to subtract. Without
it the input is written once, and a path that reads a peer's input straight from its memory
(single-copy) finds the peer's lines already in its own cache from the call before, which a
training step never does: `python -m benchmarks.allgather_paths` times each path with the input
unchanged and written (docs/benchmarks.md, the collectives on a Zen 3). Compare ratios of
interleaved rounds only.
"""

from __future__ import annotations

import contextlib
import socket
import statistics

from .common import (
    format_table,
    interleave_ranks,
    rank_sweep_args,
    report_from_rank0,
    save,
    sweep_over_ranks,
)

COLLS = ("allgather", "gather", "broadcast", "reduce_scatter")
WAYS = ("comm", "out", "segment", "mpi", "gloo")
OUT_COLLS = ("allgather", "reduce_scatter")  # the collectives with an ``out=``
CASES = tuple(f"{c} {w}" for c in COLLS for w in WAYS if w != "out" or c in OUT_COLLS)
SIZES = (64, 4 << 10, 64 << 10, 512 << 10, 1 << 20, 4 << 20, 8 << 20)


def _worker(max_mib: int, rounds: int, written_input: bool = False) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import terrapipe.comm as comm

    comm.init()
    mpi = MPI.COMM_WORLD
    rank, p = mpi.rank, mpi.size
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = mpi.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    # all_gather_into_tensor's new name (the old one warns)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pinned = comm.Group(mpi.Dup(), 300.0)  # the segment's way, pinned for every copy
    for c in COLLS:
        pinned.use_algorithm(c, "segment")
    results = {}
    root = [0]  # the current root, rotated between rounds alike on every rank
    for nbytes in [s for s in SIZES if s <= max_mib << 20]:
        x = np.full(nbytes // 4, rank + 1, np.float32)
        t = torch.from_numpy(x)
        out = np.empty((p, x.size), np.float32)
        tout = torch.from_numpy(out)
        flat_out = tout.view(-1)
        touts = list(tout.unbind(0))
        counts = [len(c) for c in np.array_split(x, p)]  # comm.reduce_scatter's parts
        part = np.empty(counts[rank], np.float32)
        ours_out, ours_part = np.empty((p, x.size), np.float32), np.empty(counts[rank], np.float32)
        tpart, tfull = torch.empty(x.size // p), t[:p * (x.size // p)]  # Gloo's: equal parts
        steps = max(20, min(1000, (64 << 20) // (nbytes * p)))

        def mine():
            return rank == root[0]

        calls = {
            "allgather comm": lambda x=x: comm.allgather(x),
            "allgather out": lambda x=x, o=ours_out: comm.allgather(x, out=o),
            "allgather segment": lambda x=x: comm.allgather(x, group=pinned),
            "allgather mpi": lambda x=x, out=out: mpi.Allgather(x, out),
            "allgather gloo": lambda t=t, flat=flat_out: gather_into(flat, t),
            "gather comm": lambda x=x: comm.gather(x, root[0]),
            "gather segment": lambda x=x: comm.gather(x, root[0], group=pinned),
            "gather mpi": lambda x=x, out=out: mpi.Gather(x, out if mine() else None, root=root[0]),
            "gather gloo": lambda t=t, outs=touts: dist.gather(t, outs if mine() else None, dst=root[0]),
            "broadcast comm": lambda x=x: comm.broadcast(x, root[0]),
            "broadcast segment": lambda x=x: comm.broadcast(x, root[0], group=pinned),
            "broadcast mpi": lambda x=x: mpi.Bcast(x, root=root[0]),
            "broadcast gloo": lambda t=t: dist.broadcast(t, src=root[0]),
            "reduce_scatter comm": lambda x=x: comm.reduce_scatter(x),
            "reduce_scatter out": lambda x=x, o=ours_part: comm.reduce_scatter(x, out=o),
            "reduce_scatter segment": lambda x=x: comm.reduce_scatter(x, group=pinned),
            "reduce_scatter mpi": lambda x=x, part=part, counts=counts: mpi.Reduce_scatter(x, part, counts),
            "reduce_scatter gloo": lambda t=tfull, tpart=tpart: scatter_into(tpart, t),
        }

        def write(x=x, value=rank + 1):
            x.fill(value)  # every line of the input written: as a training step leaves it

        cases = CASES
        if written_input:  # the write alone, a case interleaved with the others
            calls["write"] = lambda: None
            cases += ("write",)

        def step(case, calls=calls):
            if written_input:
                write()
            calls[case]()

        for c in CASES:  # warm-up: compiles, connects
            step(c)

        def around(case):
            root[0] = (root[0] + 1) % p
            return contextlib.nullcontext()

        results[nbytes] = interleave_ranks(step, cases, rounds, steps, mpi, around)
    pinned.close()
    dist.destroy_process_group()
    if rank == 0:
        report_from_rank0({"p": p, "samples": {str(k): v for k, v in results.items()}})


def _label(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def main(argv: list[str] | None = None) -> None:
    args = rank_sweep_args(__doc__, argv, written=True)
    data = sweep_over_ranks("benchmarks.collectives", args, _worker)
    if data is None:
        return
    table, rows = {}, []
    for size, samples in data["samples"].items():
        med = {c: statistics.median(v) for c, v in samples.items()}
        ratios = {}
        for coll in COLLS:
            ours = samples[f"{coll} comm"]
            for way in WAYS[1:]:
                theirs = samples.get(f"{coll} {way}")
                if theirs is None:
                    continue
                per_round = (o / a for a, o in zip(ours, theirs, strict=True))
                ratios[f"{coll} {way}/comm"] = statistics.median(per_round)
        table[size] = {"median_s": med, "ratios_per_round_median": ratios}
        for coll in COLLS:
            rows.append([_label(int(size)), coll]
                        + [f"{1e6 * med[f'{coll} {w}']:.1f}" if f"{coll} {w}" in med else "-" for w in WAYS]
                        + [f"{ratios[f'{coll} {w}/comm']:.2f}" if f"{coll} {w}/comm" in ratios else "-"
                           for w in WAYS[1:]])
    written = " (inputs written before each call, in every case)" if args.written_input else ""
    print(f"\n{data['p']} ranks on one node, float32, median of {args.rounds} interleaved rounds{written}")
    print(format_table(["size", "collective"] + [f"{w} us" for w in WAYS] + [f"{w}/comm" for w in WAYS[1:]],
                       rows))
    result = {"ranks": data["p"], "written_input": args.written_input, "sizes": table,
              "samples_s": data["samples"]}
    if args.written_input:
        writes = {size: 1e6 * statistics.median(got["write"]) for size, got in data["samples"].items()}
        print("the write alone, us: " + ", ".join(f"{_label(int(k))} {v:.1f}" for k, v in writes.items()))

    def plot():
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(COLLS), figsize=(14, 3.5), sharey=True)
        xs = [int(s) for s in table]
        for ax, coll in zip(axes, COLLS, strict=True):
            for way in WAYS:
                if f"{coll} {way}" not in data["samples"][next(iter(table))]:
                    continue
                us = [1e6 * table[s]["median_s"][f"{coll} {way}"] for s in table]
                ax.plot(xs, us, marker="o", label=way)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("bytes a rank sends")
            ax.set_title(f"{coll}, {data['p']} ranks")
        axes[0].set_ylabel("us per call")
        axes[0].legend()
        return fig

    for f in save(f"collectives{'_written' if args.written_input else ''}_n{data['p']}", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
