"""Allreduce of a torchrun job across machines: terrapipe's paths over Gloo against Gloo's own,
through the same group, and torch.distributed's all_reduce alone.

    python -m benchmarks.gloo_machines --cluster 2x2 --link 1gbit [--rounds 7]   # as root
    python -m benchmarks.gloo_machines --cluster 1x2                              # one machine

Starts an emulated cluster (``terrapipe.testing.cluster``) and one torchrun per node. Every
rank's ``comm.init`` makes a group over Gloo that keeps each machine's shared memory (NOTE
[machines over Gloo] in terrapipe/comm/group.py). Per message size (float32, 4 KiB .. 16 MiB),
interleaved, each round in its own order (``common.round_order``): ``comm.allreduce`` as it
selects (the one-shot across nodes up to a row half, 2 MiB at two ranks a machine, then
single-copy or the segment: NOTE [machines over Gloo] 3), pinned to the hierarchical segment
(what it selected at every size before the one-shot ran over the rings), pinned to Gloo's own
allreduce (what the group did before it had shared memory; each pays the group's signature
agreement), and ``torch.distributed.all_reduce`` on the default group (Gloo's, no agreement). A
sample is the slowest rank's time per call over a batch. Reported: medians, the median
per-round ratios of Gloo's own through the group and of torch's own to the selected path, and
each case's share of the link's bound (a ring between nodes sends and receives 2(N-1)/N of the
data over each node's link). ``--cluster 1xK`` runs one ``torchrun --standalone`` of K ranks
on this machine instead, no links: its group is the machine's segment (NOTE [machines over
Gloo] 9), and "gloo (same group)" is what such a job's ``comm.allreduce`` ran before it was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .common import (
    format_table,
    link_bits_per_second,
    round_order,
    run_torchrun_here,
    run_under_torchrun,
    save,
)

CASES = ("selected", "segment", "gloo (same group)", "dist.all_reduce")
_PINNED = {"segment": "segment", "gloo (same group)": "gloo"}  # "selected": None, as comm chooses


def _worker(out: str, rounds: int, max_mib: int) -> None:
    import torch
    import torch.distributed as dist

    import terrapipe.comm as comm

    g = comm.init(timeout=300)
    if g.shm is None or (g.cross is None and g.nnodes > 1):
        sys.exit(f"rank {g.rank}: no shared memory tier (nodes {g.nnodes}, local size {g.local_size})")
    sizes, b = [], 4 << 10
    while b <= max_mib << 20:
        sizes.append(b)
        b *= 4
    samples: dict[str, dict[int, list[float]]] = {c: {} for c in CASES}
    for nbytes in sizes:
        a = np.ones(nbytes // 4, np.float32)
        t = torch.from_numpy(a)
        reps = max(2, min(30, (8 << 20) // nbytes))

        def run(case: str, a=a, t=t) -> None:
            if case == "dist.all_reduce":
                dist.all_reduce(t)
            else:
                comm.allreduce(a, "sum")

        for k in range(rounds + 1):  # round 0 warms up (connections, compilation, page faults)
            for case in round_order(CASES, k):
                g.use_algorithm("allreduce", _PINNED.get(case))
                a.fill(1.0)
                comm.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    run(case)
                dt = np.array([(time.perf_counter() - start) / reps])
                g.use_algorithm("allreduce", None)
                comm.allreduce(dt, "max")
                if k:
                    samples[case].setdefault(nbytes, []).append(float(dt[0]))
    if g.rank == 0:
        Path(out).write_text(json.dumps({"ranks": g.size, "nodes": g.nnodes, "local_size": g.local_size,
                                         "samples": {c: {str(b): v for b, v in s.items()}
                                                     for c, s in samples.items()}}))
    comm.finalize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="2x2", help="NxK: N emulated nodes of K ranks (K >= 2)")
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-mib", type=int, default=16)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.rounds, args.max_mib)
        return
    nodes, per_node = (int(v) for v in args.cluster.split("x"))
    worker_args = ["--rounds", str(args.rounds), "--max-mib", str(args.max_mib)]
    if nodes == 1:
        data = run_torchrun_here("benchmarks.gloo_machines", per_node, worker_args, 1800)
    else:
        data = run_under_torchrun("benchmarks.gloo_machines", nodes, per_node, args.link, worker_args, 1800)
    rate = link_bits_per_second(args.link)
    med = {c: {int(b): statistics.median(v) for b, v in s.items()} for c, s in data["samples"].items()}
    rows, records = [], []
    def over_selected(case: str, b: int) -> float:  # the median per-round ratio
        return statistics.median(x / y for x, y in zip(data["samples"][case][str(b)],
                                                       data["samples"]["selected"][str(b)], strict=True))

    for b in sorted(med["selected"]):
        bound = 2 * (nodes - 1) / nodes * b * 8 / rate  # 0 on one machine: no link to bound it
        ratios = {c: over_selected(c, b) for c in CASES[1:]}
        rows.append([f"{b >> 10} KiB", *(f"{1e3 * med[c][b]:.3f}" for c in CASES),
                     *(f"{ratios[c]:.2f}x" for c in CASES[1:]),
                     "/".join(f"{bound / med[c][b]:.0%}" for c in CASES) if nodes > 1 else "-"])
        records.append({"bytes": b, "seconds": {c: med[c][b] for c in CASES},
                        "over_selected": ratios, "of_link_bound": {c: bound / med[c][b] for c in CASES},
                        "samples_s": {c: data["samples"][c][str(b)] for c in CASES}})
    where = (f"{nodes} emulated nodes x {per_node} ranks under torchrun, {args.link} links" if nodes > 1
             else f"{per_node} ranks under torchrun --standalone on one machine")
    print(f"\n{where}, float32 sum in place, median of {args.rounds} interleaved rounds (ms per call, "
          f"slowest rank)")
    print(format_table(["size", *(f"{c} ms" for c in CASES), *(f"{c} / selected" for c in CASES[1:]),
                        "of link bound"], rows))
    link = args.link if nodes > 1 else None
    for f in save(f"gloo_machines_{nodes}x{per_node}" + (f"_{link}" if link else "_one_machine"),
                  {"nodes": nodes, "ranks_per_node": per_node, "link": link, "records": records}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
