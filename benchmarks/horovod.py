"""Horovod's synthetic benchmark on the CPU: terrapipe.horovod vs terrapipe's own engine vs torch
DDP (Gloo), alternating in one run.

    python -m benchmarks.horovod -n 2 [--rounds 5] [--steps 5] [--batch-size 16] [--image-size 64]

The protocol of Horovod's pytorch_synthetic_benchmark.py: a ResNet-18 (11.7M parameters, 47 MB
of float32 gradients) on a fixed random batch per rank, SGD, warm-up steps first, then timed
iterations; img/s per rank with its spread (1.96 standard deviations over the rounds). One torch
thread per rank (2 cores here). Cases, each ``--steps`` steps per round, interleaved:
``engine`` (terrapipe.engine.DistributedOptimizer), ``horovod`` (terrapipe.horovod's
DistributedOptimizer: the same buckets, issued through Horovod's name negotiation), ``ddp``
(DistributedDataParallel over Gloo). A sample is the slowest rank's mean step time. Reported:
medians and the ratios horovod/engine and horovod/ddp (img/s; > 1 is faster), of the medians and
as the median of each round's ratio (drift between rounds cancels out of those).
"""

from __future__ import annotations

import argparse
import statistics

from .common import format_table, interleave_ranks, report_from_rank0, run_ranks, save

CASES = ("engine", "horovod", "ddp")


def _worker(rounds: int, steps: int, batch: int, size: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI

    import terrapipe.comm as comm
    import terrapipe.distributed
    import terrapipe.horovod as hvd
    from terrapipe.engine import DistributedOptimizer

    from .models import resnet

    torch.set_num_threads(1)
    comm.init()
    hvd.init()
    mpi = MPI.COMM_WORLD
    terrapipe.distributed.init_process_group("gloo", mpi_comm=mpi)
    models = {}
    for c in CASES:
        torch.manual_seed(0)
        models[c] = resnet(18)[0]
    models["ddp"] = torch.nn.parallel.DistributedDataParallel(models["ddp"])
    opts = {
        "engine": DistributedOptimizer(torch.optim.SGD(models["engine"].parameters(), lr=0.01),
                                       models["engine"]),
        "horovod": hvd.DistributedOptimizer(torch.optim.SGD(models["horovod"].parameters(), lr=0.01),
                                            named_parameters=models["horovod"].named_parameters()),
        "ddp": torch.optim.SGD(models["ddp"].parameters(), lr=0.01),
    }
    hvd.broadcast_parameters(models["horovod"].state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(mpi.rank)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)

    def step(case):
        opts[case].zero_grad()
        F.cross_entropy(models[case](x), y).backward()
        opts[case].step()

    for c in CASES:  # warm-up
        for _ in range(2):
            step(c)
    samples = interleave_ranks(step, CASES, rounds, steps, mpi)
    dist.destroy_process_group()
    hvd.shutdown()
    if mpi.rank == 0:
        report_from_rank0({"p": mpi.size, "samples": samples,
                           "params": sum(p.numel() for p in models["engine"].parameters())})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.rounds, args.steps, args.batch_size, args.image_size)
        return
    data = run_ranks("benchmarks.horovod", args.n,
                     ["--rounds", str(args.rounds), "--steps", str(args.steps),
                      "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)],
                     env={"OMP_NUM_THREADS": "1"})
    b = args.batch_size
    rate = {c: [b / s for s in v] for c, v in data["samples"].items()}  # img/s per rank
    med = {c: statistics.median(v) for c, v in rate.items()}
    rows = []
    for c in CASES:
        spread = 1.96 * statistics.stdev(rate[c]) if len(rate[c]) > 1 else 0.0
        rows.append([c, f"{med[c]:.1f} +- {spread:.1f}", f"{med[c] * data['p']:.1f}",
                     f"{1e3 * statistics.median(data['samples'][c]):.0f}"])
    print(f"\n{data['p']} ranks, ResNet-18 ({data['params'] / 1e6:.1f}M parameters), batch {b} of "
          f"{args.image_size}x{args.image_size} per rank, median of {args.rounds} interleaved rounds x "
          f"{args.steps} steps")
    print(format_table(["case", "img/s per rank", "img/s total", "ms/step"], rows))
    ratios = {"horovod/engine": med["horovod"] / med["engine"], "horovod/ddp": med["horovod"] / med["ddp"]}
    t = data["samples"]  # per round: the same round's step times, so drift between rounds cancels
    paired = {f"horovod/{c}": statistics.median(o / h for h, o in zip(t["horovod"], t[c], strict=True))
              for c in ("engine", "ddp")}
    print("of the medians:", "  ".join(f"{k}: {v:.3f}" for k, v in ratios.items()))
    print("median of the rounds' ratios:", "  ".join(f"{k}: {v:.3f}" for k, v in paired.items()))
    result = {"ranks": data["p"], "params": data["params"], "img_per_s_per_rank_median": med,
              "samples_s": data["samples"], "ratios": ratios, "ratios_per_round_median": paired}

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(list(CASES), [med[c] for c in CASES], color=["tab:orange", "tab:green", "tab:blue"])
        ax.set_ylabel("img/s per rank")
        ax.set_title(f"ResNet-18 synthetic, {data['p']} ranks (CPU)")
        return fig

    for f in save(f"horovod_n{data['p']}", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
