"""DDP under torchrun across machines: the ``"terrapipe"`` torch.distributed backend against
``"gloo"``, in one job.

    python -m benchmarks.ddp_machines --cluster 2x2 --link 1gbit [--rounds 7]   # as root

Starts an emulated cluster (``terrapipe.testing.cluster``) and one torchrun per node; no MPI.
Every rank initialises torch.distributed with ``backend="terrapipe"`` (whose group keeps a
segment on each machine of two or more ranks and joins the machines with TCP rings, NOTE
[machines over Gloo] in terrapipe/comm/group.py) and makes a ``backend="gloo"`` group beside it,
the baseline: what the same script runs on with ``init_process_group("gloo")``. Interleaved,
each round starting with the next backend:

- ``dist.all_reduce`` of float32 tensors, 4 KiB .. 16 MiB, through each process group (what a
  user's script and DDP's reducer call); a sample is the slowest rank's time per call.
- A DDP training step (forward, backward with its bucketed allreduces, SGD) of an MLP whose
  gradients are ``--model-mib`` MiB, on each backend, and the same step under ``no_sync()``
  (no communication: the floor); these three in each round's own order (``common.round_order``:
  rotating three, the floor always ran right after Gloo's step). A sample is the slowest
  rank's mean step time.

Reported: medians, the median per-round ratio gloo / terrapipe, and for the allreduces each
backend's share of the link's bound (a ring between nodes sends and receives 2(N-1)/N of the
data over each node's link).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from .common import format_table, link_bits_per_second, round_order, run_under_torchrun, save

BACKENDS = ("terrapipe", "gloo")


def _mlp(mib: int):
    import torch

    width = 1024
    layers = max(1, round(mib * (1 << 20) / 4 / (width * width + width)))
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _worker(out: str, rounds: int, max_mib: int, model_mib: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("terrapipe", timeout=datetime.timedelta(seconds=300))
    r = dist.get_rank()
    g = dist.group.WORLD.group
    if g is None or g.cross is None:
        sys.exit(f"rank {r}: the terrapipe group is not joined by TCP rings (unequal machines?)")
    groups = {"terrapipe": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["gloo"])
        return float(t[0])

    samples: dict[str, dict[str, list[float]]] = {b: {} for b in (*BACKENDS, "no_sync")}
    sizes, nbytes = [], 4 << 10
    while nbytes <= max_mib << 20:
        sizes.append(nbytes)
        nbytes *= 4
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        reps = max(2, min(30, (8 << 20) // nbytes))
        for k in range(rounds + 1):  # round 0 warms up (connections, compilation, page faults)
            for b in BACKENDS[k % 2:] + BACKENDS[:k % 2]:
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(t, group=groups[b])
                dt = slowest((time.perf_counter() - start) / reps)
                if k:
                    samples[b].setdefault(str(nbytes), []).append(dt)

    torch.manual_seed(0)
    nets = {b: _mlp(model_mib) for b in BACKENDS}
    nets["gloo"].load_state_dict(nets["terrapipe"].state_dict())
    ddps = {b: torch.nn.parallel.DistributedDataParallel(nets[b], process_group=groups[b]) for b in BACKENDS}
    sgd = {b: torch.optim.SGD(ddps[b].parameters(), lr=1e-4) for b in BACKENDS}
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(r))

    def step(b: str) -> None:
        sgd[b].zero_grad()
        ddps[b](x).square().mean().backward()
        sgd[b].step()

    cases = (*BACKENDS, "no_sync")
    for k in range(rounds + 1):
        for case in round_order(cases, k):  # no_sync not always right after Gloo
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            for _ in range(steps):
                if case == "no_sync":
                    with ddps["terrapipe"].no_sync():
                        step("terrapipe")
                else:
                    step(case)
            dt = slowest((time.perf_counter() - start) / steps)
            if k:
                samples[case].setdefault("step", []).append(dt)
    if r == 0:
        params = sum(p.numel() for p in nets["terrapipe"].parameters())
        Path(out).write_text(json.dumps({"ranks": dist.get_world_size(), "nodes": g.nnodes,
                                         "local_size": g.local_size, "model_params": params,
                                         "samples": samples}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="2x2", help="NxK: N emulated nodes of K ranks")
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-mib", type=int, default=16, help="the largest allreduce")
    p.add_argument("--model-mib", type=int, default=16, help="the MLP's gradients, MiB of float32")
    p.add_argument("--steps", type=int, default=4, help="DDP steps per sample")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.rounds, args.max_mib, args.model_mib, args.steps)
        return
    nodes, per_node = (int(v) for v in args.cluster.split("x"))
    data = run_under_torchrun("benchmarks.ddp_machines", nodes, per_node, args.link,
                              ["--rounds", str(args.rounds), "--max-mib", str(args.max_mib), "--model-mib",
                               str(args.model_mib), "--steps", str(args.steps)], 3600)
    rate = link_bits_per_second(args.link)
    s = data["samples"]

    def ratio(key: str) -> float:
        return statistics.median(x / y for x, y in zip(s["gloo"][key], s["terrapipe"][key], strict=True))

    rows, records = [], []
    for key in [k for k in s["terrapipe"] if k != "step"]:
        b = int(key)
        bound = 2 * (nodes - 1) / nodes * b * 8 / rate
        med = {c: statistics.median(s[c][key]) for c in BACKENDS}
        rows.append([f"all_reduce {b >> 10} KiB", *(f"{1e3 * med[c]:.2f}" for c in BACKENDS),
                     f"{ratio(key):.2f}x",
                     "/".join(f"{bound / med[c]:.0%}" for c in BACKENDS)])
        records.append({"case": "all_reduce", "bytes": b, "seconds": med, "gloo_over_terrapipe": ratio(key),
                        "of_link_bound": {c: bound / med[c] for c in BACKENDS},
                        "samples_s": {c: s[c][key] for c in BACKENDS}})
    med = {c: statistics.median(s[c]["step"]) for c in (*BACKENDS, "no_sync")}
    mib = data["model_params"] * 4 / (1 << 20)
    rows.append([f"DDP step ({mib:.0f} MiB of gradients)", *(f"{1e3 * med[c]:.1f}" for c in BACKENDS),
                 f"{ratio('step'):.2f}x", f"no_sync {1e3 * med['no_sync']:.1f} ms"])
    records.append({"case": "ddp_step", "model_params": data["model_params"], "seconds": med,
                    "gloo_over_terrapipe": ratio("step"),
                    "samples_s": {c: s[c]["step"] for c in (*BACKENDS, "no_sync")}})
    print(f"\n{nodes} emulated nodes x {per_node} ranks under torchrun, {args.link} links, median of "
          f"{args.rounds} interleaved rounds (ms, slowest rank)")
    print(format_table(["case", "terrapipe ms", "gloo ms", "gloo/terrapipe", "of link bound / floor"], rows))
    for f in save(f"ddp_machines_{nodes}x{per_node}_{args.link}",
                  {"nodes": nodes, "ranks_per_node": per_node, "link": args.link, "model_mib": args.model_mib,
                   "steps": args.steps, "records": records}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
