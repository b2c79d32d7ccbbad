"""Allreduce of CUDA gradients: jit_allreduce's pipelined pinned staging vs what a user would
otherwise write, and NCCL where every rank has its own GPU.

    python -m benchmarks.cuda_allreduce -n 2 [--max-mib 256] [--rounds 5]

Launches ``mpiexec -n N`` itself. Per message size (float32, 1 MiB .. ``--max-mib``, as 8 tensors
of equal size like a bucket of gradients), in each round and interleaved:

* jit_allreduce: ``comm.jit_allreduce(tensors)`` on the CUDA tensors, as selected (on one node
  beyond the one-shot: staged_rows, each chunk copied by the GPU straight into and out of the
  segment's rows, NOTE [staged rows] in comm/algorithms/staged_rows.py);
* jit via segment: the same with the segment algorithm pinned (a private pinned buffer, the
  host copying chunks into the rows and back out: the path before staged_rows);
* naive staging: ``[t.cpu() ...]``, ``comm.jit_allreduce`` of those, ``t.copy_(host)`` back: the
  same reduction without pinned memory or overlap;
* copies only: the pinned download and upload of the same bytes with no reduction (the floor of
  any CPU-staged allreduce on this machine);
* host only: ``comm.jit_allreduce`` of the same bytes already in pinned host memory: the
  reduction alone, no copy (the other floor: staging can hide the copies behind it, not it);
* nccl: ``comm.allreduce`` of one flat CUDA tensor on NCCL (only with a GPU per rank).

A sample is the slowest rank's time for a batch of calls ending in ``torch.cuda.synchronize()``.
Reported: median algbw (bytes / time) per case, jit_allreduce's speed-up over naive staging and
over the segment's way, and its rate as a fraction of the copies alone.
Needs a CUDA device; without one it says so and exits.
"""

from __future__ import annotations

import statistics
import sys
import time

from .common import format_table, rank_sweep_args, report_from_rank0, run_ranks, save, sweep_plot

CASES = ("jit_allreduce", "jit via segment", "naive staging", "copies only", "host only", "nccl")
# Cases that run with an algorithm pinned (Group.use_algorithm), set before each timed batch.
PINNED = {"jit via segment": "segment"}


def _worker(max_mib: int, rounds: int) -> None:
    import torch
    from mpi4py import MPI

    import terrapipe.comm as comm

    g = comm.init()
    mpi = MPI.COMM_WORLD
    p = mpi.size
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", comm.local_rank() % ngpu)
    torch.cuda.set_device(dev)
    nccl_ok = ngpu >= comm.local_size()
    sizes = []
    b = 1 << 20
    while b <= max_mib << 20:
        sizes.append(b)
        b *= 4
    results: dict = {}
    for nbytes in sizes:
        n = nbytes // 4 // 8
        ts = [torch.ones(n, device=dev) for _ in range(8)]
        flat = torch.ones(8 * n, device=dev)
        pinned = torch.empty(8 * n, pin_memory=True)

        def naive(ts=ts):
            host = [t.cpu() for t in ts]
            comm.jit_allreduce(host, op="sum")
            for t, h in zip(ts, host, strict=True):
                t.copy_(h)

        def copies(ts=ts, pinned=pinned, n=n):
            for i, t in enumerate(ts):
                pinned[i * n:(i + 1) * n].copy_(t, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            for i, t in enumerate(ts):
                t.copy_(pinned[i * n:(i + 1) * n], non_blocking=True)

        hosts = [pinned[i * n:(i + 1) * n] for i in range(8)]
        fns = {"jit_allreduce": lambda ts=ts: comm.jit_allreduce(ts, op="sum"),
               "jit via segment": lambda ts=ts: comm.jit_allreduce(ts, op="sum"),
               "naive staging": naive, "copies only": copies,
               "host only": lambda hosts=hosts: comm.jit_allreduce(hosts, op="sum")}
        if nccl_ok:
            fns["nccl"] = lambda flat=flat: comm.allreduce(flat, "sum")
        reps = max(1, min(50, (64 << 20) // nbytes))
        for name, fn in fns.items():
            g.use_algorithm("allreduce", PINNED.get(name))
            fn()  # warm-up: compilation, pinned buffers, NCCL set-up
        g.use_algorithm("allreduce", None)
        torch.cuda.synchronize()
        for _ in range(rounds):
            for name, fn in fns.items():
                for t in ts:
                    t.fill_(1.0)
                flat.fill_(1.0)
                g.use_algorithm("allreduce", PINNED.get(name))  # for the whole batch, untimed
                torch.cuda.synchronize()
                mpi.Barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
                dt = mpi.allreduce((time.perf_counter() - start) / reps, op=MPI.MAX)
                g.use_algorithm("allreduce", None)
                results.setdefault(name, {}).setdefault(nbytes, []).append(dt)
    if mpi.rank == 0:
        report_from_rank0({"p": p, "gpus": ngpu, "device": torch.cuda.get_device_name(dev),
                           "samples": results})


def main(argv: list[str] | None = None) -> None:
    args = rank_sweep_args(__doc__, argv)
    if args.worker:
        _worker(args.max_mib, args.rounds)
        return
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.cuda_allreduce: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing measured", file=sys.stderr)
        return
    data = run_ranks("benchmarks.cuda_allreduce", args.n,
                     ["--max-mib", str(args.max_mib), "--rounds", str(args.rounds)])
    samples = {c: {int(b): v for b, v in per.items()} for c, per in data["samples"].items()}
    cases = [c for c in CASES if c in samples]
    sizes = sorted(samples["jit_allreduce"])
    rows, records = [], []
    for b in sizes:
        med = {c: statistics.median(samples[c][b]) for c in cases}
        row = [f"{b >> 20} MiB"]
        for c in cases:
            row.append(f"{b / med[c] / 1e9:.2f}")
            records.append({"case": c, "bytes": b, "seconds": med[c], "algbw": b / med[c] / 1e9,
                            "samples_s": samples[c][b]})
        row.append(f"{med['naive staging'] / med['jit_allreduce']:.2f}x")
        row.append(f"{med['jit via segment'] / med['jit_allreduce']:.2f}x")
        row.append(f"{med['copies only'] / med['jit_allreduce']:.2f}")
        rows.append(row)
    print(f"\n{data['p']} ranks on {data['gpus']} x {data['device']}, float32 sum of 8 CUDA tensors, "
          f"median of {args.rounds} interleaved rounds; algbw in GB/s")
    print(format_table(["size", *cases, "jit vs naive", "jit vs via segment", "jit of copies"], rows))
    result = {"ranks": data["p"], "gpus": data["gpus"], "device": data["device"], "records": records}

    def plot():
        algbw = {c: [b / statistics.median(samples[c][b]) / 1e9 for b in sizes] for c in cases}
        return sweep_plot(sizes, algbw, "algbw GB/s", f"CUDA allreduce, {data['p']} ranks")

    for f in save(f"cuda_allreduce_n{data['p']}", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
