"""torch DDP over backend="terrapipe" vs backend="gloo" vs no communication, same model and data.

    python -m benchmarks.ddp -n 2 [--params 1 10 100] [--rounds 5] [--steps 3] [--store] [--detail]

Launches ``mpiexec -n N``; the ranks rendezvous over ``tcp://`` as torch does, with the default
group on the "terrapipe" backend and a Gloo group of the same ranks beside it. ``--store``: the
terrapipe group is the one torchrun's ranks get (shared memory set up through torch's store, no
MPI: ``TERRAPIPE_COMM_BACKEND=shm``) instead of the one over MPI. For each model
size (an MLP 1024 -> h -> h -> 1024 -> 10 with h chosen for about ``--params`` million
parameters), every rank trains on its own batch of 64 with one torch thread, and each round runs
``--steps`` SGD steps of each case, interleaved: ``none`` (the same model without DDP: the
floor), ``terrapipe`` (DDP on the terrapipe group), ``gloo`` (DDP on the Gloo group); DDP's
default 25 MB buckets both times. ``--detail`` adds ``ddp floor`` (DDP with a comm hook that
communicates nothing: DDP's own copies and hooks, what any backend pays) and ``terrapipe (no
single copy)`` (a second terrapipe group made with ``TERRAPIPE_CMA=0``: NOTE [single-copy
allreduce] in comm/algorithms/single_copy.py) and ``terrapipe (spin waits)`` (one made with
``TERRAPIPE_WAIT=spin``:
waiting ranks poll and yield instead of sleeping, NOTE [sleeping on a counter] in
kernels/sync.py). A sample is the slowest rank's mean step time. Reported per size:
median step time, the communication overhead t - t_none in ms and as a share of the step
(t - t_none) / t, and terrapipe's over Gloo's for both. Then the latency of ``dist.all_reduce``
of 4 KiB (float32) on each group, alternating, median of many calls.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from .common import format_table, interleave_ranks, report_from_rank0, run_ranks, save

CASES = ("none", "terrapipe", "gloo")
DETAIL = ("ddp floor", "terrapipe (no single copy)", "terrapipe (spin waits)")


def _hidden_for(million: float) -> int:
    # params = h^2 + 2 * 1024 * h + (1024 * 10 + biases) ~ solve h^2 + 2048 h = P
    p = million * 1e6
    return max(16, int((-2048 + math.sqrt(2048**2 + 4 * p)) / 2))


def _mlp(hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _no_communication(state, bucket):
    """A DDP comm hook that communicates nothing: the bucket, as it is, at once."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _worker(params: list[float], rounds: int, steps: int, detail: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import terrapipe.distributed

    torch.set_num_threads(1)
    mpi = MPI.COMM_WORLD
    terrapipe.distributed.init_process_group("terrapipe", mpi_comm=mpi)
    gloo = dist.new_group(backend="gloo")
    cases = CASES + (DETAIL if detail else ())
    if detail:  # each setting is read when a group is made
        os.environ["TERRAPIPE_CMA"] = "0"
        no_single_copy = dist.new_group(backend="terrapipe")
        del os.environ["TERRAPIPE_CMA"]
        os.environ["TERRAPIPE_WAIT"] = "spin"
        spin_waits = dist.new_group(backend="terrapipe")
        del os.environ["TERRAPIPE_WAIT"]
    g = torch.Generator().manual_seed(mpi.rank)
    x, y = torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)

    def measure(hidden: int) -> dict:
        models = {"none": _mlp(hidden), "terrapipe": DDP(_mlp(hidden)),
                  "gloo": DDP(_mlp(hidden), process_group=gloo)}
        if detail:
            models["ddp floor"] = DDP(_mlp(hidden))
            models["ddp floor"].register_comm_hook(None, _no_communication)
            models["terrapipe (no single copy)"] = DDP(_mlp(hidden), process_group=no_single_copy)
            models["terrapipe (spin waits)"] = DDP(_mlp(hidden), process_group=spin_waits)
        opts = {c: torch.optim.SGD(m.parameters(), lr=0.01) for c, m in models.items()}

        def step(case):
            opts[case].zero_grad()
            F.cross_entropy(models[case](x), y).backward()
            opts[case].step()

        for c in cases:  # warm-up: buffers, connections, DDP's first-iteration broadcasts
            step(c)
            step(c)
        samples = interleave_ranks(step, cases, rounds, steps, mpi)
        return {"params": sum(p.numel() for p in models["none"].parameters()), "samples": samples}

    sizes = [measure(_hidden_for(million)) for million in params]
    lat = {"terrapipe": [], "gloo": []}
    t = torch.zeros(1024)
    for grp in (None, gloo):  # warm-up
        for _ in range(20):
            dist.all_reduce(t, group=grp)
    for _ in range(15):
        for name, grp in (("terrapipe", None), ("gloo", gloo)):
            mpi.Barrier()
            start = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(t, group=grp)
            lat[name].append(mpi.allreduce((time.perf_counter() - start) / 200, op=MPI.MAX))
    dist.destroy_process_group()
    if mpi.rank == 0:
        report_from_rank0({"p": mpi.size, "sizes": sizes, "latency_4k": lat})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--params", type=float, nargs="+", default=[1, 10, 100], help="millions of parameters")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--store", action="store_true", help="the terrapipe group torchrun's ranks get")
    p.add_argument("--detail", action="store_true",
                   help="also DDP's floor, and terrapipe without single copy and with spin waits")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.params, args.rounds, args.steps, args.detail)
        return
    flags = ["--params", *map(str, args.params), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    flags += ["--detail"] if args.detail else []
    env = {"OMP_NUM_THREADS": "1"} | ({"TERRAPIPE_COMM_BACKEND": "shm"} if args.store else {})
    data = run_ranks("benchmarks.ddp", args.n, flags, env=env)
    rows = []
    for size in data["sizes"]:
        cases = list(size["samples"])
        med = {c: statistics.median(v) for c, v in size["samples"].items()}
        over_ms = {c: 1e3 * (med[c] - med["none"]) for c in cases}
        over = {c: (med[c] - med["none"]) / med[c] for c in cases}
        for c in cases:
            s = size["samples"][c]
            ratio = ""
            if c.startswith("terrapipe") and over["gloo"] > 0:
                ratio = f"{over_ms[c] / over_ms['gloo']:.2f} / {over[c] / over['gloo']:.2f}"
            rows.append([f"{size['params'] / 1e6:.1f}M", c, f"{1e3 * med[c]:.1f}", f"{1e3 * min(s):.1f}",
                         f"{1e3 * max(s):.1f}", f"{over_ms[c]:.1f}" if c != "none" else "-",
                         f"{100 * over[c]:.0f}%" if c != "none" else "-", ratio])
        size["median_s"], size["overhead"], size["overhead_ms"] = med, over, over_ms
    group = "store-made (as under torchrun)" if args.store else "over MPI"
    print(f"\n{data['p']} ranks, batch 64 per rank, one torch thread per rank, median of {args.rounds} "
          f"interleaved rounds x {args.steps} steps; terrapipe group {group}")
    print(format_table(["params", "case", "ms/step", "min", "max", "overhead ms", "overhead share",
                        "terrapipe/gloo (ms / share)"], rows))
    lat = {k: statistics.median(v) for k, v in data["latency_4k"].items()}
    print(f"\ndist.all_reduce of 4 KiB: terrapipe {1e6 * lat['terrapipe']:.1f} us, "
          f"gloo {1e6 * lat['gloo']:.1f} us (median of {len(data['latency_4k']['gloo'])} x 200 calls; "
          f"gloo / terrapipe {lat['gloo'] / lat['terrapipe']:.2f}x)")
    data["latency_median_s"] = lat

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [s["params"] / 1e6 for s in data["sizes"]]
        for c in ("terrapipe", "gloo"):
            ax.plot(xs, [100 * s["overhead"][c] for s in data["sizes"]], marker="o", label=c)
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel("communication overhead, % of step")
        ax.legend()
        ax.grid(alpha=0.3)
        return fig

    for f in save(f"ddp_n{data['p']}" + ("_store" if args.store else ""), data, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
