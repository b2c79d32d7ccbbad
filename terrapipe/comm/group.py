"""Process groups: membership (which ranks, built over MPI, torch.distributed or a store), the
topology (nodes, ranks per node, cores), and the signature agreement every collective starts
with. How a collective runs is comm/select.py's choice of an algorithm (comm/algorithms/) over
a transport (comm/transports/); the order calls run in is comm/execution.py's.

Why one module: a group's constructors (MPI, torch.distributed, a store), its topology and
the signature agreement all describe the same object; the executor and the data paths are
elsewhere.

NOTE [machines over Gloo]
    A group over Gloo whose ranks span machines (torchrun across nodes, :meth:`Group.over_torch`;
    an elastic generation across machines, :meth:`Group.over_store_and_gloo`) keeps what each
    machine offers, as a group over MPI does:

    1. Its topology (``local_rank``, ``local_size``, ``nnodes``) comes from the machine each
       rank runs on (:func:`~terrapipe.comm.store.node_of`, exchanged over the store), not from
       launcher variables.
    2. Where every machine holds the same number of ranks, two or more, the ranks of a machine
       share a segment (``shm``, set up over the store under a prefix of this group's own) and
       the ranks of each local rank, one per machine, form a ring of TCP streams (``cross``,
       NOTE [a ring over TCP] in transports/tcp.py), set up by those ranks alone over the same
       store. Nothing is registered with torch.distributed, so a ``torch.distributed`` backend
       can build such a group too (distributed/process_group.py, with a Gloo group of its own
       for the rest: NOTE [Gloo groups of our own] in transports/gloo.py).
    3. Reductions (allreduce, reduce) run as they do between nodes under MPI (NOTE [algorithm
       selection] 2): a small allreduce is the one-shot across nodes (its agreement and data
       in one board step and one exchange around the ring, NOTE [one-shot across nodes] in
       comm/algorithms/oneshot_nodes.py), a larger one hierarchical: each machine reduces its
       parts in its segment, each local rank allreduces its part with its peers on the other
       machines over its ring (``bulk`` too: a message of several chunks has each part cross
       in the background while the machine works on the next, NOTE [overlap across nodes] in
       comm/algorithms/segment.py), and every rank copies the result out. The other
       collectives are Gloo's own, after the agreement (6).
    4. A local rank that fails on a far peer marks it lost on its machine's board, and marks
       itself waiting while it waits on other machines (NOTE [a peer lost across nodes] in
       transports/board.py): its machine's ranks raise naming that peer, not their neighbour.
    5. A split of such a group is one too (Horovod's ``hvd.init`` works on a split of the
       world): the ranks of each color make their segments and rings under the parent's prefix.
    6. The signature agreement (``control``: the segment's, with the ring as its ``cross``)
       takes two steps where a Gloo group's takes an allgather over every rank: the machine's
       signatures meet on its board, then each local rank sends its machine's table of their
       digests around its TCP ring (NOTE [agreement across nodes] in transports/shm.py, framed
       as NOTE [a ring over TCP] 8 says): every rank then holds every rank's, so a mismatch
       anywhere raises on every rank, each call described.
    7. Why TCP streams of our own between machines, where the group has Gloo: Gloo's small
       transfers take milliseconds there. At 2 nodes x 2 over emulated 1gbit links (Intel Xeon,
       2026-11-27, benchmarks.gloo_machines), a 4 KiB allreduce took 4.4 ms with Gloo groups
       between the machines and 0.80 ms over the rings (torch's own all_reduce over Gloo: 6.7),
       and 16 MiB reached 91% of the links' bound (Gloo's own: 58-63%).
    8. Machines of one rank each (4 nodes x 1 under torchrun) have no peer to share a segment
       with: the group's ranks form one ring of TCP streams (``cross``), and each rank's
       segment of one holds only its board and its rows for the agreement (6) and the one-shot
       across nodes (3), as an MPI group's nodes of one rank do; larger allreduces and reduces
       run around the ring whole (the ``tcp`` algorithm, NOTE [algorithm selection] 2), the
       other collectives are Gloo's own. Before, the agreement was an allgather of whole
       signatures around the ring and a small allreduce a second one: at 4 nodes x 1 over
       1gbit (AMD EPYC, 2 cores, 2026-12-02) 4 KiB took 684-727 us a call, where MPI's
       one-shot took 80-92.
    9. All on one machine (``torchrun --standalone``, or a split of a world whose ranks there
       all share a machine) the group is that machine's segment, as a group over MPI on one
       node is: every collective takes the one-node algorithms (NOTE [algorithm selection] 5-9),
       the agreement is the board's, and Gloo keeps only point-to-point. Before, such a world
       ran everything over Gloo: at 2 ranks a 4 KiB allreduce took 1.46 ms, where it now takes
       6 us, and 16 MiB 11.0 ms where it takes 2.6 (2-core AMD EPYC, ``python -m
       benchmarks.gloo_machines --cluster 1x2``, gloo_machines_1x2_one_machine_2026-12-04.json).
"""

