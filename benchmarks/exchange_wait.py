"""What an exchange's wait costs between machines: sleeping in ``poll`` at once against polling
first, the way NOTE [a ring's schedule in compiled code] 11 (comm/transports/tcp_native.py)
waits.

    python -m benchmarks.exchange_wait --link 1gbit [--calls 200] [--rounds 3]   # as root

Starts 4 emulated machines of one rank each (``terrapipe.testing.cluster``) under torchrun, so
every allreduce below the TCP one-shot's limit is one exchange by recursive doubling over TCP
(NOTE [one-shot across nodes] 13 in comm/algorithms/oneshot_nodes.py), pinned. Per size (4 /
16 / 32 KiB of float32) and round, in each round's order (``common.round_order``), ``--calls``
allreduces for each of:

- the rounds' form: ``whole`` (every round carries the whole payload) or ``halves``
  (reduce-scatter then allgather by halves, NOTE [a ring's schedule in compiled code] 10),
  pinned through the transport's halving threshold;
- the wait: polling ``spin`` microseconds before sleeping (0: sleep at once, as before; the
  shipped ``tcp_native.EXCHANGE_SPIN_NS``; and in between), set on the streams' state.

Each call is timed on rank 0; reported per case and size: the median and p90 in us, and the
polls that slept per call (``S_POLLS`` of the call's last round).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .common import format_table, round_order, run_under_torchrun, save

SIZES_KIB = (4, 16, 32)
FORMS = ("whole", "halves")


def _spins_us() -> tuple[int, ...]:
    from terrapipe.comm.transports import tcp_native

    return (0, 50, tcp_native.EXCHANGE_SPIN_NS // 1000)


def _worker(out: str, calls: int, rounds: int) -> None:
    import terrapipe.comm as comm
    from terrapipe.comm.transports import tcp_native

    g = comm.init(timeout=120)
    cross = g.shm.cross
    assert cross.name == "tcp" and cross.doubling, (cross.name, cross.doubling)
    st = cross.ring_comm.st
    shipped = (cross.halving_bytes, int(st[tcp_native.S_SPIN_NS]))
    cases = [(form, spin) for form in FORMS for spin in _spins_us()]
    times = {f"{f} {s}": {k: [] for k in SIZES_KIB} for f, s in cases}
    slept = {f"{f} {s}": {k: 0 for k in SIZES_KIB} for f, s in cases}
    log = g.record_algorithms()
    g.use_algorithm("allreduce", "oneshot_nodes")
    for r in range(rounds):
        for kib in SIZES_KIB:
            x = np.ones(kib * 256, np.float32)
            for form, spin in round_order(cases, r * len(SIZES_KIB) + kib):
                name = f"{form} {spin}"
                cross.set_halving_bytes(0 if form == "whole" else 1)
                st[tcp_native.S_SPIN_NS] = spin * 1000
                for _ in range(10):  # warm, and the path checked
                    comm.allreduce(x, "sum")
                assert {a for _, a, _ in log} == {"oneshot_nodes"}, (name, kib, log[-3:])
                del log[:]
                for _ in range(calls):
                    t = time.perf_counter()
                    comm.allreduce(x, "sum")
                    times[name][kib].append(time.perf_counter() - t)
                    slept[name][kib] += int(st[tcp_native.S_POLLS])
                del log[:]
    g.use_algorithm("allreduce", None)
    cross.set_halving_bytes(shipped[0])
    st[tcp_native.S_SPIN_NS] = shipped[1]
    if g.rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "slept": slept, "halving_bytes": shipped[0], "spin_ns": shipped[1]}, f)
    comm.finalize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="1gbit", help="each node's link rate (tc's units)")
    p.add_argument("--calls", type=int, default=200, help="allreduces per case, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.calls, args.rounds)
        return
    data = run_under_torchrun("benchmarks.exchange_wait", 4, 1, args.link,
                              ["--calls", str(args.calls), "--rounds", str(args.rounds)], 1800)
    rows, records = [], []
    for kib in SIZES_KIB:
        for name in data["times"]:
            us = 1e6 * np.array(data["times"][name][str(kib)])
            form, spin = name.split()
            rec = {"kib": kib, "form": form, "spin_us": int(spin), "median_us": float(np.median(us)),
                   "p90_us": float(np.percentile(us, 90)), "calls": int(us.size),
                   "slept_per_call": data["slept"][name][str(kib)] / us.size}
            records.append(rec)
            rows.append([f"{kib} KiB", form, spin, f"{rec['median_us']:.1f}", f"{rec['p90_us']:.1f}",
                         f"{rec['slept_per_call']:.2f}"])
    print(f"\n4 emulated machines x 1 rank under torchrun, {args.link} links: {args.rounds} rounds x "
          f"{args.calls} calls a case and size, rank 0 (the group measured halving from "
          f"{data['halving_bytes']} bytes; shipped spin {data['spin_ns'] // 1000} us)")
    print(format_table(["size", "rounds", "spin us", "median us", "p90 us", "slept / call"], rows))
    payload = {"link": args.link, "calls": args.calls, "rounds": args.rounds,
               "halving_bytes": data["halving_bytes"], "records": records}
    for f in save(f"exchange_wait_4x1_{args.link}", payload):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
