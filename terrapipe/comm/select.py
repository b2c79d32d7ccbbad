"""The one place that picks how a collective runs: an algorithm (comm/algorithms/) over a
transport (comm/transports/), for every collective, sync or async, host or CUDA.

A call is described by a :class:`Request` (the collective, its bytes, its format, whether it is
device-staged or lies in a shared array, where its tensors live). :data:`CANDIDATES` is an
ordered list of (algorithm, when): the first row whose ``when`` holds for the group and the
request runs it, as Horovod's OperationManager asks its ops in turn whether they apply. A group
may pin an algorithm per collective (:meth:`Group.use_algorithm`: tests run one body over every
algorithm that can take a request, benchmarks compare them); a pinned algorithm that cannot
take a request raises CommError. The chosen algorithm's code goes into the signature every rank
agrees on, so ranks that chose differently get CollectiveMismatchError, never a hang.

NOTE [algorithm selection]
    The rows of :data:`CANDIDATES`, in order; the crossovers are measured with ``python -m
    benchmarks.allreduce --algorithms -n 2`` / ``-n 4``, the ring's by the autotuner
    (``Group.tune``).
    1. CUDA tensors go to NCCL's own collectives when every rank of the group can use it
       (comm/transports/nccl.py); otherwise they are staged through host memory and take the
       rows below like any host message (device-staged: with a gate, NOTE [staging gate] in
       comm/message.py). On one node, those beyond the one-shot (5) and not compressed on the
       wire go staged_rows: the GPU copies each chunk straight into this rank's row of the
       segment and back out of it, and the host only reduces (NOTE [staged rows] in
       comm/algorithms/staged_rows.py).
    2. Over Gloo (torchrun, or an elastic generation across machines) every collective is
       Gloo's own, except reductions where the group spans machines of as many ranks each (NOTE
       [machines over Gloo] in comm/group.py), and everything where all its ranks are on one
       machine: there the group has the machine's segment and takes the rows below as a group
       over MPI on one node does (clause 9 of that NOTE). With two or more per machine those run as
       across nodes under MPI (4): an allreduce up to the one-shot's limit is the one-shot
       across nodes, its exchange around each local rank's ring of TCP streams among nnodes
       ranks (NOTE [a ring over TCP] in comm/transports/tcp.py; NOTE [one-shot across nodes]
       13), a larger one single-copy or hierarchical, the segment on each machine and each
       local rank's part allreduced over that ring, where Gloo's own is a ring of every rank
       (at 2 machines x 2 over 1gbit, 4 KiB: 0.18 ms where the segment's way took 0.46 and
       Gloo's own 8.8, ``gloo_machines_2x2_1gbit_2026-12-02.json``); with one per machine,
       the whole message around one such ring (``tcp``): every rank is a node, so there is no
       hierarchy to gain, but the ring's steps pipelined by chunk (NOTE [ring schedule] 2 in
       comm/algorithms/ring.py) keep pace with Gloo's own. At 4 nodes x 1 under torchrun
       (2-core Xeon, 2026-11-28, ``python -m benchmarks.ddp_machines``), Gloo's time over ours:
       over 1gbit 3.4x at 4 KiB, 1.43x at 256 KiB, 0.99-1.02x from 1 MiB (the links' bound);
       over 10gbit 1.35x at 1 MiB, 0.94x at 4, 1.06x at 16
       (``ddp_machines_4x1_{1,10}gbit_2026-11-28_2.json``). At 2 nodes x
       2 under torchrun, pinned and interleaved (``python -m benchmarks.gloo_machines``):
       1.5-10x Gloo's own through the same group from 16 MiB down to 4 KiB over 1gbit links,
       1.4-10x over 2.5gbit.
    3. Under MPI, every collective is MPI's own, or our ring for allreduces from ``ring_bytes``,
       when MPI is forced (``TERRAPIPE_COMM_BACKEND=mpi``) or nodes differ in rank count.
    4. Across nodes: an allreduce of at most ``oneshot_nodes.limit`` bytes is the one-shot
       across nodes (NOTE [one-shot across nodes] in comm/algorithms/oneshot_nodes.py: its
       agreement and data in one board step and one exchange between nodes; between two nodes
       of several ranks up to a row half, 2 MiB at two ranks a node, clause 10, among four
       nodes of one rank up to 2 MiB, clause 12); larger ones are
       hierarchical (the segment on each node, each part allreduced between nodes by the ring or
       MPI's own, by size; a message of several chunks with each part crossing over the group's
       ``bulk`` TCP rings while the node works on the next, NOTE [overlap across nodes] in
       comm/algorithms/segment.py); from ``single_copy.MIN_BYTES`` private memory goes single-copy
       on each node, each chunk's part crossing the same way (NOTE [single-copy allreduce] 7 in
       comm/algorithms/single_copy.py; at 2 nodes x 2 over 10gbit, where the cores set the pace,
       1.3-1.6x the segment's way from 4 to 64 MiB; level over 1 and 2.5gbit, where the link
       does, with a quarter to a third less CPU: allreduce_cluster_2x2_*_2026-11-27_{4,5,6}.json),
       except on nodes of one rank each, where the segment only adds two
       copies: there they take a ring over the whole group from ``ring_bytes``, MPI's own
       below (at 4 nodes x 1 over 1gbit, 16 MiB: the segment's way 56% of the links' bound, the
       ring alone about 95%): the ring of the group's ``bulk`` TCP streams where it has them
       (``tcp``), else our ring over MPI. Interleaved at 4 nodes x 1 (2-core Xeon, 2026-11-28,
       ``allreduce_cluster_4x1_10gbit_2026-11-28{,_2,_3,_4,_5}.json``), the TCP ring against
       the ring over MPI: over 10gbit, where the cores set the pace, level at 4 MiB,
       1.19-1.45x at 16 MiB and 1.23-1.37x at 64 MiB in each of five runs; over 1gbit level
       (both at 92-95% of the links' bound), with a fifth of the CPU (16 MiB: 21 ms a rank
       against 106). The other collectives are MPI's own.
    5. On one node, an allreduce of at most ``oneshot.limit`` bytes is the one-shot: one
       barrier, signature and data together, each rank reading p x n bytes, kept within 4 MiB
       (2 MiB messages at 2 ranks, 1 MiB at 4: ``oneshot.ONESHOT_READ_BYTES``), where it beats
       MPICH's Allreduce here (1.2-2x). So are an allgather, a gather, a broadcast and a
       reduce-scatter of at most half a row (``oneshot.half_row_limit``; NOTE [one-shot copies]
       in comm/algorithms/oneshot.py), below single-copy's sizes (7).
    6. An allreduce in place on a piece of a shared array (``Group.shared_array``; NOTE
       [shared arrays] in comm/algorithms/shared.py) takes the shared algorithm from
       ``shared.SHARED_MIN_BYTES`` (512 KiB), before the one-shot, sync (the latency path
       declines it) or async alike; except on nodes of one rank each, where no peer shares the
       row: there it is private memory in effect and takes 4's whole-group paths, the latency
       path included (at 4 nodes x 1 over 10gbit the shared path's chunked crossings took
       1.1-2.7x a private bucket's time from 1 to 16 MiB:
       allreduce_cluster_4x1_10gbit_2026-11-27_{4,5,6}.json).
    7. On one node (across nodes: 4), an allreduce of private host memory from
       ``single_copy.MIN_BYTES`` (2 MiB) goes single-copy where the kernel lets the node's
       ranks read each other's memory (NOTE [single-copy allreduce] in
       comm/algorithms/single_copy.py): each rank reads its part of the peers' sources and
       then their reduced parts, nothing through the segment.
       Interleaved, float32 sum in place (``benchmarks.allreduce --algorithms``), at 2 ranks:
       2 MiB 287 us vs the one-shot's 335, 4 MiB 467 vs the ring's 564, 64 MiB 10.8 ms vs 12.0
       (the chunked segment: 17.9); at 4 ranks on 2 cores it loses to the one-shot at 1 MiB
       (608 vs 420 us), ties the segment at 2 MiB and leads from 4 MiB (1.7 vs 2.2 ms; 64 MiB
       30.5 vs 33.8). Device-staged messages go staged_rows (1). Allgathers and gathers go
       single-copy from the same size, reduce-scatters from
       ``single_copy.REDUCE_SCATTER_MIN_BYTES``.
    8. Larger ones that do not go single-copy go through our ring over MPI when every local
       rank has a core of its own (MPI's own below ``ring_bytes``): one copy fewer than the
       segment (at 2 ranks here 1.3-1.5x the chunked segment from 1 MiB, 2.4x MPICH from 32
       MiB). When ranks outnumber the node's cores, each ring step waits for a neighbour to be
       scheduled (at 4 ranks on 2 cores the ring took 3x the segment's time at 1 MiB), so the
       chunked segment carries them, as it does device-staged allreduces across nodes and
       everything under ``TERRAPIPE_COMM_BACKEND=shm``.
    9. Everything else on one node goes through the segment.

Why one module: selection and the hand-off to the chosen algorithm are one decision per
collective; split, a reader would follow a call through two files to learn which algorithm
ran. The algorithms themselves live in comm/algorithms/.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import timeline
from ..kernels import F16, compress, decompress
from .algorithms import native, oneshot, oneshot_nodes, ring, segment, shared, single_copy, staged_rows
from .buffers import dtype_name
from .errors import CommError
from .message import NO_GATE, Fused

__all__ = ["Request", "Candidate", "CANDIDATES", "ALGORITHMS", "select", "able", "allreduce_views",
           "allreduce_small", "gather_small", "broadcast_small", "reduce_scatter_small", "broadcast",
           "allgather",
           "scatter", "reduce_scatter", "reduce", "barrier",
           "send", "recv", "code_of", "name_of"]

_REDUCING = frozenset({"allreduce", "reduce"})
# The one-shots of messages up to half a row: the copies and the reduce-scatter (NOTE [one-shot
# copies] in comm/algorithms/oneshot.py).
_HALF_ROW = frozenset({"allgather", "gather", "broadcast", "reduce_scatter"})
_ALL = frozenset({"allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reduce_scatter",
                  "barrier"})


@dataclass(frozen=True)
class Request:
    """One collective call as selection sees it. ``coll``: the collective (``allreduce``,
    ``reduce``, ``broadcast``, ``allgather``, ``gather``, ``scatter``, ``reduce_scatter``,
    ``barrier``); ``nbytes``: bytes each rank contributes as exchanged; ``kind``: the 16-bit
    float format exchanged (0: native); ``staged``: host copies of device memory behind a gate;
    ``shared``: (segment, byte offset) when in place on a piece of a shared array; ``cuda``:
    CUDA tensors (NCCL may take them before staging); ``compressed``: float32 exchanged as
    16-bit values."""

    coll: str
    nbytes: int = 0
    kind: int = 0
    staged: bool = False
    shared: tuple[int, int] | None = None
    cuda: bool = False
    compressed: bool = False


@dataclass(frozen=True)
class Algorithm:
    """An algorithm: its ``name``, its ``code`` in the signature, and ``can(group, request)``:
    whether it is able to run the request at all (what pinning needs; preference is the rows')."""

    name: str
    code: int
    can: Callable


def _one_node_shm(g, r: Request) -> bool:
    return g.shm is not None and g.nnodes == 1


def _reads_peers(g, r: Request) -> bool:
    """Whether the single-copy algorithm can run ``r``: the node's ranks read each other's
    memory, the agreement publishes the addresses on the board (its barrier comes first), and
    across nodes only allreduces, on nodes of as many ranks each (NOTE [single-copy
    allreduce] 7 in comm/algorithms/single_copy.py)."""
    shm = g.shm
    if r.kind or r.staged or shm is None or shm.peers is None:
        return False
    if g.control is not shm:
        return False
    if g.nnodes == 1:
        return r.coll in ("allreduce", "allgather", "gather", "reduce_scatter")
    return r.coll == "allreduce" and g.uniform and g.cross is not None


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("nccl", 1, lambda g, r: r.cuda and g.size > 1 and _nccl().wanted(g)),
    Algorithm("gloo", 2, lambda g, r: g.gloo is not None and r.coll in _ALL),
    Algorithm("mpi", 3, lambda g, r: g.mpi is not None and r.coll in _ALL),
    Algorithm("ring", 4, lambda g, r: g.mpi is not None and r.coll in _REDUCING),
    Algorithm("shared", 5, lambda g, r: r.shared is not None and r.coll == "allreduce" and g.shm is not None),
    Algorithm("single_copy", 6, lambda g, r: _reads_peers(g, r)),
    Algorithm("oneshot", 7, lambda g, r: _one_node_shm(g, r) and (
        (r.coll == "allreduce" and r.nbytes <= oneshot.limit(g.shm))
        or (r.coll in _HALF_ROW and r.nbytes <= oneshot.half_row_limit(g.shm)))),
    Algorithm("segment", 8, lambda g, r: (
        g.shm is not None and (g.nnodes == 1 or (r.coll in _REDUCING and g.uniform)) and r.coll in _ALL)),
    Algorithm("tcp", 10, lambda g, r: r.coll in _REDUCING and _whole_ring(g) is not None),
    Algorithm("oneshot_nodes", 9, lambda g, r: (  # its exchange between nodes is the shm's, over MPI
        r.coll == "allreduce" and g.shm is not None and g.shm.cross is not None and g.uniform
        and r.nbytes <= oneshot_nodes.limit(g.shm))),
    Algorithm("staged_rows", 11, lambda g, r: (  # NOTE [staged rows] 5 in algorithms/staged_rows.py
        r.coll == "allreduce" and r.staged and not r.compressed and _one_node_shm(g, r))),
)}
_BY_CODE = {a.code: a.name for a in ALGORITHMS.values()}


