"""What a small message costs between machines: a TCP stream's round trip (the floor), our TCP
ring (NOTE [a ring over TCP] in terrapipe/comm/transports/tcp.py) both ways it can allreduce,
and Gloo, side by side.

    python -m benchmarks.link_latency --link 1gbit [--nodes 2] [--rounds 7]   # as root

Starts ``--nodes`` emulated nodes of one rank each (``terrapipe.testing.cluster``) under
torchrun. Per size (4 KiB .. 1 MiB of float32), interleaved, each round in its own order
(``common.round_order``):

- ``ping-pong`` (2 nodes only): a round trip of the message over one of the ring's TCP streams
  (rank 0 sends, rank 1 sends it back): the link's floor for an exchange.
- ``tcp as selected``: ``TcpTransport.allreduce_array`` with its default threshold
  (``TERRAPIPE_TCP_RING_BYTES``); ``tcp allgather``: always the allgather of the whole buffer and
  one reduction; ``tcp ring``: always comm/algorithms/ring.py's ring.
- ``gloo allreduce``: ``torch.distributed.all_reduce`` over Gloo among the same ranks.

A sample is the slowest rank's time per call over a batch; reported: medians and Gloo / our
ring as selected.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from .common import format_table, round_order, run_under_torchrun, save

CASES = ("ping-pong", "tcp as selected", "tcp allgather", "tcp ring", "gloo allreduce")


def _worker(out: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from terrapipe.comm import StoreComm
    from terrapipe.comm.transports.tcp import TcpTransport
    from terrapipe.kernels import reduce as kreduce

    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    ring = TcpTransport(StoreComm(store, "latency", r, n, 60), 60)
    selected = ring.ring_bytes
    streams = ring.ring_comm
    cases = CASES if n == 2 else CASES[1:]
    samples: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    for nbytes in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20):
        a = np.ones(nbytes // 4, np.float32)
        t = torch.from_numpy(a)
        reps = max(10, min(200, (16 << 20) // nbytes))

        def run(case: str, a=a, t=t) -> None:
            if case == "ping-pong":
                if r == 0:
                    ring.wait(streams.Isend(a, 1), "ping", 1)
                    ring.wait(streams.Irecv(a, 1), "pong", 1)
                else:
                    ring.wait(streams.Irecv(a, 0), "ping", 0)
                    ring.wait(streams.Isend(a, 0), "pong", 0)
            elif case == "gloo allreduce":
                dist.all_reduce(t)
            else:
                ring.ring_bytes = {"tcp as selected": selected, "tcp allgather": 1 << 62, "tcp ring": 0}[case]
                ring.allreduce_array(a, kreduce.SUM, 0, "allreduce")

        for k in range(rounds + 1):  # round 0 warms up
            for case in round_order(cases, k):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(reps):
                    run(case)
                dt = torch.tensor([(time.perf_counter() - start) / reps])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if k:
                    samples[case].setdefault(str(nbytes), []).append(float(dt[0]))
    if r == 0:
        Path(out).write_text(json.dumps({"ring_bytes": selected, "samples": samples}))
    ring.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes, one rank each")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.rounds)
        return
    data = run_under_torchrun("benchmarks.link_latency", args.nodes, 1, args.link,
                              ["--rounds", str(args.rounds)], 1800)
    samples = data["samples"]
    cases = [c for c in CASES if c in samples]
    rows, records = [], []
    for key in samples["tcp as selected"]:
        med = {c: statistics.median(samples[c][key]) for c in cases}
        ratio = statistics.median(g / t for g, t in zip(samples["gloo allreduce"][key],
                                                        samples["tcp as selected"][key], strict=True))
        rows.append([f"{int(key) >> 10} KiB", *(f"{1e6 * med[c]:.0f}" for c in cases), f"{ratio:.1f}x"])
        records.append({"bytes": int(key), "seconds": med, "gloo_over_selected": ratio,
                        "samples_s": {c: samples[c][key] for c in cases}})
    print(f"\n{args.nodes} emulated nodes x 1 rank, {args.link} links, median of {args.rounds} interleaved "
          f"rounds (us per call, slowest rank; ring threshold {data['ring_bytes']} bytes)")
    print(format_table(["size", *(f"{c} us" for c in cases), "gloo / selected"], rows))
    for f in save(f"link_latency_{args.nodes}x1_{args.link}", {"nodes": args.nodes, "link": args.link,
                                                             "ring_bytes": data["ring_bytes"],
                                                             "records": records}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