from __future__ import annotations

import collections
import functools
import os
import socket

import numpy as np

from .. import settings, timeline
from . import dtypes, ops, select
from .errors import CollectiveMismatchError, CommError
from .execution import Executor, Handle
from .transports.base import Transport
from .transports.shm import SIG_WORDS, ShmTransport

__all__ = ["Group", "Handle", "forced_backend", "force_backend"]

_backend_choice: str | None = None  # comm.init(backend=...) when it named one
_machines_made = 0  # worlds over torch.distributed made by this process (NOTE [machines over Gloo])


def _bulk_over_tcp() -> bool:
    """Whether an MPI group's large parts cross nodes over TCP streams of ours
    (``TERRAPIPE_BULK_TRANSPORT``; ``auto``: unless this node has RDMA devices, where MPI's
    own transfers outrun sockets)."""
    choice = settings.get("TERRAPIPE_BULK_TRANSPORT")
    if choice == "auto":
        try:
            return not os.listdir("/sys/class/infiniband")
        except OSError:
            return True
    return choice == "tcp"


def force_backend(backend: str | None) -> None:
    """Make ``backend`` ("mpi", "shm", "torch"; None: back to the setting) what every group made
    from now on in this process routes by, over ``TERRAPIPE_COMM_BACKEND`` (comm.init's
    ``backend=``)."""
    global _backend_choice
    _backend_choice = backend


def forced_backend() -> str:
    """The backend this process's groups route by: what :func:`terrapipe.comm.init` was asked
    for when it named one, else ``TERRAPIPE_COMM_BACKEND`` ("auto", "mpi", "shm" or "torch")."""
    return _backend_choice or settings.get("TERRAPIPE_COMM_BACKEND")

_COLL = {"allreduce": 1, "broadcast": 2, "allgather": 3, "reduce_scatter": 4, "reduce": 5,
         "gather": 6, "scatter": 7, "barrier": 8, "jit_allreduce": 9,
         "nccl_allreduce": 10, "nccl_broadcast": 11, "nccl_allgather": 12, "shared_array": 13,
         "adasum_allreduce": 14}
# Signature words: 0 collective, 1 op, 2 dtype, 3 root, 4 elements, 5 dims, then the dims up to
# _ALGORITHM_WORD, the algorithm (comm/select.py's code), then SHARED_WORD, where a shared
# array's (segment, byte offset) go (NOTE [shared arrays] 2 in comm/algorithms/shared.py).
_ALGORITHM_WORD = SIG_WORDS - 3