def _whole_ring(g):
    """The TCP ring of the whole group, or None: a Gloo group's machines of one rank each (NOTE
    [machines over Gloo] 8 in comm/group.py), or an MPI group's ``bulk`` streams on nodes of one
    rank each (NOTE [algorithm selection] 4)."""
    if g.cross is not None and g.cross.name == "tcp" and g.shm is None:
        return g.cross
    if g.bulk is not None and g.bulk.name == "tcp" and g.local_size == 1 and g.nnodes == g.size > 1:
        return g.bulk
    return None


def _nccl():
    from .transports import nccl

    return nccl


def _ring_or_mpi(g, r: Request) -> str:
    """Over MPI: our ring for reductions from the tuned ``ring_bytes``, MPI's own below."""
    return "ring" if r.coll in _REDUCING and r.nbytes >= g.mpi.ring_bytes else "mpi"


@dataclass(frozen=True)
class Candidate:
    """A row of :data:`CANDIDATES`: ``pick(group, request)`` names the algorithm the row
    chooses, or None when the row does not apply. ``clause``: of NOTE [algorithm selection]."""

    clause: int
    pick: Callable


def _machines_over_gloo(g, r: Request) -> str | None:  # 2
    fits = g.gloo is not None and g.cross is not None and r.coll in _REDUCING and not g.force_mpi
    if not fits:
        return None
    small = _small_across_nodes(g, r)
    if small is not None:
        return small
    if g.local_size == 1:
        return "tcp"  # machines of one rank each: one ring of them all
    return _large_private(g, r) or "segment"


