"""Allreduce bandwidth: terrapipe vs MPI (mpi4py + MPICH) vs torch.distributed Gloo.

    python -m benchmarks.allreduce -n 2 [--max-mib 256] [--rounds 5] [--algorithms]
    python -m benchmarks.allreduce --cluster 2x2 --link 1gbit [--max-mib 64]   # as root

Launches ``mpiexec -n N`` itself. Every rank runs, per message size (float32, 4 KiB ..
``--max-mib``), interleaved, each round in its own order, each operand refilled
(through NumPy) right before its sample: ``comm.jit_allreduce`` of a gradient bucket (a torch
tensor in the node-shared array DistributedGradients allocates its buckets in, reduced in place:
NOTE [shared arrays] in comm/algorithms/shared.py), of a private bucket (NumPy's memory, 2 MiB pages: the
buckets where there is no shared memory) and of a plain ``torch.ones`` tensor (PyTorch's
allocator, 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1), ``comm.allreduce`` (NumPy array), our
chunked ring over MPI point-to-point (the path ``comm.allreduce`` takes between nodes and under
``backend="mpi"`` from 1 MiB), ``MPI.COMM_WORLD.Allreduce`` in place, and
``torch.distributed.all_reduce`` over Gloo, and ``comm.allreduce`` on a group over that Gloo
group (what a torchrun job's ``comm.init`` makes: across machines, shared memory on each, NOTE
[machines over Gloo] in comm/group.py), all summing in place; across emulated nodes also
``comm.allreduce`` on a group whose large parts cross the nodes over MPI with the node waiting
(``TERRAPIPE_BULK_TRANSPORT=mpi``; NOTE [overlap across nodes] in comm/algorithms/segment.py), and
on a group pinned to the segment, whose way private arrays took before they went single-copy
on each node (NOTE [single-copy allreduce] 7 in comm/algorithms/single_copy.py); and, to
show what the link costs alone, each rank's part of the message (1 / ranks per node of it)
allreduced with its peers of the same local rank on the other nodes, every pair at once as a
call's parts cross, over our TCP rings and over Gloo groups of those ranks. A
sample is the slowest rank's time for a batch of calls, and the ranks' mean CPU time per call
(every thread of the process, user and system: what the call takes from the computation beside
it). Reported: median algbw (bytes / time) and busbw (algbw x 2(p-1)/p), next to this machine's
single-thread memory-copy bandwidth (bytes copied per second, np.copyto of 64 MiB) measured in
the same run.

``--algorithms`` times instead each algorithm ``comm.allreduce`` can run on one node, pinned with
``Group.use_algorithm`` (so each pays what a selected call pays: the signature agreement, the
latency path where it applies): the shared-memory one-shot (up to its limit), single copy, the
chunked segment, the in-place one over a shared array, MPI's own allreduce and our ring (both
over the MPI transport), against MPICH's ``Allreduce`` and ``comm.allreduce`` as selected; it
prints the fastest per size, which is what NOTE [algorithm selection] in comm/select.py encodes.

``--cluster NxK --link RATE`` runs the same cases across N emulated nodes of K ranks each, joined
by links shaped to RATE (``terrapipe.testing.cluster``; needs root). The table adds each case's
share of the link's bound: per node, a ring between nodes sends and receives 2(N-1)/N of the data
over its link, so a size's time cannot be below ``2(N-1)/N * bytes / rate``.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np

from terrapipe.testing.cluster import Cluster

from .common import (
    format_table,
    link_bits_per_second,
    rank_sweep_args,
    report_from_rank0,
    round_order,
    run_ranks,
    save,
    sweep_plot,
)

CASES = ("jit_allreduce", "jit (private bucket)", "jit (torch.ones)", "comm.allreduce", "ring over MPI",
         "mpi Allreduce", "gloo all_reduce", "comm over gloo", "comm, MPI between nodes",
         "comm, segment's way", "parts alone: TCP rings", "parts alone: Gloo pairs")
ALGORITHMS = ("shm one-shot", "shm single copy", "shm chunked", "shm shared array",
              "mpi transport: MPI's own", "comm.allreduce", "mpi transport: ring", "mpi Allreduce")


def _algorithm_cases(a: np.ndarray, shared: np.ndarray | None, mpi, MPI) -> dict:
    """Each algorithm comm.allreduce can run for ``a`` (float32 sum in place), pinned; ``shared``:
    an array as long as ``a`` in the node's shared array, or None."""
    import terrapipe.comm as comm
    from terrapipe.comm.select import Request, able

    g = comm.world()
    can = able(g, Request("allreduce", a.nbytes))

    def pinned(algorithm: str | None, arr: np.ndarray):
        def call():
            g.use_algorithm("allreduce", algorithm)
            comm.allreduce(arr, "sum")
        return call

    cases = {}
    for label, algorithm in (("shm one-shot", "oneshot"), ("shm single copy", "single_copy"),
                             ("shm chunked", "segment"), ("mpi transport: MPI's own", "mpi"),
                             ("mpi transport: ring", "ring")):
        if algorithm in can:
            cases[label] = pinned(algorithm, a)
    if shared is not None:
        cases["shm shared array"] = pinned("shared", shared)
    cases["comm.allreduce"] = pinned(None, a)
    cases["mpi Allreduce"] = lambda: mpi.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
    return cases


