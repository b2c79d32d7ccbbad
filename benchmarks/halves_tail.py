"""The tail of recursive doubling by halves over TCP above its limit: why the one-shot among four
machines or more stops at ``ONESHOT_DOUBLING_TCP_BYTES`` (comm/algorithms/oneshot_nodes.py).

    python -m benchmarks.halves_tail --link 1gbit [--calls 300] [--rounds 3] [--quickack-routes]   # as root

Starts 4 emulated machines of one rank each (``terrapipe.testing.cluster``) under torchrun. Per
size (64 / 128 / 256 KiB of float32) and round, in each round's order (``common.round_order``),
``--calls`` allreduces:

- ``halves``: the one-shot across nodes (pinned, its limit raised past the size), whose
  recursive doubling reduce-scatters and allgathers by halves (NOTE [a ring's schedule in
  compiled code] 10 in comm/transports/tcp_native.py);
- ``ring``: the TCP ring (pinned), what sizes above the limit take as shipped.

Each call is timed on rank 0; reported per case and size: the median, p90, p99 and the largest
call, the calls over 5 ms, and rank 0's tail-loss probes over the case's calls (``TcpExt
TCPLossProbes`` of its node's /proc/net/netstat). ``--quickack-routes`` first sets each node's
route to ``quickack`` (every ACK sent at once), which shows whether the tail is delayed ACKs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np

from .common import format_table, round_order, run_under_torchrun, save

CASES = ("halves", "ring")
PINNED = {"halves": "oneshot_nodes", "ring": "tcp"}  # Group.use_algorithm, per case
SIZES_KIB = (64, 128, 256)


def _loss_probes() -> int:
    """This node's TCP tail-loss probes so far (/proc/net/netstat is the network namespace's)."""
    with open("/proc/net/netstat") as f:
        names, values = [ln.split() for ln in f if ln.startswith("TcpExt:")][:2]
    return int(values[names.index("TCPLossProbes")])


def _worker(out: str, calls: int, rounds: int, quickack: bool) -> None:
    import terrapipe.comm as comm
    from terrapipe.comm.algorithms import oneshot_nodes

    if quickack:
        route = subprocess.run(["ip", "route", "show", "dev", "eth0"], capture_output=True, text=True,
                               check=True).stdout.splitlines()[0].split()
        subprocess.run(["ip", "route", "change", *route, "dev", "eth0", "quickack", "1"], check=True)
    shipped = oneshot_nodes.ONESHOT_DOUBLING_TCP_BYTES
    oneshot_nodes.ONESHOT_DOUBLING_TCP_BYTES = 4 << 20  # the one-shot may take every size here
    g = comm.init(timeout=120)
    log = g.record_algorithms()
    times = {c: {k: [] for k in SIZES_KIB} for c in CASES}
    probes = {c: {k: 0 for k in SIZES_KIB} for c in CASES}
    for r in range(rounds):
        for kib in SIZES_KIB:
            x = np.ones(kib * 256, np.float32)
            for case in round_order(CASES, r * len(SIZES_KIB) + kib):
                want = PINNED[case]
                g.use_algorithm("allreduce", want)
                for _ in range(10):  # warm, and the path checked
                    comm.allreduce(x, "avg")
                assert {a for _, a, _ in log} == {want}, (case, kib, log[-3:])
                del log[:]
                before = _loss_probes()
                for _ in range(calls):
                    t = time.perf_counter()
                    comm.allreduce(x, "avg")
                    times[case][kib].append(time.perf_counter() - t)
                probes[case][kib] += _loss_probes() - before
                del log[:]
    g.use_algorithm("allreduce", None)
    oneshot_nodes.ONESHOT_DOUBLING_TCP_BYTES = shipped
    if g.rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "probes": probes, "shipped": shipped}, f)
    comm.finalize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--calls", type=int, default=300, help="allreduces per case, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quickack-routes", action="store_true", help="every ACK at once on every node")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.calls, args.rounds, args.quickack_routes)
        return
    extra = ["--calls", str(args.calls), "--rounds", str(args.rounds)]
    data = run_under_torchrun("benchmarks.halves_tail", 4, 1, args.link,
                              extra + (["--quickack-routes"] if args.quickack_routes else []), 1800)
    rows, records = [], []
    for kib in SIZES_KIB:
        for case in CASES:
            ms = 1e3 * np.array(data["times"][case][str(kib)])
            rec = {"kib": kib, "case": case, "median_ms": float(np.median(ms)),
                   "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99)),
                   "max_ms": float(ms.max()), "over_5ms": int((ms > 5).sum()), "calls": int(ms.size),
                   "loss_probes_rank0": data["probes"][case][str(kib)]}
            records.append(rec)
            rows.append([f"{kib} KiB", case, f"{rec['median_ms']:.3f}", f"{rec['p90_ms']:.2f}",
                         f"{rec['p99_ms']:.1f}", f"{rec['max_ms']:.1f}", str(rec["over_5ms"]),
                         str(rec["loss_probes_rank0"])])
    routes = "quickack routes" if args.quickack_routes else "default routes"
    print(f"\n4 emulated machines x 1 rank, {args.link} links, {routes}: {args.rounds} rounds x {args.calls} "
          f"calls a case and size, rank 0 (shipped limit {data['shipped'] >> 10} KiB)")
    print(format_table(["size", "case", "median ms", "p90", "p99", "max", "> 5 ms", "loss probes"], rows))
    name = f"halves_tail_4x1_{args.link}" + ("_quickack" if args.quickack_routes else "")
    for f in save(name, {"link": args.link, "quickack_routes": args.quickack_routes, "calls": args.calls,
                         "rounds": args.rounds, "records": records}):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