def _under_torchrun(g, r: Request) -> str | None:  # 2
    # On one machine the segment takes everything (NOTE [machines over Gloo] 9 in group.py).
    return "gloo" if g.gloo is not None and not (g.shm is not None and g.nnodes == 1) else None


def _flat_over_mpi(g, r: Request) -> str | None:  # 3
    return _ring_or_mpi(g, r) if g.mpi is not None and (g.force_mpi or not g.uniform) else None


def _shared_may_take(g, nbytes: int) -> bool:  # 6
    """Whether an allreduce of ``nbytes`` in place on a shared array goes by the shared
    algorithm (the latency path declines those, comm/select.py ``allreduce_small``)."""
    return nbytes >= shared.SHARED_MIN_BYTES and g.local_size > 1 and not g.force_mpi


def _in_shared_array(g, r: Request) -> str | None:  # 6
    fits = r.shared is not None and r.coll == "allreduce" and _shared_may_take(g, r.nbytes)
    return "shared" if fits else None


def _large_private(g, r: Request) -> str | None:  # 7
    least = single_copy.REDUCE_SCATTER_MIN_BYTES if r.coll == "reduce_scatter" else single_copy.MIN_BYTES
    fits = r.nbytes >= least and ALGORITHMS["single_copy"].can(g, r)
    return "single_copy" if fits and not g.force_mpi else None


def _small_on_one_node(g, r: Request) -> str | None:  # 5
    return "oneshot" if ALGORITHMS["oneshot"].can(g, r) and not g.force_mpi else None


def _small_across_nodes(g, r: Request) -> str | None:  # 4
    return "oneshot_nodes" if ALGORITHMS["oneshot_nodes"].can(g, r) and not g.force_mpi else None


def _staged_on_one_node(g, r: Request) -> str | None:  # 1
    return "staged_rows" if ALGORITHMS["staged_rows"].can(g, r) and not g.force_mpi else None


def _one_rank_per_node(g, r: Request) -> str | None:  # 4
    fits = r.coll in _REDUCING and g.mpi is not None and g.nnodes > 1 and g.local_size == 1
    if not fits or r.staged or g.force_shm:
        return None
    name = _ring_or_mpi(g, r)
    return "tcp" if name == "ring" and _whole_ring(g) is not None else name