def _worker(max_mib: int, rounds: int, algorithms: bool = False, cluster: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import terrapipe.comm as comm
    from terrapipe.comm.algorithms.ring import ring_allreduce
    from terrapipe.comm.transports.mpi import CHUNK_BYTES
    from terrapipe.engine.gradients import bucket_buffer
    from terrapipe.kernels.reduce import SUM

    comm.init()
    mpi = MPI.COMM_WORLD
    ring_comm = mpi.Dup()
    pending: list = []  # the ring's done messages (NOTE [MPI progress] in comm/algorithms/ring.py)
    scratch = np.empty(2 * CHUNK_BYTES, np.uint8)  # its receive buffers, as the MPI transport keeps
    rank, p = mpi.rank, mpi.size
    addr = socket.gethostbyname(socket.gethostname()) if cluster else "127.0.0.1"  # node 0's
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    addr, port = mpi.bcast((addr, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=p)
    # A torchrun job's group: Gloo, with shared memory on each machine across machines (NOTE
    # [machines over Gloo] in comm/group.py).
    over_gloo = comm.Group.over_torch(300.0)
    # Across nodes, the same group with its large parts crossing over MPI, the node waiting for
    # each (TERRAPIPE_BULK_TRANSPORT=mpi), beside the default (NOTE [overlap across nodes] in
    # comm/algorithms/segment.py).
    inline = segment_way = None
    if cluster:
        os.environ["TERRAPIPE_BULK_TRANSPORT"] = "mpi"
        inline = comm.Group(mpi.Dup(), 300.0)
        del os.environ["TERRAPIPE_BULK_TRANSPORT"]
        segment_way = comm.Group(mpi.Dup(), 300.0)
        segment_way.use_algorithm("allreduce", "segment")
    world = comm.world()
    pair_gloo = None  # the Gloo group of this rank's local rank across the nodes
    if cluster and world.bulk is not None:
        local = mpi.allgather(world.local_rank)
        for j in sorted(set(local)):  # every rank makes every group, in the same order
            made = dist.new_group([q for q in range(p) if local[q] == j])
            if j == world.local_rank:
                pair_gloo = made

    sizes = []
    b = 4 << 10
    while b <= max_mib << 20:
        sizes.append(b)
        b *= 2 if algorithms else 4  # crossovers need the finer sweep
    region = comm.world().shared_array(sizes[-1])  # where DistributedGradients puts its buckets
    copy_src = np.ones(64 << 18, np.float32)  # 64 MiB
    copy_dst = np.empty_like(copy_src)
    copies = []
    results, cpus = {}, {}
    for nbytes in sizes:
        n = nbytes // 4
        t = torch.ones(n)
        private = bucket_buffer(n, torch.float32, torch.device("cpu")).fill_(1.0)
        bucket = private if region is None else torch.from_numpy(region[:nbytes]).view(torch.float32)
        a = np.ones(n, np.float32)
        reps = max(1, min(200, (8 << 20) // nbytes))
        fns = {
            "jit_allreduce": lambda b=bucket: comm.jit_allreduce(b, op="sum"),
            "jit (private bucket)": lambda b=private: comm.jit_allreduce(b, op="sum"),
            "jit (torch.ones)": lambda t=t: comm.jit_allreduce(t, op="sum"),
            "comm.allreduce": lambda a=a: comm.allreduce(a, "sum"),
            "ring over MPI": lambda a=a: ring_allreduce(ring_comm, a, SUM, 0,
                                                        lambda req, _w, _p: req.Wait(), pending, scratch),
            "mpi Allreduce": lambda a=a: mpi.Allreduce(MPI.IN_PLACE, a, MPI.SUM),
            "gloo all_reduce": lambda t=t: dist.all_reduce(t),
            "comm over gloo": lambda a=a: comm.allreduce(a, "sum", group=over_gloo),
        }
        if inline is not None:
            fns["comm, MPI between nodes"] = lambda a=a: comm.allreduce(a, "sum", group=inline)
            fns["comm, segment's way"] = lambda a=a: comm.allreduce(a, "sum", group=segment_way)
        if pair_gloo is not None:
            part, tpart = np.ones(n // world.local_size, np.float32), torch.ones(n // world.local_size)
            fns["parts alone: TCP rings"] = lambda x=part: world.bulk.allreduce_array(x, SUM, 0, "benchmark")
            fns["parts alone: Gloo pairs"] = lambda t=tpart: dist.all_reduce(t, group=pair_gloo)
        # The buffer each case reduces: refilled right before its sample, so that no case starts
        # with its data hotter in cache than another's.
        operand = {"jit_allreduce": bucket, "jit (private bucket)": private, "jit (torch.ones)": t,
                   "gloo all_reduce": t}
        if pair_gloo is not None:
            operand.update({"parts alone: TCP rings": part, "parts alone: Gloo pairs": tpart})
        if algorithms:
            shared = None if region is None else region[:nbytes].view(np.float32)
            fns = _algorithm_cases(a, shared, mpi, MPI)
            operand = {"shm shared array": shared}
        for fn in fns.values():
            fn()  # warm-up (compilation, connections, page faults)
        names = list(fns)
        for k in range(rounds):
            # No case always follows the same neighbour (Gloo's threads winding down, MPICH's own
            # state) or always goes first: each round in its own order (common.round_order).
            for name in round_order(names, k):
                fn = fns[name]
                # Through NumPy for tensors too: torch's fill_ runs on its OpenMP threads, which go
                # on spinning on a core beside whatever is timed next.
                x = operand.get(name, a)
                (x.numpy() if isinstance(x, torch.Tensor) else x).fill(1.0)
                mpi.Barrier()
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    fn()
                dt = (time.perf_counter() - start) / reps
                cpu = (time.process_time() - cpu) / reps  # every thread of the process
                dt = mpi.allreduce(dt, op=MPI.MAX)
                results.setdefault((name, nbytes), []).append(dt)
                cpus.setdefault((name, nbytes), []).append(mpi.allreduce(cpu, op=MPI.SUM) / p)
            if rank == 0:
                start = time.perf_counter()
                np.copyto(copy_dst, copy_src)
                copies.append(copy_src.nbytes / (time.perf_counter() - start) / 1e9)
            mpi.Barrier()
    over_gloo.close()
    if inline is not None:
        inline.close()
        segment_way.close()
    dist.destroy_process_group()
    mpi.Barrier()
    if rank == 0:
        report_from_rank0({"p": p, "copy_gbs": copies,
                           "samples": [[k[0], k[1], v] for k, v in results.items()],
                           "cpu": [[k[0], k[1], v] for k, v in cpus.items()]})


def main(argv: list[str] | None = None) -> None:
    args = rank_sweep_args(__doc__, argv, algorithms=True, cluster=True)
    if args.worker:
        _worker(args.max_mib, args.rounds, args.algorithms, args.cluster is not None)
        return
    worker_args = (["--max-mib", str(args.max_mib), "--rounds", str(args.rounds)]
                   + (["--algorithms"] if args.algorithms else []))
    if args.cluster is not None:
        nodes, per_node = args.cluster
        with Cluster(nodes, args.link) as c:
            data = run_ranks("benchmarks.allreduce", nodes * per_node, worker_args + ["--cluster", "x"],
                             launcher=c.mpiexec_args(per_node))
    else:
        data = run_ranks("benchmarks.allreduce", args.n, worker_args)
    if args.algorithms:
        _report_algorithms(data, args)
        return
    nranks = data["p"]
    copy = statistics.median(data["copy_gbs"])
    med = {(c, b): statistics.median(v) for c, b, v in data["samples"]}
    cpu = {(c, b): statistics.median(v) for c, b, v in data["cpu"]}
    sizes = sorted({b for _, b, _ in data["samples"]})
    factor = 2 * (nranks - 1) / nranks
    bound = None
    if args.cluster is not None and args.link not in (None, "none"):
        nodes, rate = args.cluster[0], link_bits_per_second(args.link)

        def bound(b: int) -> float:  # seconds: a ring between nodes over each node's link
            return 2 * (nodes - 1) / nodes * b * 8 / rate
    rows, records = [], []
    cases = [c for c in CASES if (c, sizes[0]) in med]
    short = {"comm.allreduce": "comm", "mpi Allreduce": "mpi", "gloo all_reduce": "gloo",
             "comm, MPI between nodes": "comm-mpi", "comm, segment's way": "comm-seg",
             "parts alone: TCP rings": "parts-tcp", "parts alone: Gloo pairs": "parts-gloo"}
    cpu_cases = [c for c in short if c in cases]
    for b in sizes:
        row = [_size(b)]
        for c in cases:
            algbw = b / med[(c, b)] / 1e9
            row.append(f"{algbw:.2f}/{algbw * factor:.2f}")
            records.append({"case": c, "bytes": b, "seconds": med[(c, b)], "algbw": algbw,
                            "busbw": algbw * factor, "cpu_seconds_per_rank": cpu[(c, b)],
                            "samples_s": next(v for cc, bb, v in data["samples"] if cc == c and bb == b)})
        row.append(f"{1e6 * med[('comm.allreduce', b)]:.0f}/{1e6 * med[('mpi Allreduce', b)]:.0f}")
        row.append(f"{med[('gloo all_reduce', b)] / med[('jit_allreduce', b)]:.1f}x/"
                   f"{med[('mpi Allreduce', b)] / med[('jit_allreduce', b)]:.1f}x")
        row.append(f"{med[('gloo all_reduce', b)] / med[('comm over gloo', b)]:.2f}x")
        row.append("/".join(f"{1e3 * cpu[(c, b)]:.3g}" for c in cpu_cases))
        if bound is not None:
            row.append("/".join(f"{bound(b) / med[(c, b)]:.0%}" for c in
                                ("comm.allreduce", "mpi Allreduce", "gloo all_reduce", "comm over gloo",
                                 "comm, MPI between nodes", "comm, segment's way")))
        rows.append(row)
    where = f"{nranks} ranks" if args.cluster is None else \
        f"{args.cluster[0]} emulated nodes x {args.cluster[1]} ranks, {args.link} links"
    print(f"\n{where}, float32 sum in place, median of {args.rounds} interleaved rounds;"
          f" algbw/busbw in GB/s; single-thread memcpy {copy:.1f} GB/s (bytes copied per second)")
    extra = ["of link bound comm/mpi/gloo/comm-gloo/comm-mpi/comm-seg"] if bound is not None else []
    cpu_head = "cpu ms/rank " + "/".join(short[c] for c in cpu_cases)
    heads = ["size", *cases, "us comm/mpi", "jit vs gloo/mpi", "comm-gloo vs gloo", cpu_head, *extra]
    print(format_table(heads, rows))
    result = {"ranks": nranks, "copy_gbs": copy, "records": records}
    if args.cluster is not None:
        result.update(nodes=args.cluster[0], ranks_per_node=args.cluster[1], link=args.link)

    def plot():
        busbw = {c: [next(r["busbw"] for r in records if r["case"] == c and r["bytes"] == b) for b in sizes]
                 for c in cases}
        return sweep_plot(sizes, busbw, "busbw GB/s", f"allreduce, {nranks} ranks",
                          ceiling=(copy, "memcpy (1 thread)"))

    name = f"allreduce_n{nranks}" if args.cluster is None else \
        f"allreduce_cluster_{args.cluster[0]}x{args.cluster[1]}_{args.link}"
    for f in save(name, result, plot):
        print(f"wrote {f}")


def _report_algorithms(data: dict, args) -> None:
    nranks = data["p"]
    med = {(c, b): statistics.median(v) for c, b, v in data["samples"]}
    sizes = sorted({b for _, b, _ in data["samples"]})
    rows, records = [], []
    ours = [c for c in ALGORITHMS if c not in ("comm.allreduce", "mpi Allreduce")]
    for b in sizes:
        row = [_size(b)]
        for c in ALGORITHMS:
            t = med.get((c, b))
            row.append("-" if t is None else f"{1e6 * t:.0f}")
            if t is not None:
                records.append({"case": c, "bytes": b, "seconds": t, "algbw": b / t / 1e9})
        best = min((c for c in ours if (c, b) in med), key=lambda c: med[(c, b)])
        row += [best, f"{med[('mpi Allreduce', b)] / med[('comm.allreduce', b)]:.2f}x"]
        rows.append(row)
    print(f"\n{nranks} ranks, float32 sum in place, microseconds per call (median of {args.rounds} "
          "interleaved rounds), each path forced; 'fastest' among ours")
    print(format_table(["size", *ALGORITHMS, "fastest", "comm vs MPICH"], rows))
    for f in save(f"allreduce_algorithms_n{nranks}", {"ranks": nranks, "records": records}):
        print(f"wrote {f}")


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


if __name__ == "__main__":
    main()