class Group:
    """A communicator: ``rank``, ``size``, ``local_rank``, ``local_size`` and the collectives.

    Built by :func:`terrapipe.comm.init` (the world) and :meth:`split`: ``Group(mpi_comm)`` over
    an mpi4py communicator (None: a lone process, every collective local), or
    :meth:`over_torch` over torch.distributed, or :meth:`over_store` over a key-value store.
    ``timeout``: seconds a collective waits for the other ranks. ``node_size``: group ranks k per
    node (emulates several nodes on one machine; ValueError on every rank where an emulated
    node's ranks are not on one machine, for they share its memory).

    Transports (None where the group has none): ``shm`` (this node's segment), ``mpi`` (the
    whole group over MPI), ``cross`` (MPI among the ranks of this local rank on every node),
    ``bulk`` (what carries the large parts between nodes in the background: NOTE [overlap across
    nodes] in comm/algorithms/segment.py), ``gloo``; ``control`` is the one signatures are
    agreed over. ``comm``: the mpi4py
    communicator the group was made over (None over torch.distributed, a store, or alone), for
    layers that run their own MPI traffic beside the collectives (the parameter server).
    """

    SHARED_WORD = SIG_WORDS - 2

    @staticmethod
    def _check_emulated_node(mpi_comm, node, node_size: int) -> None:
        """ValueError on every rank where a ``node_size`` node's ranks span machines: its shared
        segment would be a file on one machine's /dev/shm that the others cannot open."""
        from mpi4py import MPI

        shared = node.Split_type(MPI.COMM_TYPE_SHARED, key=node.Get_rank())
        apart = shared.Get_size() != node.Get_size()
        shared.Free()
        if not mpi_comm.allreduce(apart, op=MPI.LOR):
            return
        hosts = mpi_comm.allgather(socket.gethostname())
        first = next(r for r in range(0, len(hosts), node_size)
                     if len(set(hosts[r:r + node_size])) > 1)
        last = min(first + node_size, len(hosts))
        spread = ", ".join(f"rank {q} on {hosts[q]}" for q in range(first, last))
        node.Free()
        raise ValueError(f"node_size={node_size}: an emulated node's ranks must share a machine, "
                         f"but {spread}")

    def __init__(self, mpi_comm=None, timeout: float = 300.0, node_size: int | None = None) -> None:
        self._init_execution(timeout)
        self.comm = mpi_comm
        if mpi_comm is None:
            self.rank, self.size, self.local_rank, self.local_size, self.nnodes = 0, 1, 0, 1, 1
            self.whole_world = True
            return
        from mpi4py import MPI

        from .transports.mpi import MpiTransport

        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.whole_world = self.size == MPI.COMM_WORLD.Get_size()
        if node_size:
            color = self.rank // node_size
        else:
            shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            color = shared.allreduce(self.rank, op=MPI.MIN)
            shared.Free()
        node = mpi_comm.Split(color, key=self.rank)
        if node_size:
            self._check_emulated_node(mpi_comm, node, node_size)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        # Cores this node's ranks may run on: the union of their affinity masks (ranks bound
        # to one core each still count every core).
        cores = set().union(*node.allgather(sorted(os.sched_getaffinity(0))))
        self.oversubscribed = self.local_size > len(cores)
        cross = mpi_comm.Split(self.local_rank, key=self.rank)
        colors = mpi_comm.allgather(color)
        self.nnodes = len(set(colors))
        self.uniform = len({colors.count(c) for c in set(colors)}) == 1
        late = lambda: self.shm.late() if self.shm is not None else None  # noqa: E731
        hosts = mpi_comm.allgather(socket.gethostname()) if self.nnodes > 1 else None
        self.mpi = MpiTransport(mpi_comm, list(range(self.size)), self.timeout, late, hosts)
        cross_mpi = None
        if self.nnodes > 1:
            cross_mpi = MpiTransport(cross, cross.allgather(self.rank), self.timeout, late, hosts)
        self.cross = cross_mpi
        self.shm = ShmTransport(node, self.rank, self.size, node.allgather(self.rank), self.timeout,
                                cross_mpi)
        if cross_mpi is not None:  # NOTE [a peer lost across nodes] in transports/board.py
            for mpi in (self.mpi, cross_mpi):
                mpi.on_lost, mpi.on_waiting = self.shm.board.mark_lost, self.shm.board.mark_waiting
            cross_mpi.choose_halving()  # NOTE [MPI from compiled code] 9 in transports/mpi_native.py
        self.shm.board.progress = self.mpi.progress  # NOTE [MPI progress] 4 in comm/algorithms/ring.py
        # Every rank the same way: the overlapped allreduce and the inline one lay out the rows
        # differently (NOTE [overlap across nodes] 2). The condition before the vote is the same
        # on every rank (nodes, their rank counts), so one-node groups pay no start-up collective.
        # On nodes of one rank each the streams make one ring of the whole group, which carries
        # large allreduces whole (NOTE [algorithm selection] 4 in comm/select.py).
        across_nodes = cross_mpi is not None and self.uniform
        if across_nodes and mpi_comm.allreduce(int(_bulk_over_tcp()), op=MPI.MIN):
            from .transports.tcp import TcpTransport

            try:
                self.bulk = TcpTransport(cross, self.timeout, cross_mpi.members,
                                         [hosts[m] for m in cross_mpi.members])
            except CommError as e:
                raise CommError(f"{e} (TERRAPIPE_BULK_TRANSPORT=mpi keeps the large parts between "
                                f"nodes on MPI, with no connections of terrapipe's own)") from e
            self.bulk.on_lost, self.bulk.on_waiting = self.shm.board.mark_lost, self.shm.board.mark_waiting
        if cross_mpi is None:
            cross.Free()
        self.control = self.shm

    @classmethod
    def over_torch(cls, timeout: float = 300.0, pg=None) -> Group:
        """A group over torch.distributed (Gloo): the default group (initialised here from the
        environment if nothing did), or the process group ``pg``. The default group across
        machines also gets shared memory on each (NOTE [machines over Gloo])."""
        from .. import launch_env
        from .store import StoreComm, node_of
        from .transports.gloo import GlooTransport

        global _machines_made
        self = cls._over_gloo(GlooTransport(timeout, pg), timeout, pg is None and launch_env.local_size())
        if pg is None and self.size > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            # The store outlives a world that is closed and made again: keys of their own.
            _machines_made += 1
            store, prefix = _get_default_store(), f"terrapipe/machines{_machines_made}"
            nodes = StoreComm(store, f"{prefix}/nodes", self.rank, self.size, timeout).allgather(node_of())
            self._machines_over_gloo(store, prefix, nodes)
        return self

    @classmethod
    def over_store(cls, store, prefix: str, rank: int, size: int, timeout: float = 300.0,
                   abandon=None) -> Group:
        """A group of ``size`` processes on one node, over shared memory, set up through a
        key-value store (torch c10d's ``Store``: what a ``torch.distributed`` backend is given)
        instead of MPI. ``prefix``: a key space unique to this group. Every rank must be on this
        node (ValueError naming the ranks that are not); ranks on several nodes need MPI or Gloo
        between them. ``abandon``: see :class:`~terrapipe.comm.store.StoreComm` (the set-up's
        waits give up when it returns a reason). :meth:`split` works over the same store."""
        from .store import StoreComm, node_of

        self = cls.__new__(cls)
        self._init_execution(timeout)
        comm = StoreComm(store, prefix, rank, size, timeout, abandon)
        nodes = comm.allgather(node_of())
        away = [r for r, n in enumerate(nodes) if n != nodes[rank]]
        if away:
            raise ValueError(f"over_store: ranks {away} are on another node than rank {rank}; "
                             f"shared memory reaches one node only")
        self.comm = None
        self.store_comm = comm
        self.rank, self.size = int(rank), int(size)
        self.local_rank, self.local_size, self.nnodes = self.rank, self.size, 1
        self.whole_world = False
        if self.size > 1:
            cores = set().union(*map(set, comm.allgather(sorted(os.sched_getaffinity(0)))))
            self.oversubscribed = self.size > len(cores)
            self.shm = ShmTransport(comm, self.rank, self.size, list(range(self.size)), self.timeout)
            self.control = self.shm
        return self

    @classmethod
    def over_store_and_gloo(cls, store, prefix: str, rank: int, size: int, timeout: float = 300.0,
                            abandon=None) -> Group:
        """A group of ``size`` processes on any machines, set up through ``store`` under
        ``prefix``: Gloo between them (torch.distributed's default group, made here and destroyed
        when the group closes), its local ranks those on this machine. ``abandon``: as for
        :meth:`over_store`. For an elastic job's generation that spans machines
        (comm/rendezvous.py); shared memory on each machine as NOTE [machines over Gloo] says."""
        import datetime

        import torch.distributed as dist

        from .store import StoreComm, node_of
        from .transports.gloo import GlooTransport

        if dist.is_initialized():
            raise RuntimeError("over_store_and_gloo: torch.distributed is already initialised in this "
                               "process; the group makes its own default group")
        nodes = StoreComm(store, f"{prefix}/nodes", rank, size, timeout, abandon).allgather(node_of())
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prefix}/gloo/", store), rank=int(rank),
                                world_size=int(size), timeout=datetime.timedelta(seconds=float(timeout)))
        gloo = GlooTransport(timeout)
        gloo.owns_init = True  # made here: close() destroys it, so the next generation can make its own
        self = cls._over_gloo(gloo, timeout, None)
        self._machines_over_gloo(store, f"{prefix}/machines", nodes, abandon)
        return self

    @classmethod
    def over_store_across_machines(cls, store, prefix: str, rank: int, size: int, nodes: list[str],
                                   timeout: float = 300.0) -> Group:
        """A group of ``size`` processes on several machines (``nodes``: each rank's,
        :func:`~terrapipe.comm.store.node_of`, as every rank found them), set up through
        ``store`` under ``prefix``: a Gloo group of its own among them (NOTE [Gloo groups of our
        own] in transports/gloo.py; torch.distributed's default group, if any, is not touched)
        and shared memory on each machine (NOTE [machines over Gloo]). For a torch.distributed
        backend whose ranks span machines without MPI (distributed/process_group.py). Collective."""
        import torch.distributed as dist

        from .transports.gloo import GlooTransport

        gloo = GlooTransport.of_its_own(dist.PrefixStore(f"{prefix}/gloo/", store), rank, size, timeout)
        self = cls._over_gloo(gloo, timeout, None)
        self._machines_over_gloo(store, f"{prefix}/machines", list(nodes))
        return self

    def _machines_over_gloo(self, store, prefix: str, nodes: list[str], abandon=None) -> None:
        """NOTE [machines over Gloo]: this Gloo group's topology from ``nodes`` (each rank's
        machine, :func:`~terrapipe.comm.store.node_of`), and where every machine holds the same
        number of ranks: two or more, shared memory on each (set up over ``store`` under
        ``prefix``) and a ring among the ranks of each local rank (2); one, a ring among them all
        (8); all on one machine, its shared memory alone (9). Collective."""
        from .store import StoreComm

        self._machines = (store, prefix, nodes)
        names = sorted(set(nodes), key=nodes.index)
        same = [r for r in range(self.size) if nodes[r] == nodes[self.rank]]
        self.local_rank, self.local_size = same.index(self.rank), len(same)
        self.nnodes = len(names)
        self.uniform = len(set(collections.Counter(nodes).values())) == 1
        one_machine = self.nnodes == 1 and self.size > 1
        if not (one_machine or Group.spans_machines_evenly(nodes)):
            return
        local = StoreComm(store, f"{prefix}/{names.index(nodes[self.rank])}", self.local_rank,
                          self.local_size, self.timeout, abandon)
        cores = set().union(*map(set, local.allgather(sorted(os.sched_getaffinity(0)))))
        self.oversubscribed = self.local_size > len(cores)
        if one_machine:  # 9: the machine's segment for everything, no ring
            self.shm = ShmTransport(local, self.rank, self.size, same, self.timeout)
            self.control = self.shm
            return
        # 2; 8: on machines of one rank each, one ring of them all
        _, self.cross = Group._cross_group(nodes, self.rank, store, prefix, self.timeout, abandon)
        self.shm = ShmTransport(local, self.rank, self.size, same, self.timeout, self.cross)
        # 4: NOTE [a peer lost across nodes] in transports/board.py
        self.cross.on_lost, self.cross.on_waiting = self.shm.board.mark_lost, self.shm.board.mark_waiting
        self.cross.choose_halving()  # NOTE [a ring's schedule in compiled code] 10, tcp_native.py
        self.control = self.shm  # 6
        self.bulk = self.cross  # 3: NOTE [overlap across nodes] in comm/algorithms/segment.py

    @staticmethod
    def spans_machines_evenly(nodes: list[str]) -> bool:
        """Whether ranks on ``nodes`` (each rank's machine) span several machines of as many
        ranks each: the groups over Gloo that NOTE [machines over Gloo] 2 and 8 join with TCP
        rings (one machine is over_store's; machines of unequal counts stay on Gloo)."""
        return len(set(collections.Counter(nodes).values())) == 1 and len(set(nodes)) > 1

    @staticmethod
    def _cross_group(nodes: list[str], rank: int, store, prefix: str, timeout: float, abandon=None):
        """``rank``'s transport among the ranks of its local rank on ``nodes`` (NOTE [machines
        over Gloo] 2): a ring of TCP streams (NOTE [a ring over TCP] in transports/tcp.py) set up
        by those ranks alone over ``store`` under ``prefix``. Returns (their group ranks, in
        machine order; the transport)."""
        from .store import StoreComm
        from .transports.tcp import TcpTransport

        place, seen = [], collections.Counter()  # each rank's local rank: its place on its machine
        for n in nodes:
            place.append(seen[n])
            seen[n] += 1
        members = [q for q in range(len(nodes)) if place[q] == place[rank]]
        comm = StoreComm(store, f"{prefix}/cross{place[rank]}", members.index(rank), len(members), timeout,
                         abandon)
        return members, TcpTransport(comm, timeout, members, [nodes[m] for m in members], exchange=True)

    def _split_over_store(self, color: int, key: int, timeout: float) -> Group:
        """:meth:`split` of a group made by :meth:`over_store`: membership agreed over the same
        store, the new group under a key space of its own."""
        sc = self.store_comm
        entries = sc.allgather([int(color), int(key), self.rank])
        ranks = [r for _, r in sorted((k, r) for c, k, r in entries if c == color)]
        self._splits += 1
        prefix = f"{sc.prefix}/split{self._splits}/{color}"
        return Group.over_store(sc.store, prefix, ranks.index(self.rank), len(ranks), timeout, sc.abandon)

    @classmethod
    def _over_gloo(cls, gloo, timeout: float, local_size: int | None) -> Group:
        self = cls.__new__(cls)
        self._init_execution(timeout)
        self.comm = None
        self.gloo = self.control = gloo
        self.rank, self.size = gloo.rank, gloo.size
        self.local_size = local_size or self.size
        self.local_rank = self.rank % self.local_size
        self.nnodes = max(1, self.size // self.local_size)
        self.whole_world = gloo.pg is None
        return self

    def _init_execution(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.executor = Executor()
        self.shm: ShmTransport | None = None
        self.mpi = self.gloo = self.cross = self.control = self.bulk = None
        self.store_comm = None  # over_store's StoreComm (what split agrees over)
        self._machines = None  # a Gloo group's (store, prefix, each rank's machine): NOTE [machines
        # over Gloo]
        self._splits = 0
        self.uniform = True
        self.oversubscribed = False
        self.staging_pool = None  # comm/staging.py: pinned buffers and side streams, made on demand
        self.nccl = None  # comm/transports/nccl.py: None (undecided), False (staged) or its NcclTransport
        self.small_plans: dict[tuple, tuple | None] = {}  # the latency path's (comm/select.py)
        self.small_lanes: dict[tuple, object] = {}  # its fast lane's (select.small_lane)
        self.pinned: dict[str, str] = {}  # collective: algorithm (use_algorithm)
        self.algorithm_log: list | None = None  # record_algorithms
        # What an algorithm keeps for this group from its first call, by the algorithm's name
        # (Adasum's pairs and blocks, split off this group, and its scratch:
        # comm/algorithms/adasum.py); each has close(), called when this group closes
        self.derived: dict[str, object] = {}
        forced = forced_backend()
        self.force_mpi, self.force_shm = forced == "mpi", forced == "shm"

    @property
    def transport(self) -> Transport | None:
        """The transport signatures are agreed over (None for a lone process)."""
        return self.control

    @property
    def node_ranks(self) -> list[int]:
        """The group ranks on this rank's node, in local-rank order."""
        if self.shm is not None:
            return list(self.shm.board.ranks)
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_size))

    def settle_at_exit(self, seconds: float) -> list[int]:
        """At the process's exit: mark this rank exiting on its node's board, then wait at most
        ``seconds`` until the node's other ranks have too, or died (NOTE [collective ordering] 7
        in comm/execution.py). Returns the group ranks of this node still running then."""
        if self.shm is None:
            return []
        self.shm.board.mark_exiting()
        running = self.shm.board.wait_exiting(seconds)
        return running

    # -- structure --------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None, timeout: float | None = None) -> Group:
        """Ranks with the same ``color`` form a new group, ordered by ``key`` (default: rank),
        whose collectives wait ``timeout`` seconds for late ranks (default: this group's).
        Collective over this group."""
        key = self.rank if key is None else int(key)
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"split: timeout must be positive, got {timeout}")
        if self.gloo is not None:
            transport, colors = self.gloo.split(int(color), key, timeout)
            sub = Group._over_gloo(transport, timeout, None)
            if self._machines is not None:  # NOTE [machines over Gloo] 5
                store, prefix, nodes = self._machines
                self._splits += 1
                where = [nodes[q] for q in colors[color]]
                sub._machines_over_gloo(store, f"{prefix}/split{self._splits}/{color}", where)
            return sub
        if self.store_comm is not None:
            return self._split_over_store(int(color), key, timeout)
        if self.comm is None:
            return Group(None, timeout)
        return Group(self.comm.Split(int(color), key), timeout)

    def exchange_objects(self, obj) -> list:
        """Every rank's ``obj`` (small; over MPI picklable, over Gloo JSON's types, tuples
        coming back as lists), in rank order; outside the collective order, for set-up between
        collectives (comm/transports/nccl.py)."""
        if self.comm is not None:
            return self.comm.allgather(obj)
        if self.gloo is not None:
            return self.gloo.allgather_objects(obj)
        return [obj]

    def close(self) -> None:
        self.executor.close()
        derived, self.derived = self.derived, {}
        for state in derived.values():
            state.close()
        healthy = not self.executor.failed
        bulk = self.bulk if self.bulk is not self.cross else None
        for t in (bulk, self.cross, self.mpi, self.gloo):
            # After a failure MPI's frees may wait on the lost peer; sockets and Gloo close alone.
            if t is not None and (healthy or t.name in ("gloo", "tcp")):
                t.close()
        if self.staging_pool is not None:
            self.staging_pool.close()  # unpins the segment's mapping before it is unmapped
        if self.shm is not None:
            self.shm.close(healthy)  # frees its node communicator
        self.shm = self.mpi = self.cross = self.gloo = self.control = self.bulk = None
        self.staging_pool = None
        if self.nccl:
            self.nccl.close()
        self.nccl = None

    def tune(self, ring_bytes: int | None = None, ring_chunk_bytes: int | None = None) -> None:
        """Set the MPI ring's threshold (allreduces of at least ``ring_bytes`` take our ring, smaller
        ones MPI's own) and message size for every collective issued after this call, which
        runs in issue order (NOTE [collective ordering]). Collective: every rank sets the same
        values at the same point (the autotuner does, from scores all ranks share)."""
        for name, v in (("ring_bytes", ring_bytes), ("ring_chunk_bytes", ring_chunk_bytes)):
            if v is not None and int(v) <= 0:
                raise ValueError(f"tune: {name} must be positive, got {v}")

        def body():
            for t in (self.mpi, self.cross):
                if t is not None:
                    t.tune(ring_bytes, ring_chunk_bytes)

        self.run(body, False)

    def uses_ring(self) -> bool:
        """Whether this group has an MPI transport whose ring :meth:`tune` would change."""
        return self.mpi is not None or self.cross is not None

    def tuning(self) -> dict[str, int]:
        """The ring's threshold and message size in use (the defaults where there is no MPI)."""
        from .transports.mpi import CHUNK_BYTES, RING_BYTES

        t = self.mpi or self.cross
        return {"ring_bytes": t.ring_bytes if t else RING_BYTES,
                "ring_chunk_bytes": t.chunk_bytes if t else CHUNK_BYTES}

    def use_algorithm(self, coll: str, algorithm: str | None) -> None:
        """Run every ``coll`` ("allreduce", "reduce", "broadcast", "allgather", "gather",
        "scatter", "reduce_scatter", "barrier") issued after this call with ``algorithm`` (a
        name of ``terrapipe.comm.select.ALGORITHMS``: "oneshot", "segment", "shared",
        "single_copy", "staged_rows", "ring", "mpi", "gloo", "nccl", ...), or as selected
        again with None. A call
        the algorithm cannot run raises CommError. Every rank must pin alike at the same point
        of its collective sequence (a rank that did not gets CollectiveMismatchError). For
        tests and benchmarks that compare algorithms; selection is otherwise automatic."""
        if coll not in ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter",
                        "reduce_scatter", "barrier"):
            raise ValueError(f"use_algorithm: coll must name a collective, got {coll!r}")
        if algorithm is not None and algorithm not in select.ALGORITHMS:
            raise ValueError(f"use_algorithm: algorithm must be one of {sorted(select.ALGORITHMS)} or None, "
                             f"got {algorithm!r}")

        def body():
            if algorithm is None:
                self.pinned.pop(coll, None)
            else:
                self.pinned[coll] = algorithm
            self.small_lanes.clear()  # each was chosen under the pins before

        self.run(body, False)

    def record_algorithms(self) -> list[tuple[str, str, int]]:
        """A list that receives (collective, algorithm, bytes) for every call of this rank from
        now on, as comm/select.py ran it (tests and benchmarks see which algorithm ran; a call
        that selects nothing, such as a lone rank's, is not listed); the same list on every call.
        Local."""
        if self.algorithm_log is None:
            self.algorithm_log = []
        return self.algorithm_log

    def barrier(self) -> None:
        """Return once every rank of the group entered it, run now in the caller's thread (for
        code already inside a collective body: ``terrapipe.comm.barrier`` is the one that takes
        its turn in the group's order)."""
        select.barrier(self)

    # -- execution (comm/execution.py) -----------------------------------------------------------
    def run(self, fn, async_op: bool, label: tuple[str, int] | None = None):
        """Run a collective body ``fn()`` in issue order (NOTE [collective ordering] in
        comm/execution.py): its result, or a Handle when ``async_op``. ``label``: (name, bytes)
        for the timeline."""
        return self.executor.run(fn, async_op, label)

    @property
    def failed(self) -> str | None:
        """Why this group takes no more calls, or None while it is usable."""
        return self.executor.failed

    # -- signatures ----------------------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=512)
    def signature_of(coll: str, op: int, dtype_name: str | None, size: int, shape: tuple,
                     root: int, algorithm: int = 0) -> np.ndarray:
        """The signature words of a call (read-only int64, SIG_WORDS long): collective, op code,
        dtype, root, elements, dims and the algorithm's code."""
        sig = np.zeros(SIG_WORDS, np.int64)
        sig[0], sig[1], sig[3], sig[_ALGORITHM_WORD] = _COLL[coll], op, root, algorithm
        if dtype_name is not None:
            sig[2], sig[4], sig[5] = dtypes.by_name(dtype_name).code, size, len(shape)
            dims = list(shape)[:_ALGORITHM_WORD - 6]
            sig[6:6 + len(dims)] = dims
        sig.flags.writeable = False
        return sig

    @classmethod
    def signature(cls, coll: str, op: int = 0, buf=None, root: int = -1,
                  algorithm: str | None = None) -> np.ndarray:
        """:meth:`signature_of` for ``buf`` (anything with dtype_name, size and shape; None:
        no data) run by ``algorithm`` (a comm/select.py name)."""
        code = 0
        if algorithm is not None:
            code = select.code_of(algorithm)
        if buf is None:
            return cls.signature_of(coll, op, None, 0, (), root, code)
        return cls.signature_of(coll, op, buf.dtype_name, buf.size, tuple(buf.shape), root, code)

    def agree(self, coll: str, op: int = 0, buf=None, root: int = -1) -> None:
        """NOTE [collective ordering] 4: raise CollectiveMismatchError on every rank unless all
        called ``coll`` alike. ``buf``: anything with dtype_name, size and shape."""
        if self.size > 1:
            self.agree_signature(coll, self.signature(coll, op, buf, root))

    def agree_signature(self, coll: str, sig: np.ndarray) -> None:
        """Agree on ``sig`` (from :meth:`signature`) over the control transport."""
        with timeline.span("comm", "agreement"):
            self.control.agree(coll, sig, functools.partial(self.mismatch, coll))

    def mismatch(self, coll: str, sigs: np.ndarray, ranks: list[int]) -> None:
        """Raise CollectiveMismatchError describing each rank's call unless every signature in
        ``sigs`` (rows: ``ranks``) is the same. Every rank of the group sees the same signatures
        and raises alike; before it does, the node's row halves start over (NOTE [row halves]
        3 in comm/transports/shm.py)."""
        if (sigs == sigs[0]).all():
            return
        if self.shm is not None:
            self.shm.realign()

        def desc(s):
            dtype = dtypes.by_code(int(s[2]))
            parts = [dtype.name if dtype else "?", str(tuple(int(d) for d in s[6:6 + int(s[5])]))]
            if s[0] != _COLL[coll]:
                parts.insert(0, f"in {[k for k, v in _COLL.items() if v == s[0]] or ['?']}")
            if s[1] or coll in ("allreduce", "reduce", "reduce_scatter"):
                op = ops.by_code(int(s[1]))
                parts.append(f"op={op.name if op else int(s[1])}")
            if s[3] >= 0:
                parts.append(f"root={int(s[3])}")
            shared_word = Group.SHARED_WORD
            if s[shared_word]:
                parts.append(f"in shared array {int(s[shared_word])} at byte {int(s[shared_word + 1])}")
            elif coll in ("allreduce", "jit_allreduce") and (sigs[:, shared_word] > 0).any():
                parts.append("in private memory")
            if (sigs[:, _ALGORITHM_WORD] != sigs[0, _ALGORITHM_WORD]).any():
                parts.append(f"by {select.name_of(s[_ALGORITHM_WORD])}")
            return " ".join(parts)

        lines = "; ".join(f"rank {r}: {desc(s)}" for r, s in zip(ranks, sigs, strict=True))
        raise CollectiveMismatchError(f"{coll}: ranks called it differently: {lines}")

    # -- shared arrays (NOTE [shared arrays] in comm/algorithms/shared.py) ---------------------
    def shared_array(self, nbytes: int) -> np.ndarray | None:
        """A flat uint8 array of ``nbytes`` in this node's shared memory (NOTE [shared arrays]
        in comm/algorithms/shared.py): an allreduce of a piece of it that every rank passes
        alike is reduced in place with nothing copied in. Collective over the group, in issue
        order, with the same ``nbytes`` on every rank (CollectiveMismatchError otherwise). None
        where the group cannot use it (one rank, Gloo, TERRAPIPE_COMM_BACKEND=mpi, nodes of
        unequal size) or when the node's /dev/shm cannot hold it. On nodes of one rank each its
        allreduces take private memory's paths (NOTE [algorithm selection] 6 in
        comm/select.py). The caller owns the array; :meth:`release_shared` returns it to private
        use."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"shared_array: nbytes must be >= 0, got {nbytes}")
        if self.size == 1 or self.shm is None or self.force_mpi or not self.uniform:
            return None

        def body():
            self.agree("shared_array", 0, _Bytes(nbytes))
            try:
                arr = self.shm.alloc_shared(nbytes)
            except OSError:  # raised alike on every rank of the node
                arr = None
            if self.nnodes > 1 and self.comm is not None:  # every node must agree on the path
                from mpi4py import MPI

                if not self.comm.allreduce(arr is not None, op=MPI.LAND) and arr is not None:
                    self.shm.release_shared(arr)
                    arr = None
            return arr

        return self.run(body, False)

    def release_shared(self, arr: np.ndarray) -> None:
        """Return an array of :meth:`shared_array` to private use: allreduces of it take the
        ordinary paths from now on (every rank must release alike). Its memory goes when the last
        view of it does. Local; runs after the collectives issued before it."""
        if self.shm is not None and not self.executor.failed:  # a failed group takes no more calls
            self.run(lambda: self.shm.release_shared(arr), False)


class _Bytes:
    """A byte count as the signature agreement sees a buffer."""

    dtype_name = "uint8"

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.shape = (nbytes,)