def _large_on_free_cores(g, r: Request) -> str | None:  # 8
    fits = (r.coll in _REDUCING and g.mpi is not None and g.nnodes == 1 and not g.oversubscribed
            and not r.staged and not g.force_shm)
    return _ring_or_mpi(g, r) if fits else None


def _through_segment(g, r: Request) -> str | None:  # 4 (hierarchical allreduce), 8, 9
    fits = g.shm is not None and (g.mpi is None or r.coll in _REDUCING or g.nnodes == 1)
    return "segment" if fits else None


def _between_nodes(g, r: Request) -> str | None:  # 4
    return "mpi" if g.mpi is not None else None


CANDIDATES: tuple[Candidate, ...] = (
    Candidate(2, _machines_over_gloo),
    Candidate(2, _under_torchrun),
    Candidate(3, _flat_over_mpi),
    Candidate(6, _in_shared_array),
    Candidate(4, _small_across_nodes),
    Candidate(7, _large_private),
    Candidate(5, _small_on_one_node),
    Candidate(1, _staged_on_one_node),
    Candidate(4, _one_rank_per_node),
    Candidate(8, _large_on_free_cores),
    Candidate(9, _through_segment),
    Candidate(4, _between_nodes),
)


def select(g, r: Request) -> str:
    """The algorithm that runs request ``r`` on group ``g``.

    For CUDA tensors (``r.cuda``): "nccl", or "staged" when they go through host memory, where
    the host request selects again (NOTE [algorithm selection] 1). For host memory: the group's
    pinned algorithm for the collective when it has one (CommError when that one cannot take
    ``r``), else the first row of :data:`CANDIDATES` that applies."""
    pinned = g.pinned.get(r.coll)
    if r.cuda:
        if pinned in (None, "nccl") and ALGORITHMS["nccl"].can(g, r):
            return "nccl"
        if pinned == "nccl":
            raise CommError(f"{r.coll}: algorithm 'nccl' (pinned with use_algorithm) cannot run this "
                            f"call here: this group or rank has no NCCL")
        return "staged"
    if pinned is not None:
        if not ALGORITHMS[pinned].can(g, r):
            raise CommError(f"{r.coll}: algorithm {pinned!r} (pinned with use_algorithm) cannot run "
                            f"this call here ({_describe(g, r)}); algorithms that can: {able(g, r)}")
        return pinned
    for row in CANDIDATES:
        name = row.pick(g, r)
        if name is not None:
            return name
    raise CommError(f"{r.coll}: no algorithm can run this call here ({_describe(g, r)})")


def _ran(g, r: Request, name: str) -> None:
    log = g.algorithm_log
    if log is not None:
        log.append((r.coll, name, r.nbytes))


def able(g, r: Request) -> list[str]:
    """Every algorithm able to run ``r`` on ``g`` (what a test matrix runs over)."""
    return [a.name for a in ALGORITHMS.values() if a.can(g, r)]


def _describe(g, r: Request) -> str:
    where = ("Gloo" if g.gloo is not None else f"{g.nnodes} node(s)" + (", MPI" if g.mpi is not None else ""))
    return f"{r.nbytes} bytes, {where}, {g.size} ranks"


def code_of(name: str) -> int:
    """The signature code of algorithm ``name``."""
    return ALGORITHMS[name].code


def name_of(code: int) -> str:
    return _BY_CODE.get(int(code), "?")


def _across(g):
    """The cross-node allreduce of one part of a hierarchical allreduce (NOTE [algorithm
    selection] 4): the ring from ``ring_bytes``, MPI's own below; Gloo's own between machines
    of a Gloo group (2); None on one node."""
    cross = g.cross
    if cross is None:
        return None

    def across(buf: np.ndarray, op: int, kind: int, what: str) -> None:
        if cross.name == "mpi" and buf.nbytes >= cross.ring_bytes:
            ring.allreduce_array(cross, buf, op, kind, what)
        else:
            cross.allreduce_array(buf, op, kind, what)

    return across


# -- allreduce ----------------------------------------------------------------------------------
def allreduce_views(g, srcs: list[np.ndarray], dsts: list[np.ndarray], op: int, kind: int, ckind: int = 0,
                    coll: str = "allreduce", sig_buf=None, gate=NO_GATE) -> None:
    """Allreduce the concatenation of ``srcs`` (1-D host arrays) into that of ``dsts``, on ``g``.

    ``kind``: the 16-bit format of the arrays (0: native); ``ckind``: float32 sent as that
    16-bit format; ``coll`` and ``sig_buf`` (dtype_name, size, shape) name the call in the
    signature. ``gate`` (NOTE [staging gate] in comm/message.py): ``gate.ready(upto)`` is
    called before any source element at fused index < ``upto`` is read, and
    ``gate.wrote(upto)`` once the results before ``upto`` are final in ``dsts``."""
    if g.size == 1:
        _alone(srcs, dsts, ckind, gate)
        return
    fs, fd = Fused(srcs), Fused(dsts)
    rows_dtype = np.dtype(np.uint16 if (kind or ckind) else srcs[0].dtype)
    rkind = ckind or kind
    nbytes = fs.n * rows_dtype.itemsize
    where = _shared_location(g, fs, fd, ckind, gate)
    r = Request("allreduce", nbytes, rkind, gate is not NO_GATE, where, compressed=bool(ckind))
    name = select(g, r)
    _ran(g, r, name)
    sig = g.signature(coll, op, sig_buf, algorithm=name)
    check = functools.partial(g.mismatch, coll)
    if name == "oneshot":
        gate.ready(fs.n)
        src, dst = _single_arrays(fs, fd)
        with timeline.span("comm", "one-shot (agreement + reduce)"):
            oneshot.allreduce(g.shm, src, dst, rows_dtype, op, rkind, coll, sig, check)
        if dst is not fd.only():
            fd.write(0, dst)
        gate.wrote(fs.n)
        return
    if name == "single_copy":
        _allreduce_single_copy(g, fs, fd, op, rows_dtype, coll, sig)
        return
    if name == "oneshot_nodes":
        gate.ready(fs.n)
        src, dst = _single_arrays(fs, fd)
        with timeline.span("comm", "one-shot across nodes (agreement + reduce)"):
            oneshot_nodes.allreduce(g.shm, src, dst, rows_dtype, op, rkind, coll, sig, check, g.size)
        if dst is not fd.only():
            fd.write(0, dst)
        gate.wrote(fs.n)
        return
    if name == "shared":
        sig = sig.copy()
        sig[g.SHARED_WORD:g.SHARED_WORD + 2] = where
        g.agree_signature(coll, sig)
        bulk = g.bulk if g.bulk is not None and shared.overlaps(fs.n, rows_dtype.itemsize) else None
        shared.allreduce(g.shm, where[0], where[1], fs.n, op, rows_dtype, rkind, _across(g), bulk)
        return
    if name == "staged_rows":
        g.agree_signature(coll, sig)
        staged_rows.allreduce(g.shm, gate, fs.n, op, rows_dtype, rkind)
        return
    if gate is NO_GATE and _overlapping(fs, fd):
        # The algorithms write results while later input is still unread.
        private = np.empty(fs.n, fs.views[0].dtype)
        fs.read(0, fs.n, private)
        fs = Fused([private])
    g.agree_signature(coll, sig)
    _run_allreduce(g, name, fs, fd, op, rows_dtype, rkind, ckind, -1, gate)


