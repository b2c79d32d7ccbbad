"""Training step time: terrapipe DistributedOptimizer vs torch DDP (Gloo) vs no communication.

    python -m benchmarks.train -n 2 [--rounds 5] [--steps 5] [--hidden 2048]

Launches ``mpiexec -n N``. Every rank trains the same MLP (1024 -> hidden -> hidden -> 1024 ->
10, about 8.4M parameters at hidden=2048: 34 MB of float32 gradients) on its own batch of 64, one
torch thread per rank. Each round runs ``--steps`` SGD steps of each case, interleaved:
``none`` (local steps, no communication: the floor), ``terrapipe`` (DistributedOptimizer, 25 MB
buckets averaged during backward), ``ddp`` (DistributedDataParallel over Gloo, default 25 MB
buckets). A sample is the slowest rank's mean step time. Reported: median step time, img/s, and
the communication overhead fraction (t - t_none) / t.
"""

from __future__ import annotations

import argparse
import statistics

from .common import format_table, interleave_ranks, report_from_rank0, run_ranks, save

CASES = ("none", "terrapipe", "ddp")


def _mlp(hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _worker(rounds: int, steps: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI

    import terrapipe.comm as comm
    import terrapipe.distributed
    from terrapipe.engine import DistributedOptimizer

    torch.set_num_threads(1)
    comm.init()
    mpi = MPI.COMM_WORLD
    terrapipe.distributed.init_process_group("gloo", mpi_comm=mpi)
    models = {c: _mlp(hidden) for c in CASES}
    models["ddp"] = torch.nn.parallel.DistributedDataParallel(models["ddp"])
    opts = {
        "none": torch.optim.SGD(models["none"].parameters(), lr=0.01),
        "terrapipe": DistributedOptimizer(torch.optim.SGD(models["terrapipe"].parameters(), lr=0.01),
                                          models["terrapipe"], bucket_mb=25),
        "ddp": torch.optim.SGD(models["ddp"].parameters(), lr=0.01),
    }
    g = torch.Generator().manual_seed(mpi.rank)
    x, y = torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)

    def step(case):
        opts[case].zero_grad()
        F.cross_entropy(models[case](x), y).backward()
        opts[case].step()

    for c in CASES:  # warm-up: compilation, buffers, connections
        step(c)
    samples = interleave_ranks(step, CASES, rounds, steps, mpi)
    dist.destroy_process_group()
    if mpi.rank == 0:
        nparams = sum(p.numel() for p in models["none"].parameters())
        report_from_rank0({"p": mpi.size, "params": nparams, "samples": samples})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.rounds, args.steps, args.hidden)
        return
    data = run_ranks("benchmarks.train", args.n,
                     ["--rounds", str(args.rounds), "--steps", str(args.steps), "--hidden", str(args.hidden)],
                     env={"OMP_NUM_THREADS": "1"})
    med = {c: statistics.median(v) for c, v in data["samples"].items()}
    rows = []
    for c in CASES:
        s = data["samples"][c]
        overhead = (med[c] - med["none"]) / med[c]
        rows.append([c, f"{1e3 * med[c]:.1f}", f"{1e3 * min(s):.1f}", f"{1e3 * max(s):.1f}",
                     f"{64 * data['p'] / med[c]:.0f}", f"{100 * overhead:.0f}%" if c != "none" else "-"])
    print(f"\n{data['p']} ranks, MLP with {data['params'] / 1e6:.1f}M parameters, batch 64 per rank, "
          f"median of {args.rounds} interleaved rounds x {args.steps} steps")
    print(format_table(["case", "ms/step", "min", "max", "img/s (all ranks)", "comm overhead"], rows))
    result = {"ranks": data["p"], "params": data["params"], "median_s": med, "samples_s": data["samples"]}

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(CASES), [1e3 * med[c] for c in CASES], color=["tab:gray", "tab:orange", "tab:blue"])
        ax.set_ylabel("ms per step")
        ax.set_title(f"training step, {data['p']} ranks")
        return fig

    for f in save(f"train_n{data['p']}", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
