"""The parameter server: terrapipe.ps against a parameter server on torch.distributed.rpc, and the
asynchronous training modes against synchronous data parallelism with one slowed rank.

    python -m benchmarks.ps -n 2 [--rounds 5] [--sizes 4096,1048576,67108864] [--train-rounds 3]
    python -m benchmarks.ps --cluster 2x1 --link 1gbit --train-rounds 0     # as root

Throughput. Every rank holds one shard of a float32 tensor and every rank pushes ("add") or
pulls the whole tensor at once, waiting for each call: a sample is the slowest rank's mean time
per call, the cases interleaved in every round. Cases:
  ``tp``      terrapipe.ps on one node (each rank applies to the shards in shared memory);
  ``tp-wire`` terrapipe.ps with one emulated node per rank (every shard behind its owner's
              wire thread, over its TCP connections: the path between nodes, on one host);
  ``rpc``     the pattern of PyTorch's parameter-server tutorial, sharded the same way: each rank
              owns a shard object and serves ``rpc_async`` calls that add (under the shard's lock)
              or return a copy (TensorPipe backend, the default).
Reported per size: GB/s per rank (tensor bytes / time per call), requests/s per rank, and the
ratios tp/rpc and tp-wire/rpc. The physical limit on one node is memory bandwidth: a push reads
the source and reads and writes the shard (3 passes), a pull reads the shard and writes the
destination (2 passes), over p ranks sharing the node's bandwidth.

``--cluster NxK --link RATE`` runs the throughput cases across N emulated nodes of K ranks
(``terrapipe.testing.cluster``; needs root): ``tp`` then crosses the links (its own TCP
connections between nodes, shared memory within one), ``rpc`` rendezvouses at node 0's address
and moves everything over TCP (TensorPipe's ``uv`` transport: its shared-memory and
cross-memory-attach paths would go around the emulated link, one kernel serving every node),
and the table adds each case's share of the link's bound: a push or a pull of the whole tensor
by every rank moves K(N-1)/N of it over each node's link, each way.

Time to loss. A 3-layer MLP on a synthetic regression; the last rank is made 2x slower (it
sleeps as long as its step took). Modes, interleaved per round: ``sync`` (terrapipe.engine's
DistributedOptimizer: what a user picks for data parallelism), ``downpour`` (n_push=1,
n_pull=1), ``easgd`` (tau=2), ``averaging`` (every 4 steps). A sample is the seconds until rank
0's model reaches the target loss on held-out data; the table gives medians and each mode's
speed-up over sync (> 1 is sooner).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from .common import format_table, link_bits_per_second, report_from_rank0, run_ranks, save

SIZES = (4096, 1 << 20, 64 << 20)
THROUGHPUT_CASES = ("tp", "tp-wire", "rpc")
MODES = ("sync", "downpour", "easgd", "averaging")
TARGET_LOSS = 0.02

# -- the torch.distributed.rpc parameter server ------------------------------------------------
_RPC_SHARDS: dict = {}


def _rpc_add(name: str, x):
    shard, lock = _RPC_SHARDS[name]
    with lock:
        shard.add_(x)


def _rpc_get(name: str):
    shard, lock = _RPC_SHARDS[name]
    with lock:
        return shard.clone()


class RpcShardedTensor:
    """A float32 tensor sharded over the RPC workers ``w0..w{p-1}`` as terrapipe.ps shards it."""

    def __init__(self, name: str, numel: int, rank: int, p: int) -> None:
        import torch

        self.name, self.p = name, p
        self.bounds = [numel * r // p for r in range(p + 1)]
        n = self.bounds[rank + 1] - self.bounds[rank]
        _RPC_SHARDS[name] = (torch.zeros(n), threading.Lock())

    def push(self, x) -> None:
        from torch.distributed import rpc

        futs = [rpc.rpc_async(f"w{r}", _rpc_add, args=(self.name, x[self.bounds[r]:self.bounds[r + 1]]))
                for r in range(self.p)]
        for f in futs:
            f.wait()

    def pull(self, out) -> None:
        from torch.distributed import rpc

        futs = [rpc.rpc_async(f"w{r}", _rpc_get, args=(self.name,)) for r in range(self.p)]
        for r, f in enumerate(futs):
            out[self.bounds[r]:self.bounds[r + 1]].copy_(f.wait())


# -- workers -------------------------------------------------------------------------------------
def _throughput(mpi, rounds: int, sizes: list[int], cluster: bool) -> dict:
    import socket

    import numpy as np
    import torch
    from mpi4py import MPI
    from torch.distributed import rpc

    from terrapipe import ps
    from terrapipe.comm import Group

    addr = socket.gethostbyname(socket.gethostname()) if cluster else "127.0.0.1"
    port = mpi.bcast((addr, _free_port(addr)) if mpi.rank == 0 else None, root=0)
    # Across emulated nodes TensorPipe would take its shared-memory and cross-memory-attach
    # paths (one kernel, one pid namespace) around the link: TCP only, as between machines.
    wire = dict(_transports=["uv"], _channels=["basic"]) if cluster else {}
    rpc.init_rpc(f"w{mpi.rank}", rank=mpi.rank, world_size=mpi.size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://{port[0]}:{port[1]}", num_worker_threads=8, rpc_timeout=600,
                     **wire))
    groups = {"tp": Group(mpi.Dup(), 300)}
    if not cluster:  # across nodes, "tp" is already the path between them
        groups["tp-wire"] = Group(mpi.Dup(), 300, node_size=1)
    result = {}
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.ones(n)
        out = torch.empty(n)
        tensors = {c: ps.ShardedTensor(torch.zeros(n), g) for c, g in groups.items()}
        tensors["rpc"] = RpcShardedTensor(f"t{nbytes}", n, mpi.rank, mpi.size)
        mpi.Barrier()  # every rank's RPC shard exists before anyone calls it
        calls = {}
        for c, t in tensors.items():
            if c == "rpc":
                calls[f"{c} push"] = lambda t=t, x=x: t.push(x)
                calls[f"{c} pull"] = lambda t=t, out=out: t.pull(out)
            else:
                calls[f"{c} push"] = lambda t=t, x=x: t.push(x).wait()
                calls[f"{c} pull"] = lambda t=t, out=out: t.pull(out).wait()
        for fn in calls.values():  # warm-up
            fn()
        mpi.Barrier()
        reps = max(1, min(200, (32 << 20) // nbytes))  # about 32 MiB per rank per sample
        samples: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds):
            for k, fn in calls.items():
                mpi.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                took = np.array([(time.perf_counter() - t0) / reps])
                mpi.Allreduce(MPI.IN_PLACE, took, op=MPI.MAX)
                samples[k].append(float(took[0]))
        result[nbytes] = samples
        mpi.Barrier()
        for c in groups:
            tensors[c].close()
    rpc.shutdown()
    for g in groups.values():
        g.close()
    return result


def _free_port(addr: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _time_to_loss(mpi, rounds: int, max_seconds: float) -> dict:
    import numpy as np
    import torch
    from torch import nn

    import terrapipe.comm as comm
    from terrapipe import ps
    from terrapipe.engine import DistributedOptimizer

    comm.init()
    torch.set_num_threads(1)
    rank, p = mpi.rank, mpi.size
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)  # one teacher for every rank (torch seeds each process differently)
    teacher = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
    for prm in teacher.parameters():
        prm.requires_grad_(False)
    xs = torch.randn(8192, 64, generator=torch.Generator().manual_seed(10 + rank))
    ys = teacher(xs)
    xv = torch.randn(2048, 64, generator=gen)
    yv = teacher(xv)
    slow = rank == p - 1

    def run(mode: str) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 1))
        sgd = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        opt = {"sync": lambda: DistributedOptimizer(sgd, model),
               "downpour": lambda: ps.Downpour(sgd, n_push=1, n_pull=1),
               "easgd": lambda: ps.EASGD(sgd, tau=2),
               "averaging": lambda: ps.ModelAveraging(sgd, k=4)}[mode]()
        flag = ps.ShardedTensor(np.zeros(1, np.int64))
        stop = np.zeros(1, np.int64)
        seen = flag.pull(stop)
        mpi.Barrier()
        began = time.perf_counter()
        reached = float("nan")
        step = 0
        while True:
            t0 = time.perf_counter()
            i = (step * 64) % 8192
            opt.zero_grad()
            nn.functional.mse_loss(model(xs[i:i + 64]), ys[i:i + 64]).backward()
            opt.step()
            if slow:
                time.sleep(time.perf_counter() - t0)  # this rank takes twice as long
            step += 1
            if rank == 0 and step % 10 == 0:
                with torch.no_grad():
                    loss = nn.functional.mse_loss(model(xv), yv).item()
                if loss < TARGET_LOSS or time.perf_counter() - began > max_seconds:
                    reached = time.perf_counter() - began if loss < TARGET_LOSS else float("inf")
                    flag.push(np.ones(1, np.int64), "copy").wait()
            if mode in ("sync", "averaging"):
                # Synchronous modes stop on one step everywhere: every rank takes the flag
                # at the same step (what a synchronous job does with its stopping rule).
                if step % 10 == 0:
                    mpi.Barrier()
                    if int(flag.pull().wait()[0]):
                        break
            elif seen.done():
                if int(seen.wait()[0]):
                    break
                seen = flag.pull(stop)
        if mode != "sync":
            opt.consolidate()
            opt.close()
        flag.close()
        return mpi.bcast(reached, root=0)

    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:
        run(m)  # warm-up
    for _ in range(rounds):
        for m in MODES:
            samples[m].append(run(m))
    return samples


def _worker(rounds: int, sizes: list[int], train_rounds: int, cluster: bool) -> None:
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    payload = {"p": mpi.size}
    if sizes:
        payload["throughput"] = _throughput(mpi, rounds, sizes, cluster)
    if train_rounds:
        payload["time_to_loss"] = _time_to_loss(mpi, train_rounds, max_seconds=60.0)
    if mpi.rank == 0:
        report_from_rank0(payload)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes; empty: skip")
    parser.add_argument("--train-rounds", type=int, default=3, help="0: skip time to loss")
    parser.add_argument("--cluster", default=None, metavar="NxK",
                        help="N emulated nodes of K ranks (needs root); 'x' inside one")
    parser.add_argument("--link", default="1gbit", help="the emulated links' rate (tc syntax)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.worker:
        _worker(args.rounds, sizes, args.train_rounds, args.cluster is not None)
        return
    worker_args = ["--rounds", str(args.rounds), "--sizes", args.sizes,
                   "--train-rounds", str(args.train_rounds)]
    nodes = per_node = 0
    if args.cluster is not None:
        from terrapipe.testing.cluster import Cluster

        nodes, per_node = (int(v) for v in args.cluster.lower().split("x"))
        with Cluster(nodes, args.link) as c:
            data = run_ranks("benchmarks.ps", nodes * per_node, worker_args + ["--cluster", "x"],
                             env={"OMP_NUM_THREADS": "1"}, launcher=c.mpiexec_args(per_node))
    else:
        data = run_ranks("benchmarks.ps", args.n, worker_args, env={"OMP_NUM_THREADS": "1"})
    p = data["p"]
    result: dict = {"ranks": p}
    if nodes:
        result.update(nodes=nodes, ranks_per_node=per_node, link=args.link)
        rate = link_bits_per_second(args.link)

        def bound(b: int) -> float:  # seconds: every rank's whole tensor, K(N-1)/N of it per link
            return per_node * (nodes - 1) / nodes * b * 8 / rate
    if "throughput" in data:
        rows, table = [], {}
        for nbytes, samples in data["throughput"].items():
            med = {k: statistics.median(v) for k, v in samples.items()}
            table[nbytes] = med
            for op in ("push", "pull"):
                rpc = med[f"rpc {op}"]
                for c in THROUGHPUT_CASES:
                    if f"{c} {op}" not in med:
                        continue
                    t = med[f"{c} {op}"]
                    rows.append([_size(int(nbytes)), op, c, f"{int(nbytes) / t / 1e9:.3f}",
                                 f"{1 / t:.0f}", f"{rpc / t:.2f}"]
                                + ([f"{bound(int(nbytes)) / t:.0%}"] if nodes else []))
        where = f"{p} ranks" if not nodes else f"{nodes} emulated nodes x {per_node} ranks, {args.link} links"
        print(f"\n{where}: push/pull of the whole tensor by every rank at once, median of "
              f"{args.rounds} interleaved rounds (slowest rank)")
        print(format_table(["size", "op", "case", "GB/s per rank", "requests/s", "x rpc",
                            *(["of link bound"] if nodes else [])], rows))
        result["throughput_median_s"] = table
    if "time_to_loss" in data:
        samples = data["time_to_loss"]
        med = {m: statistics.median(v) for m, v in samples.items()}
        rows = [[m, f"{med[m]:.2f}", f"{min(samples[m]):.2f}", f"{max(samples[m]):.2f}",
                 f"{med['sync'] / med[m]:.2f}"] for m in MODES]
        print(f"\ntime to validation loss {TARGET_LOSS} (s), rank {p - 1} 2x slower, "
              f"{args.train_rounds} interleaved rounds")
        print(format_table(["mode", "median", "min", "max", "speed-up vs sync"], rows))
        result["time_to_loss_s"] = samples

    def plot():
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        if "throughput_median_s" in result:
            sizes_b = [int(s) for s in result["throughput_median_s"]]
            for c in THROUGHPUT_CASES:
                if not any(f"{c} push" in m for m in result["throughput_median_s"].values()):
                    continue
                for op, style in (("push", "-o"), ("pull", "--s")):
                    axes[0].plot(sizes_b, [b / result["throughput_median_s"][str(b) if str(b) in
                                 result["throughput_median_s"] else b][f"{c} {op}"] / 1e9
                                 for b in sizes_b], style, label=f"{c} {op}")
            axes[0].set_xscale("log", base=2)
            axes[0].set_yscale("log")
            axes[0].set_xlabel("tensor bytes")
            axes[0].set_ylabel("GB/s per rank")
            axes[0].legend(fontsize=7)
        if "time_to_loss_s" in result:
            axes[1].bar(list(MODES), [statistics.median(result["time_to_loss_s"][m]) for m in MODES])
            axes[1].set_ylabel(f"seconds to loss {TARGET_LOSS}")
            axes[1].set_title(f"rank {p - 1} 2x slower")
        fig.suptitle(f"terrapipe.ps, {p} ranks")
        return fig

    name = f"ps_n{p}" if not nodes else f"ps_cluster_{nodes}x{per_node}_{args.link}"
    for f in save(name, result, plot):
        print(f"wrote {f}")


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


if __name__ == "__main__":
    main()