def _single_arrays(fs: Fused, fd: Fused) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) as one array each for the one-shots: a fused message's sources
    copied into a fresh array, a fresh destination for a fused one (the caller writes it back)."""
    src, dst = fs.only(), fd.only()
    if src is None:
        src = np.empty(fs.n, fs.views[0].dtype)
        fs.read(0, fs.n, src)
    if dst is None:
        dst = np.empty(fd.n, fd.views[0].dtype)
    return src, dst


def _overlapping(fs: Fused, fd: Fused) -> bool:
    """Whether an output array overlaps its input other than exactly in place (checked array by
    array: a fused message's i-th output against its i-th input)."""
    for src, dst in zip(fs.views, fd.views, strict=False):
        if src is dst or (src.ctypes.data == dst.ctypes.data and src.strides == dst.strides):
            continue
        if np.may_share_memory(src, dst):
            return True
    return False


def _run_allreduce(g, name: str, fs: Fused, fd: Fused, op: int, dtype, kind: int, ckind: int, root: int,
                   gate) -> None:
    if name == "segment":
        if g.bulk is not None and segment.overlaps(g.shm, fs.n, np.dtype(dtype).itemsize):
            segment.allreduce_overlapped(g.shm, fs, fd, op, dtype, kind, ckind, root, gate, g.bulk)
        else:
            segment.allreduce(g.shm, fs, fd, op, dtype, kind, ckind, root, gate, _across(g))
    elif name == "ring":
        ring.allreduce(g.mpi, fs, fd, op, dtype, kind, ckind, root, gate)
    elif name == "tcp":
        native.allreduce(_whole_ring(g), fs, fd, op, dtype, kind, ckind, root, gate)
    else:
        native.allreduce(g.mpi if name == "mpi" else g.gloo, fs, fd, op, dtype, kind, ckind, root, gate)


def _alone(srcs, dsts, ckind: int, gate) -> None:
    """One rank: the result is its own values (rounded as the 16-bit wire format would)."""
    n = sum(s.shape[0] for s in srcs)
    gate.ready(n)
    for src, dst in zip(srcs, dsts, strict=True):
        if ckind:  # the same 16-bit rounding as the multi-rank path
            tmp = np.empty(src.shape[0], np.uint16)
            compress(src, tmp, ckind)
            decompress(tmp, dst, ckind)
        elif dst is not src:
            dst[...] = src
    gate.wrote(n)


def _allreduce_single_copy(g, fs: Fused, fd: Fused, op: int, dtype: np.dtype, coll: str, sig) -> None:
    """NOTE [single-copy allreduce] in comm/algorithms/single_copy.py; a fused message (several
    arrays) goes through one contiguous private copy."""
    src, dst = fs.only(), fd.only()
    if (src is None or dst is None or not (src.flags.c_contiguous and dst.flags.c_contiguous)
            or (dst.ctypes.data != src.ctypes.data and np.may_share_memory(src, dst))):
        # several arrays, or an output overlapping the input elsewhere than in place
        dst = src = g.shm.staging(fs.n * dtype.itemsize).view(dtype)
        fs.read(0, fs.n, src)
    g.shm.post_single_copy(src, dst)
    g.agree_signature(coll, sig)
    if g.nnodes == 1:
        single_copy.allreduce(g.shm, src, dst, op)
    elif g.bulk is not None:
        single_copy.allreduce_nodes(g.shm, src, dst, op, bulk=g.bulk)
    else:
        single_copy.allreduce_nodes(g.shm, src, dst, op, across=_across(g))
    if dst is not fd.only():
        fd.write(0, dst)


def _shared_location(g, fs: Fused, fd: Fused, ckind: int, gate) -> tuple[int, int] | None:
    """(segment, byte offset) when this allreduce is in place on a piece of a shared array (NOTE
    [shared arrays] 2 in comm/algorithms/shared.py), else None."""
    if g.shm is None or ckind or gate is not NO_GATE:  # Gloo groups have no shm
        return None
    src, dst = fs.only(), fd.only()
    if src is None or dst is None:
        return None
    # locate first: without shared arrays it answers at once (an address costs ~3 us)
    where = g.shm.locate(src)
    if where is None or where[1] % src.itemsize:
        return None
    return where if dst is src or dst.ctypes.data == src.ctypes.data else None


def allreduce_small(g, x: np.ndarray, op: int, coll: str = "allreduce", ckind: int = 0,
                    sig_shape: tuple | None = None) -> bool:
    """The latency path of a sync, in-place allreduce of ``x`` on ``g``: True when done here,
    False when ``x`` does not qualify (the caller takes :func:`allreduce_views`). Qualifies: a
    C-contiguous array of a reducible dtype that the one-shot takes (and not a piece of a shared
    array the shared algorithm takes), with no async collective pending. ``ckind``: float32 sent
    as 16-bit; ``sig_shape``: the shape the signature names (default ``x.shape``). Same
    signature and step accounting as the general path, so ranks may mix the two."""
    # The signature's shape is part of the plan (the call's signature is made once, here).
    key = (x.dtype, x.shape, op, coll, ckind, g.pinned.get("allreduce") if g.pinned else None, sig_shape)
    plan = g.small_plans.get(key)
    if plan is None:
        plan = _keep_plan(g, key, _small_plan(g, x.dtype, x.size, op, coll, ckind,
                                              x.shape if sig_shape is None else sig_shape))
    if not plan or g.executor.pending or not x.flags.c_contiguous:
        return False
    if not ckind and _shared_may_take(g, x.nbytes) and g.shm.locate(x) is not None:
        return False  # the shared algorithm's, sync or async alike (NOTE [algorithm selection] 6)
    call, as16, request, algorithm = plan
    flat = x if x.ndim == 1 else x.reshape(-1)
    if as16:
        flat = flat.view(np.uint16)
    return _run_small(g, call, request, algorithm, coll, x.nbytes, flat, flat)


def _keep_plan(g, key: tuple, plan):
    """``plan`` kept on ``g`` for the latency paths' later calls like this one (False: such
    calls do not take them), at most about a thousand kept."""
    entries = g.small_plans
    if len(entries) > 1024:
        entries.clear()
    entries[key] = plan
    return plan


def _run_small(g, call, request: Request, algorithm: str, coll: str, nbytes: int, *args) -> bool:
    """A latency path's ``call(*args)`` in the caller's thread, when no async collective is
    pending (False: nothing ran), spanned on the timeline and logged as the general path's
    would be. Every step here is paid per call by the smallest collectives: no closure, one
    lock."""
    if timeline.enabled():
        call = _spanned(call, coll, nbytes, algorithm)
    if not g.executor.run_if_idle(call, *args):
        return False
    if g.algorithm_log is not None:
        _ran(g, request, algorithm)
    return True


def small_lane(g, x: np.ndarray, op: int):
    """The latency path's fast lane, after :func:`allreduce_small` took ``x`` (``comm.allreduce``
    in place of a NumPy array, op code ``op``): ``lane(y) -> bool``, which does for arrays ``y``
    of ``x``'s dtype and shape what :func:`allreduce_small` would, with what does not change
    between such calls looked up once (the plan, its kernels, the message's parts). False where
    ``y`` does not qualify, or while an async collective is pending, the timeline records or
    the group logs algorithms: the caller then takes :func:`allreduce_small`. None where ``x``
    has no lane: a 16-bit format (passed as its bits), a size the shared algorithm may take,
    a read-only array. Where emulated nodes share cores every rank's Python is the others'
    wall time, several times over (NOTE [one-shot across nodes] 7 in
    comm/algorithms/oneshot_nodes.py), so this is what the smallest allreduces pay per call."""
    key = (x.dtype, x.shape, op, "allreduce", 0, g.pinned.get("allreduce") if g.pinned else None, None)
    plan = g.small_plans.get(key)
    if not plan or plan[1] or _shared_may_take(g, x.nbytes) or not x.flags.writeable:
        return None
    call = plan[0]
    how, run, executor = call.in_place(x.reshape(-1)), call.run, g.executor

    def lane(y: np.ndarray) -> bool:
        flags = y.flags
        if (executor.pending or not (flags.c_contiguous and flags.writeable) or timeline.enabled()
                or g.algorithm_log is not None):
            return False
        flat = y if y.ndim == 1 else y.reshape(-1)
        return executor.run_if_idle(run, flat, flat, how)

    return lane


def _spanned(call, coll: str, nbytes: int, algorithm: str):
    def spanned(*args):
        with timeline.span("comm", coll, args={"bytes": nbytes, "path": algorithm}):
            call(*args)

    return spanned


def _small_plan(g, dtype: np.dtype, size: int, op: int, coll: str, ckind: int, shape: tuple):
    """(the one-shot call with everything but the arrays fixed, whether the array is passed as
    uint16 bits, the request), or False when such an allreduce does not take the latency path."""
    name = dtype.name
    kind = ckind or (F16 if name == "float16" else 0)
    rows_dtype = np.dtype(np.uint16) if kind else dtype
    request = Request("allreduce", size * rows_dtype.itemsize, kind)
    if (g.size == 1 or g.pinned.get("allreduce") not in (None, "oneshot", "oneshot_nodes")
            or name not in ("float32", "float64", "int32", "int64", "float16")
            or (ckind and name != "float32")):
        return False
    algorithm = select(g, request)
    if algorithm not in ("oneshot", "oneshot_nodes"):
        return False
    sig = g.signature_of(coll, op, name, size, tuple(shape), -1, code_of(algorithm))
    check = functools.partial(g.mismatch, coll)
    if algorithm == "oneshot":
        call = oneshot.plan(g.shm, rows_dtype, op, kind, coll, sig, check)
    else:
        call = oneshot_nodes.plan(g.shm, rows_dtype, op, kind, coll, sig, check, g.size)
    return call, bool(kind and not ckind), request, algorithm


_U8 = np.dtype(np.uint8)  # the one-shot copies' view of every dtype (NOTE [one-shot copies] 3)


def gather_small(g, x: np.ndarray, make_out, root: int = -1):
    """The latency path of a sync allgather (``root`` -1) or gather of ``x`` on ``g``: the
    result made by ``make_out((size, *x.shape))`` (a new array of x's dtype, or a tensor, and
    its NumPy view: ``(result, view)``), filled where this rank receives it, once done here;
    None when ``x`` does not qualify and nothing ran (the caller takes the general path).
    Qualifies: a C-contiguous array of a dtype comm moves that the one-shot takes, with no
    async collective pending (NOTE [one-shot copies] in comm/algorithms/oneshot.py)."""
    coll = "gather" if root >= 0 else "allgather"
    plan = _copy_plan(g, coll, x, root)
    if not plan or g.executor.pending or not x.flags.c_contiguous:
        return None
    call, request = plan
    result, view = make_out((g.size, *x.shape))
    src = (x if x.ndim == 1 else x.reshape(-1)).view(_U8)
    if view.ndim != 2:
        view = view.reshape(g.size, -1)
    return result if _run_small(g, call, request, "oneshot", coll, x.nbytes, src, view.view(_U8)) else None


def reduce_scatter_small(g, x: np.ndarray, op: int, make_out):
    """The latency path of a sync reduce-scatter of ``x`` (op code ``op``) on ``g``: this rank's
    part (np.array_split's) in ``make_out((part,))`` (as :func:`gather_small`'s), or None
    when ``x`` does not qualify: a C-contiguous array of a reducible dtype that the one-shot
    takes (NOTE [one-shot copies] 6 in comm/algorithms/oneshot.py), no async call pending."""
    pin = g.pinned.get("reduce_scatter") if g.pinned else None
    key = ("reduce_scatter", x.dtype, x.shape, op, pin)
    plan = g.small_plans.get(key)
    if plan is None:
        plan = _keep_plan(g, key, _make_reduce_scatter_plan(g, x, op))
    if not plan or g.executor.pending or not x.flags.c_contiguous:
        return None
    call, request, count, as16 = plan
    result, view = make_out((count,))
    src = x if x.ndim == 1 else x.reshape(-1)
    if as16:
        src, view = src.view(np.uint16), view.view(np.uint16)
    return result if _run_small(g, call, request, "oneshot", "reduce_scatter", x.nbytes, src, view) else None


def _make_reduce_scatter_plan(g, x: np.ndarray, op: int):
    """(the one-shot with this rank's part fixed, its request, the part's length, whether the
    arrays go as uint16 bits), or False: the general path's call, signature included."""
    name = dtype_name(x.dtype)
    kind = F16 if name == "float16" else 0
    request = Request("reduce_scatter", x.nbytes, kind)
    if (g.size == 1 or name not in ("float32", "float64", "int32", "int64", "float16")
            or select(g, request) != "oneshot"):
        return False
    lo, count = _part(x.size, g)
    sig = g.signature_of("reduce_scatter", op, name, x.size, tuple(x.shape), -1, code_of("oneshot"))
    rows_dtype = np.dtype(np.uint16) if kind else x.dtype
    call = oneshot.plan(g.shm, rows_dtype, op, kind, "reduce_scatter", sig,
                        functools.partial(g.mismatch, "reduce_scatter"), lo)
    return call, request, count, bool(kind)


def _part(n: int, g) -> tuple[int, int]:
    """(first element, length) of this rank's part of ``n`` elements, as np.array_split makes
    them (what comm.reduce_scatter returns)."""
    q, extra = divmod(n, g.size)
    return g.rank * q + min(g.rank, extra), q + (g.rank < extra)


def broadcast_small(g, x: np.ndarray, root: int) -> bool:
    """The latency path of a sync broadcast of ``x`` (in place) from ``root`` on ``g``: True when
    done here, False when ``x`` does not qualify (as :func:`gather_small`). A read-only ``x``
    off the root raises ValueError once the call is done (the plan's, comm/algorithms/oneshot.py)."""
    plan = _copy_plan(g, "broadcast", x, root)
    if not plan or g.executor.pending or not x.flags.c_contiguous:
        return False
    call, request = plan
    flat = (x if x.ndim == 1 else x.reshape(-1)).view(_U8)
    return _run_small(g, call, request, "oneshot", "broadcast", x.nbytes, flat)


def _copy_plan(g, coll: str, x: np.ndarray, root: int):
    """(the one-shot copy with everything but the arrays fixed, its request) for ``coll`` of
    arrays like ``x`` from ``root``, or False where those do not take the one-shot; made once
    per (collective, dtype, shape, root, pin) and kept with the latency path's plans."""
    pin = g.pinned.get(coll) if g.pinned else None
    key = (coll, x.dtype, x.shape, root, pin)
    plan = g.small_plans.get(key)
    return _keep_plan(g, key, _make_copy_plan(g, coll, x, root)) if plan is None else plan


def _make_copy_plan(g, coll: str, x: np.ndarray, root: int):
    name = dtype_name(x.dtype)
    request = Request(coll, x.nbytes, F16 if name == "float16" else 0)
    if g.size == 1 or name is None or select(g, request) != "oneshot":
        return False
    # The signature of the general path's call for the same array (its Buffer: 16-bit floats
    # counted as their uint16 bits, the same count), so ranks may mix the two.
    sig = g.signature_of(coll, 0, name, x.size, tuple(x.shape), root, code_of("oneshot"))
    check = functools.partial(g.mismatch, coll)
    if coll == "broadcast":
        return oneshot.broadcast_plan(g.shm, sig, check, root), request
    return oneshot.gather_plan(g.shm, coll, sig, check, root), request


# -- the other collectives: the one-rank shortcut and the agreement, once; then the data -------
def _agreed(g, coll: str, op: int, buf, root: int, r: Request, name: str | None = None) -> str:
    """Select for ``r`` (unless the caller did: ``name``), publish a single-copy call's
    addresses, agree; the algorithm's name."""
    if name is None:
        name = select(g, r)
    if name == "single_copy":
        flat = buf.flat
        if not flat.flags.c_contiguous:  # not postable: every rank agrees on the path by signature
            name = "segment"
        else:
            g.shm.post_single_copy(flat, flat)
    _ran(g, r, name)
    g.agree_signature(coll, g.signature(coll, op, buf, root, name))
    return name


def _own(g, name: str):
    return g.mpi if name == "mpi" else g.gloo


def broadcast(g, buf, root: int) -> None:
    """``buf`` (comm/buffers.py) of ``root`` into ``buf`` of every rank of ``g``."""
    if g.size > 1:
        r = Request("broadcast", buf.flat.nbytes, buf.kind)
        name = select(g, r)
        if name == "oneshot":  # its agreement is in its one board step (NOTE [one-shot copies])
            _ran(g, r, name)
            sig = g.signature("broadcast", 0, buf, root, name)
            oneshot.broadcast_plan(g.shm, sig, functools.partial(g.mismatch, "broadcast"), root)(
                buf.flat.view(np.uint8))
            return
        name = _agreed(g, "broadcast", 0, buf, root, r, name)
        flat = buf.flat
        refused = g.rank != root and not flat.flags.writeable
        if refused:  # take part into a copy, so the peers complete the call, then refuse
            flat = np.empty_like(flat)
        if name == "segment":
            segment.broadcast(g.shm, flat, root)
        else:
            native.broadcast(_own(g, name), flat, root)
        if refused:
            raise ValueError(f"broadcast: x is read-only on rank {g.rank}, which receives rank {root}'s "
                             f"data (the peers completed the call)")


def allgather(g, buf, out: np.ndarray, root: int = -1) -> None:
    """out: (size, n) flat rows; ``root`` >= 0 makes it a gather (only root fills out)."""
    if g.size == 1:
        out[0] = buf.flat
        return
    coll = "gather" if root >= 0 else "allgather"
    r = Request(coll, buf.flat.nbytes, buf.kind)
    name = select(g, r)
    if name == "oneshot":  # NOTE [one-shot copies]
        _ran(g, r, name)
        sig = g.signature(coll, 0, buf, root, name)
        oneshot.gather_plan(g.shm, coll, sig, functools.partial(g.mismatch, coll), root)(
            buf.flat.view(np.uint8), out.view(np.uint8))
        return
    name = _agreed(g, coll, 0, buf, root, r, name)
    if name == "single_copy":
        single_copy.allgather(g.shm, buf.flat, out, root)
    elif name == "segment":
        segment.allgather(g.shm, buf.flat, out, root)
    else:
        native.allgather(_own(g, name), buf.flat, out, root)


def scatter(g, full, out: np.ndarray, root: int) -> None:
    """full: (size * n) on every rank (read on root only); out: this rank's n elements."""
    if g.size == 1:
        out[...] = full.flat[:out.shape[0]]
        return
    name = _agreed(g, "scatter", 0, full, root, Request("scatter", out.nbytes, full.kind))
    if name == "segment":
        segment.scatter(g.shm, full.flat, out, root)
    else:
        native.scatter(_own(g, name), full.flat, out, root)


def reduce_scatter(g, buf, out: np.ndarray, op: int) -> None:
    """out: this rank's part (np.array_split over ranks) of the reduced flat buffer."""
    if g.size == 1:
        out[...] = buf.flat
        return
    r = Request("reduce_scatter", buf.flat.nbytes, buf.kind)
    name = select(g, r)
    if name == "oneshot":  # this rank's part of the one-shot allreduce (NOTE [one-shot copies] 6)
        _ran(g, r, name)
        flat = buf.flat
        lo, _ = _part(flat.shape[0], g)
        sig = g.signature("reduce_scatter", op, buf, -1, name)
        oneshot.reduce_scatter(g.shm, flat, out, flat.dtype, op, buf.kind, sig,
                               functools.partial(g.mismatch, "reduce_scatter"), lo)
        return
    name = _agreed(g, "reduce_scatter", op, buf, -1, r, name)
    if name == "single_copy":
        single_copy.reduce_scatter(g.shm, buf.flat, out, op)
    elif name == "segment":
        segment.reduce_scatter(g.shm, buf.flat, out, op, buf.kind)
    else:
        native.reduce_scatter(_own(g, name), buf.flat, out, op, buf.kind)


def reduce(g, buf, op: int, root: int) -> None:
    """``buf`` of ``root`` = op over every rank's ``buf``; the others' ``buf`` is unchanged."""
    if g.size == 1:
        return
    name = _agreed(g, "reduce", op, buf, root, Request("reduce", buf.flat.nbytes, buf.kind))
    tmp = buf.flat if g.rank == root else np.empty_like(buf.flat)
    _run_allreduce(g, name, Fused([buf.flat]), Fused([tmp]), op, buf.flat.dtype, buf.kind, 0, root, NO_GATE)


def barrier(g) -> None:
    """Every rank of ``g`` entered before any leaves: the agreement, then (over MPI) MPI's own."""
    if g.size > 1:
        name = _agreed(g, "barrier", 0, None, -1, Request("barrier"))
        if name in ("mpi", "gloo"):
            native.barrier(_own(g, name))
        # segment: on one node the agreement was the barrier (every rank published, every rank
        # waited for all); across nodes "barrier" selects MPI's own.



# -- point to point: MPI's or Gloo's own ------------------------------------------------------
def send(g, buf, dest: int, tag: int) -> None:
    """``buf`` (comm/buffers.py) to rank ``dest`` of ``g``; blocking."""
    _p2p(g, "send").send(buf.flat, dest, tag)


def recv(g, buf, source: int, tag: int) -> None:
    """Into ``buf`` from rank ``source`` of ``g``; blocking."""
    _p2p(g, "recv").recv(buf.flat, source, tag)


def _p2p(g, what: str):
    if g.size == 1:
        raise CommError(f"{what}: a lone process has no peer")
    t = g.gloo or g.mpi
    if t is None:
        raise CommError(f"{what}: point-to-point needs MPI or Gloo; this group has shared memory only")
    return t
