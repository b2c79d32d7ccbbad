"""What a small message costs between two machines: a TCP stream's round trip (the floor), our
TCP ring (NOTE [a ring over TCP] in terrapipe/comm/transports/tcp.py) and Gloo, side by side.

    python -m benchmarks.link_latency --link 1gbit [--rounds 7]   # as root

Starts two emulated nodes of one rank each (``terrapipe.testing.cluster``) under torchrun. Per
size (4 KiB .. 256 KiB of float32), interleaved, each round starting with the next case:

- ``ping-pong``: a round trip of the message over one of the ring's TCP streams (rank 0 sends,
  rank 1 sends it back): the link's floor for an exchange.
- ``tcp ring allreduce``: ``TcpTransport.allreduce_array`` between the two ranks (one exchange of
  the message, then one reduction).
- ``gloo allreduce``: ``torch.distributed.all_reduce`` over Gloo between the same two ranks.

A sample is rank 0's time per call over a batch; reported: medians and Gloo / ring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import format_table, save

CASES = ("ping-pong", "tcp ring allreduce", "gloo allreduce")


def _worker(out: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from terrapipe.comm import StoreComm
    from terrapipe.comm.transports.tcp import TcpTransport
    from terrapipe.kernels import reduce as kreduce

    dist.init_process_group("gloo")
    r = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    ring = TcpTransport(StoreComm(store, "latency", r, 2, 60), 60)
    streams = ring.ring_comm
    samples: dict[str, dict[str, list[float]]] = {c: {} for c in CASES}
    for nbytes in (4 << 10, 16 << 10, 64 << 10, 256 << 10):
        a = np.ones(nbytes // 4, np.float32)
        t = torch.from_numpy(a)
        reps = 200 if nbytes <= 64 << 10 else 50

        def run(case: str, a=a, t=t) -> None:
            if case == "ping-pong":
                if r == 0:
                    ring.wait(streams.Isend(a, 1), "ping", 1)
                    ring.wait(streams.Irecv(a, 1), "pong", 1)
                else:
                    ring.wait(streams.Irecv(a, 0), "ping", 0)
                    ring.wait(streams.Isend(a, 0), "pong", 0)
            elif case == "tcp ring allreduce":
                ring.allreduce_array(a, kreduce.SUM, 0, "allreduce")
            else:
                dist.all_reduce(t)

        for k in range(rounds + 1):  # round 0 warms up
            for case in CASES[k % 3:] + CASES[:k % 3]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    run(case)
                if k:
                    samples[case].setdefault(str(nbytes), []).append((time.perf_counter() - start) / reps)
    if r == 0:
        Path(out).write_text(json.dumps(samples))
    ring.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.rounds)
        return
    from terrapipe.testing.cluster import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        with Cluster(2, args.link) as c:
            code = c.run([sys.executable, "-m", "benchmarks.link_latency", "--worker", out, "--rounds",
                          str(args.rounds)], ranks_per_node=1, launcher="torchrun", timeout=1200)
        if code != 0 or not Path(out).exists():
            sys.exit(f"benchmark failed (exit code {code})")
        samples = json.loads(Path(out).read_text())
    rows, records = [], []
    for key in samples["ping-pong"]:
        med = {c: statistics.median(samples[c][key]) for c in CASES}
        ratio = statistics.median(g / t for g, t in zip(samples["gloo allreduce"][key],
                                                        samples["tcp ring allreduce"][key], strict=True))
        rows.append([f"{int(key) >> 10} KiB", *(f"{1e6 * med[c]:.0f}" for c in CASES), f"{ratio:.1f}x"])
        records.append({"bytes": int(key), "seconds": med, "gloo_over_ring": ratio,
                        "samples_s": {c: samples[c][key] for c in CASES}})
    print(f"\n2 emulated nodes x 1 rank, {args.link} links, median of {args.rounds} interleaved rounds "
          f"(us per call, rank 0)")
    print(format_table(["size", *(f"{c} us" for c in CASES), "gloo / ring"], rows))
    for f in save(f"link_latency_2x1_{args.link}", {"nodes": 2, "link": args.link, "records": records}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
