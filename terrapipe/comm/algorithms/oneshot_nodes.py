"""The one-shot across nodes: a small allreduce over several nodes and its agreement in two
meetings, a board step on each node and one exchange between nodes, where the hierarchical
path takes an agreement of its own and then three more (the segment in, an allreduce between
nodes per part, the segment out). Each meeting costs a scheduling round trip where ranks
outnumber cores, a network round trip between nodes, so the count is the latency.

NOTE [one-shot across nodes]
    1. Each rank writes its data into its row of the node's segment (a row half, NOTE [row
       halves] in comm/transports/shm.py) and publishes its signature on the board: one step.
    2. Each local rank j then reduces its part of the message (:func:`part_of`: elements [j *
       part, (j + 1) * part)) over every local row, in local rank order, into its message to
       the other nodes (the payload after the table in its inbox row, NOTE [agreement across
       nodes] in comm/transports/shm.py): the node's partial of that part. Steps 1 and 2 are
       the one-shot's compiled kernel (kernels/oneshot.py), its output never divided.
    3. Each rank sends its node's signatures and its part's partial to the ranks of its own
       local rank on the other nodes and receives theirs into their inbox rows: every
       signature of the group is checked on every rank before any result is written,
       whatever sizes the ranks passed.
    4. Every rank combines the nodes' partials of its part in node order, straight from the
       inbox rows, into its own row's columns of that part (into the output on nodes of one
       rank, where there is nothing more to do). Every rank of the group gets the same bits
       (16-bit formats: accumulated in float32 within a node and across nodes, rounded once
       per node and once at the end).
    5. On nodes of several ranks, a second board step; then every rank copies each local
       rank's part out of that rank's row (kernels/oneshot.py ``collect``). Safe without more:
       until that step a rank's part columns are read by itself only (step 2 reads each part
       in its own rank's process), and a rank writes the row half again two calls later,
       after the next call's first step, which no local rank reaches before it finished
       copying this call's parts out (NOTE [row halves]).
    6. What it costs: each rank reads local_size rows of its part and sends the part to each
       other node, so a node's link carries n bytes per other node in all (before parts, every
       rank sent the whole message: local_size x n, twice MPICH's 2 x 2 traffic from 4 KiB).
       Among three nodes, or more but not a power of two, the exchange is all to all, (nodes -
       1) x n per link; among four, eight, ... it goes by recursive doubling (clause 8),
       log2(nodes) x n, where a ring sends about 2n: either way it wins for small messages
       only (ONESHOT_NODES_BYTES; more between two nodes, where it sends what a ring does,
       and where the compiled exchange may reduce-scatter, 1.5 x n at four nodes as MPICH's
       allreduce: clause 10; NOTE [algorithm selection] 4 in comm/select.py).
    7. Python's part is paid per call by the smallest allreduces, on every rank, and where
       emulated nodes share a machine's cores every rank's pays for the others': a call is a
       plan per signature (:func:`plan`, as the one-shot's, taken by the latency path of
       comm/select.py too), two or three compiled calls and the exchange (receives posted
       first, then polled with the sends in one MPI call a poll). Over emulated 1gbit links on
       two cores (4 KiB float32, 2 nodes x 1), the general path, probing each arrival, took
       101 us a call where MPICH's allreduce took 33; this one 45.5 against 38.5. The exchange
       itself, its polls and its reductions on the way now run in compiled code (NOTE [MPI
       from compiled code] in comm/transports/mpi_native.py), and with MPI's C API reached
       from compiled code the whole call is one compiled call (:func:`_fused`), Python only
       where it stops (a late peer, a mismatch): at 2 nodes x 2 ranks on two cores a 4 KiB
       call took 110 us of CPU per rank before, 65 with the exchange compiled, 48-53 fused,
       MPICH's allreduce 43-53 in the same runs. There a microsecond of Python a call costs
       several of wall time: at 4 nodes x 1 over 2.5gbit, 8 KiB, the compiled call alone took
       0.55-0.58 of MPICH's time, the same call through ``comm.allreduce`` 0.69-0.79 when the
       Python around it took ~4.5 us (its 16 fixed arrays alone 2.3 us to pass: Numba wraps
       each one per call). So they travel in one :class:`_Fixed` (0.6 us), a call of a size
       already seen looks up how it runs once (``in_place``), and ``comm.allreduce`` of a NumPy
       array takes the latency path's fast lane (comm/select.py ``small_lane``): 0.64-0.67.
       Over 1gbit, 4 / 8 KiB against MPICH's allreduce, interleaved: 1.05 / 1.03 before, 0.73
       / 0.79 after.
    8. Among a power of two of at least four nodes, step 3 is recursive doubling (NOTE
       [agreement across nodes] 3 in comm/transports/shm.py): after each round this rank's
       partial becomes its half's, the two halves' partials combined lower half first
       (``finish`` over the round's two messages), so both ranks of a round, and in the end
       every rank, hold the same bits; step 4 then only divides (avg) and writes this node's
       row. 16-bit formats round once per round here (float32 within a round). At 4 nodes x 1
       over 1gbit (Xeon, 2 cores), us against MPICH's allreduce at 16 / 32 KiB: 335 / 553
       against 188 / 412, where the exchange to all took 419 / 826 against 203 / 412; at 64
       KiB it lost to the hierarchical ring (1102 against 956), so the limit among more than
       two nodes stays ONESHOT_NODES_BYTES. From a payload measured on the links when the
       group is made, the compiled exchange reduce-scatters the partials and allgathers them
       instead (NOTE [MPI from compiled code] 8-9): the same bits on every rank, 1.5 x n per
       link at 4 nodes.
    9. Up to ONESHOT_WHOLE_BYTES, on nodes of several ranks, every local rank carries the whole
       message instead of its part (step 2 reduces every element, step 4 writes the output),
       and step 5 goes: its second meeting of the node's ranks cost more than the link's extra
       bytes (local_size x n per link, not n). Safe without it: a rank reads the rows only in
       step 2, before the exchange, and the rows' half is written again only two calls later,
       after the next call's first step (NOTE [row halves]).
    10. Between two nodes of several ranks each it takes messages up to a row half
       (``ONESHOT_NODE_PAIR_BYTES``, 2 MiB at two ranks a node), not only small ones: there
       each part crosses the link once, as in a ring, and the node meets twice where the
       hierarchical path meets four times (its agreement, the segment in, the part's
       allreduce between nodes, the segment out) and the single copy from a chunk's barrier
       on; where four ranks share two cores every meeting is a scheduling round. Over 10gbit
       it took 0.46-0.76x the hierarchical segment's time from 256 KiB to 2 MiB and 0.45-0.74x
       MPICH's, over 2.5gbit 0.76-0.95x and 0.64-0.92x, over 1gbit level (the link's pace).
       The inbox's rows are that much wider there (``PAIR_PAYLOAD_BYTES`` in
       comm/transports/shm.py: 4 MiB a rank). Among a power of two of four or more nodes,
       whose compiled exchange reduce-scatters and allgathers the partials (1.5 x n per link
       at four nodes, as MPICH's allreduce), up to ``ONESHOT_DOUBLING_BYTES`` (1 MiB since
       clause 11; 512 KiB before) where the inbox stays within 4 MiB a rank (``payload_bytes``
       in comm/transports/shm.py: 1 MiB among four nodes, 512 KiB among eight): at
       4 nodes x 1 from 128 to 512 KiB it took 0.56-0.97x the time of the agreement followed by
       MPI's own allreduce or our ring, level with MPICH's over 2.5gbit from 256 KiB (1.2x at
       128 KiB), 1.3-1.4x MPICH's over 10gbit, where the agreement and MPI's own took
       1.5-2.5x.
    11. On nodes of one rank, in place, where the payload reduce-scatters between nodes (NOTE
       [MPI from compiled code] 8-10 in comm/transports/mpi_native.py) and ``dst`` is a
       C-contiguous array of the payload's dtype, steps 1, 2 and 4 copy nothing: the node's
       step only publishes the signature (a node of one has no row to share), the exchange
       reads ``dst`` and writes its result there once every table agrees, and avg divides it
       in place. Before, the message went into the row, out of it into the payload, and from
       the payload into ``dst``: three of the 4.5 copies a call beyond MPICH's allreduce that
       made 256 KiB at 4 nodes x 1 over 10gbit take 1.37x its time (now 1.13x).
    12. There the inbox may be wider (a node holds one, not one per local rank:
       ``shm.INBOX_ALONE_BUDGET_BYTES``), so among four nodes the one-shot takes up to 2 MiB
       (``ONESHOT_DOUBLING_ALONE_BYTES``), where MPICH's allreduce too reduce-scatters and
       allgathers by halves and our ring took six steps after its agreement: 2 MiB at 4 nodes
       x 1 over 10gbit went from 1.12-1.33x MPICH's time to 0.99-1.03x, level over slower
       links (at 4 MiB the ring's steps ran faster than rounds of halves over those). A call
       out of place still goes through the row and the payload. Copying ``src`` into ``dst``
       and running in place there, as MPICH's allreduce does, took 1.21x MPICH's time at 2
       MiB over 10gbit where the row's way took 1.41x (probes, a copy back included), but a
       rank then compiles ``_fused`` on its first call out of place too: where ranks mix the
       two ways, both compile it at once on a first run (13 s more of a cold test at 2 nodes).
    13. Between machines without MPI (a torchrun job: NOTE [machines over Gloo] in
       comm/group.py) the exchange runs around the TCP ring of each local rank, every message
       framed with its length (NOTE [a ring over TCP] 8 in comm/transports/tcp.py), and steps
       1-4 are again one compiled call (:func:`_fused_tcp`), the ring's schedule run by
       ``tcp_native.advance`` inside it. It waits for the exchange at most ``_TCP_FUSED_NS``
       (2 ms) and then leaves the rest to the transport in Python (``agree_tables``, which
       goes on with the schedule where it stands: NOTE [a ring's schedule in compiled code] 8
       in comm/transports/tcp_native.py), which marks this rank waiting afar, keeps the
       timeout and names a lost peer; a failed stream takes the same way, to be named there.
       Among a power of two of four or more machines the exchange goes by recursive doubling
       over streams of its own (NOTE [a ring over TCP] 9), the partials reduced on the way
       (clause 8), inside the same compiled call. Machines of one rank get a segment of one
       (NOTE [machines over Gloo] 8), so they take it too. At 4 x 1 over 1gbit (AMD EPYC,
       2026-12-02), us at 4 / 16 KiB: before, the agreement and the ``tcp`` path, 684-727 /
       745; around the ring's allgather 208-245 / 412; by recursive doubling 92-102 / 273-276,
       where MPI's one-shot took 80-135 / 200-231 in runs of the same hour. Whole rounds
       carry 2 x n a link among four, the ring 1.5 x n, so the one-shot stopped at
       ``ONESHOT_NODES_BYTES`` (pinned, at 32 KiB 550 us against the ``tcp`` path's 1090, at
       64 KiB level, 1095 / 873-1060). From a payload measured when the group is made the
       rounds now go by halves (NOTE [a ring's schedule in compiled code] 10), 1.5 x n a
       link as the ring's, so among such machines it takes up to
       ``ONESHOT_DOUBLING_TCP_BYTES``: at 4 x 1 over 1gbit (AMD EPYC, 2026-12-03) 32 KiB
       408-432 us (was 538-545 whole), 64 KiB 805-819 (the links' bound 786) against the
       ring's 1211-1461. Before, such a job agreed over the ring and then ran the hierarchical
       segment: at 2 machines x 2 over 1gbit (AMD EPYC, 2 cores, 2026-12-02; 4 KiB, median of
       400 calls, rank 0) 239 us a call, where MPI's one-shot took 60; with the one-shot over
       the ring, around the compiled call in Python 82 us, in one compiled call 58-65, MPI's in
       the same hour 66-68. At 2x2 over 10gbit, pinned and interleaved, the one-shot against
       the segment, us at 64 KiB / 256 KiB / 1 MiB / 2 MiB: 110-120 / 316-351, 343-388 /
       534-762, 1566-1812 / 1745-2186, 3283-3793 / 3415-3446: so the limit between two
       machines stays a row half (``ONESHOT_NODE_PAIR_BYTES``).

Why one module: the limits (with the measurements that set them), the plan per signature, the
compiled call and the Python around it are one algorithm whose clauses cite each other; split,
the limits would sit away from the steps whose cost they weigh.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit, types
from numba.core.extending import overload
from numba.experimental import structref

from ...kernels import entry_point
from ...kernels import oneshot as koneshot
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from ..transports import mpi_native, tcp_native
from ..transports.board import ROUND_SPINS, SIG_WORDS, TABLE_COLS, YIELDS
from ..transports.mpi import NATIVE_SPINS
from .oneshot import ONESHOT_SPINS

__all__ = ["allreduce", "plan", "limit", "part_of", "ONESHOT_NODES_BYTES", "ONESHOT_TWO_NODES_BYTES",
           "ONESHOT_NODE_PAIR_BYTES", "ONESHOT_DOUBLING_BYTES", "ONESHOT_DOUBLING_ALONE_BYTES",
           "ONESHOT_DOUBLING_TCP_BYTES",
           "ONESHOT_WHOLE_BYTES"]

# Measured over emulated 1gbit links on two cores (float32 sum; each algorithm pinned, rounds
# interleaved), us at 4 / 16 / 32 / 64 KiB, before the latency path and the per-rank parts: at
# 2 nodes x 2 ranks the one-shot across nodes 397 / 517 / 568 / 1109, the hierarchical segment
# 633 / 921 / 934 / 970, MPI's own allreduce after the agreement 630 / 809 / 918 / 794; at 4 x 1
# 597 / 658 / 827 / 1654 against 1117 / 1106 / 1221 / 897 and 1059 / 923 / 1106 / 810. Among
# more than two nodes the exchange is all to all and loses at 64 KiB (clause 6).
ONESHOT_NODES_BYTES = 32 << 10
# Between two nodes each part crosses a link once, as in a ring (clause 6), so the one-shot
# leads further: 2 nodes x 2 over 1gbit (Xeon, 2 cores; pinned, rounds interleaved), us at 32 /
# 64 / 128 / 256 KiB: 378 / 542 / 1102 / 2188, the hierarchical segment 823 / 848 / 1081 / 2201.
# So does it among a power of two of four or more nodes where the compiled exchange may
# reduce-scatter (clause 8): at 4 x 1 against MPICH's allreduce (interleaved, 2026-11-27), over
# 2.5gbit 64 KiB 329 / 326 us where the hierarchical path (the agreement, then MPI's own) took
# 654 / 325, over 1gbit 48 / 64 KiB 621 / 615 and 824 / 820. Between two nodes of several ranks
# and among such a power of two it now goes further (ONESHOT_NODE_PAIR_BYTES,
# ONESHOT_DOUBLING_BYTES); this one is left to two nodes of one rank.
ONESHOT_TWO_NODES_BYTES = 64 << 10
# Between two nodes of several ranks each, up to a row half (clause 10). 2 nodes x 2 (Xeon, 2
# cores; pinned, 7 rounds interleaved, 2026-11-27), us at 256 KiB / 1 MiB / 2 MiB, the one-shot
# / the hierarchical segment / MPICH's allreduce: over 10gbit 489 / 1053 / 661, 1693-1839 /
# 2260-2432 / 3510-3544, 3717 / 5625 / 8273 (the single copy 4366); over 2.5gbit 863 / 1131 /
# 941, 3714-3779 / 4143-4210 / 5268-5307, 8373-8623 / 8947-9043 / 12141-13107 (single copy
# 9046); over 1gbit level with both (the link's pace) to 1 MiB, 18.3 / 18.6 / 22.1 ms at 2
# MiB. Between nodes of one rank it lost to MPI's own from 256 KiB over 10gbit (2 MiB 2661 /
# 1899 us), so there it stays at ONESHOT_TWO_NODES_BYTES.
ONESHOT_NODE_PAIR_BYTES = 2 << 20
# Among a power of two of four or more nodes whose exchange is compiled (clause 10). 4 nodes x 1
# (Xeon, 2 cores; pinned, 7 rounds interleaved, 2026-11-27), us at 128 / 256 / 512 KiB / 1 MiB,
# the one-shot / the agreement then MPI's own / our ring after it / MPICH's allreduce: over
# 2.5gbit 779 / 804 / 1011 / 650, 1308 / 1954 / 1525 / 1315, 2633 / 3411 / 3060 / 2634, 5721 /
# 6805 / 5853 / 5270; over 10gbit 455 / 810 / 1082 / 322, 833 / 1148 / 1554 / 641, 1550 / 1699 /
# 2236 / 1165, 3521 / 3316 / 3732 / 2559; over 1gbit all at the link's pace (512 KiB 6591 /
# 10820 / 6593 / 6589). From 1 MiB the agreement then MPI's own led over 10gbit. Once the
# one-shot copied nothing on nodes of one rank (clause 11), 1 MiB too (pinned probes, one run
# each way, us, ours / MPICH's): over 10gbit 3318 / 3370 where the limit at 512 KiB left it to
# the agreement and MPI's own, 3610 / 2855; over 2.5gbit 5312 / 5268 against 5823 / 5300. The
# inbox's budget (shm.INBOX_BUDGET_BYTES) allows no more among four nodes.
ONESHOT_DOUBLING_BYTES = 1 << 20
# The same on nodes of one rank, whose inbox may be wider (shm.INBOX_ALONE_BUDGET_BYTES; clause
# 12). 4 nodes x 1 (Xeon, 2 cores; 6-10 calls a round, 7 rounds interleaved with MPICH's
# allreduce, each limit in its own runs, 2026-11-27), our time over MPICH's at 2 / 4 MiB, in
# place, where our ring took them after the agreement / by the one-shot: over 10gbit
# 1.12-1.33 / 1.13-1.33 and 0.99-1.03 / 0.97-1.00; over 2.5gbit 1.05 / 0.85 and 1.00 / 1.04;
# over 1gbit 0.99 / 0.85 and 1.00 / 1.01. Both at the links' bound at 2 MiB over 1gbit; at 4
# MiB over slow links rounds of halves (MPICH's too) fall behind the ring's steps (over 1gbit
# the ring at 95% of the bound, allreduce_cluster_4x1_1gbit_2026-11-27_6.json, the one-shot at
# 74% in a run with a trial limit of 4 MiB), so the one-shot stops at 2 MiB.
ONESHOT_DOUBLING_ALONE_BYTES = 2 << 20
# Among a power of two of four or more machines over TCP (clause 13), where the exchange may
# reduce-scatter and allgather (NOTE [a ring's schedule in compiled code] 10 in
# comm/transports/tcp_native.py). 4 machines x 1 under torchrun (AMD EPYC, 2 cores; pinned, 7
# rounds interleaved, 2026-12-03), us at 64 / 128 / 256 KiB, the one-shot by halves / the TCP
# ring: over 1gbit 814-819 / 1211-1224, 1646-3847 / 1636-1725, 3277-6868 / 3287-3403; over
# 2.5gbit 436 / 1166, 926 / 1177, 1313-3163 / 1407; over 10gbit 390 / 1114, 573 / 1195, 931 /
# 1494. From 128 KiB, where a round's message is 64 KiB or more each way at once, some calls
# over 1gbit stall for 10-150 ms in the kernel's TCP (no packet dropped; not SO_RCVLOWAT: the
# same with it at one byte), and the ring, one way on each stream, does not. The stalls are
# delayed ACKs: benchmarks/results/halves_tail_4x1_1gbit{,_quickack}_2026-12-03.json (python -m
# benchmarks.halves_tail, AMD EPYC family 25 model 17, 2 cores; 900 calls a case and size,
# interleaved, rank 0), halves / ring at 128 KiB: median 1.647 / 1.658 ms, p99 82.4 / 5.7, 68 /
# 10 calls over 5 ms, 13 / 1 tail-loss probes; at 256 KiB median 3.319 / 3.306, p99 124.6 /
# 10.1, 35 / 0 probes. With every node's route set to quickack (every ACK at once, set from
# outside) no probe, and halves p99 4.0 ms at 128 KiB, 6.1 at 256, at the same medians. From
# the sockets nothing tried removed them (TCP_QUICKACK at each read and before each wait; two
# streams a round, one each way, as the ring's; both), so the limit stays: above it halves
# and the ring carry the same bytes (1.5 x n a link at 4 machines) at equal medians.
ONESHOT_DOUBLING_TCP_BYTES = 64 << 10
# At most this many bytes every local rank carries the whole message (clause 9). 2 nodes x 2
# over 1gbit (Xeon, 2 cores; both ways interleaved in one run, 7 rounds), time whole / parts:
# 0.81 at 4 KiB, 0.85 at 8 KiB, 1.03 at 16 KiB.
ONESHOT_WHOLE_BYTES = 8 << 10


def limit(shm) -> int:
    """The largest allreduce (bytes as exchanged) the one-shot across nodes takes: half a row
    of the node's segment, and at most ``ONESHOT_NODE_PAIR_BYTES`` between two nodes of
    several ranks (clause 10), ``ONESHOT_DOUBLING_BYTES`` among a power of two of four or more
    whose exchange is compiled (and so may reduce-scatter; clause 10; on nodes of one rank
    ``ONESHOT_DOUBLING_ALONE_BYTES``, clause 12),
    ``ONESHOT_DOUBLING_TCP_BYTES`` among such a power of two of machines over TCP (clause 13),
    ``ONESHOT_TWO_NODES_BYTES`` between two nodes of one rank, ``ONESHOT_NODES_BYTES`` among
    others; never past what the exchange's messages carry (``shm.payload_bytes``)."""
    cross = shm.cross
    if cross is not None and cross.size == 2 and shm.local_size > 1:
        most = ONESHOT_NODE_PAIR_BYTES
    elif cross is not None and cross.doubling and cross.native is not None:
        most = ONESHOT_DOUBLING_ALONE_BYTES if shm.local_size == 1 else ONESHOT_DOUBLING_BYTES
    elif cross is not None and cross.doubling and cross.name == "tcp":
        most = ONESHOT_DOUBLING_TCP_BYTES
    elif cross is not None and cross.size == 2:
        most = ONESHOT_TWO_NODES_BYTES
    else:
        most = ONESHOT_NODES_BYTES
    return min(shm.row_bytes // 2, most, shm.payload_bytes)


def allreduce(shm, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, coll: str,
              sig: np.ndarray, check, size: int) -> None:
    """``dst`` = op over every rank's ``src`` on every node (NOTE [one-shot across nodes]), with
    the agreement on ``sig`` (``check(sigs, ranks)`` raises on a mismatch, on every rank).

    ``src``, ``dst``: 1-D, ``n`` elements of ``dtype`` (the rows' dtype: uint16 holding 16-bit
    format ``kind``, 0 for native dtypes), or float32 over uint16 rows (sent rounded to format
    ``kind``); ``dst`` may be ``src``. At most :func:`limit` bytes exchanged. ``shm``: this
    node's ShmTransport, with its cross-node transport; ``size``: ranks in the group (``avg``
    divides by it). The caller owns both arrays; the rows, the inbox and the scratch row are
    the transport's."""
    plan(shm, dtype, op, kind, coll, sig, check, size)(src, dst)


def plan(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check, size: int):
    """:func:`allreduce` with everything but the arrays fixed: a function ``(src, dst)``, one per
    signature, kept with the one-shot's plans on the transport (NOTE [one-shot across nodes] 7),
    with the attributes ``in_place`` and ``run`` of :func:`terrapipe.comm.algorithms.oneshot.plan`."""
    plans = shm.plans
    key = ("nodes", dtype, op, kind, coll, sig.tobytes())
    made = plans.get(key)
    if made is None:
        if len(plans) > 256:
            plans.clear()
        made = plans[key] = _build(shm, np.dtype(dtype), op, kind, coll, sig, check, size)
    return made


def part_of(n: int, local_size: int) -> int:
    """Elements of an ``n``-element message each local rank carries across nodes (NOTE
    [one-shot across nodes] 2): ``n`` on nodes of one rank, else ceil(n / local_size) rounded
    up to 16 (whole cache lines of float32), so local rank j's part is ``[j * part, (j + 1) *
    part)`` clipped to ``n``, and the last parts may be short or empty."""
    if local_size == 1:
        return n
    return -(-n // (16 * local_size)) * 16


# The longest _fused_tcp waits in compiled code for the exchange before it leaves the rest to the
# transport in Python, which marks this rank waiting afar and keeps the timeout (clause 13).
_TCP_FUSED_NS = 2_000_000

# _fused's answer when the node's ranks had not all arrived within its yields (the caller waits
# for them in Python, then goes on with the exchange): beside the exchange's answers (0-3), for
# MPI's error codes come back negative, and -3 is MPI_ERR_TYPE.
LOCAL_WAIT = 4


@structref.register
class _FixedType(types.StructRef):
    """Numba's type of :class:`_Fixed` (one per dtype and layout of its arrays)."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class _Fixed(structref.StructRefProxy):
    """:func:`_fused`'s arguments that do not change from call to call, in one object (NOTE
    [one-shot across nodes] 7): the one-shot's arrays (the node's rows, the board's table, the
    signature, the scratch row and accumulator), the exchange's (the inbox as bytes, as the
    payload's dtype and as words, the pair as bytes and as that dtype, and the state, config,
    requests, statuses, counts and cells of
    :class:`~terrapipe.comm.transports.mpi_native.Exchange`) and this rank's place (local
    rank, local size, node, the payloads' first element, the table's bytes, op, divisor,
    16-bit format, whether by recursive doubling). Made by :func:`_new_fixed`; every array the
    transport's, only referenced."""


structref.define_boxing(_FixedType, _Fixed)


def _make_fixed(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, cfg, reqs, statuses,
                counts, cells, me, p, node, h0, head, op, divisor, kind, doubling):
    raise NotImplementedError("compiled code only (_new_fixed)")


@overload(_make_fixed)
def _make_fixed_impl(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, cfg, reqs,
                     statuses, counts, cells, me, p, node, h0, head, op, divisor, kind, doubling):
    fields = dict(rows=rows, table=table, sig=sig, scratch=scratch, acc=acc, parts=parts, inbox=inbox,
                  words=words, pair=pair, pair_t=pair_t, st=st, cfg=cfg, reqs=reqs, statuses=statuses,
                  counts=counts, cells=cells, me=me, p=p, node=node, h0=h0, head=head, op=op, divisor=divisor,
                  kind=kind, doubling=doubling)
    fixed_type = _FixedType(list(fields.items()))

    def impl(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, cfg, reqs, statuses,
             counts, cells, me, p, node, h0, head, op, divisor, kind, doubling):
        f = structref.new(fixed_type)
        f.rows, f.table, f.sig, f.scratch, f.acc, f.parts = rows, table, sig, scratch, acc, parts
        f.inbox, f.words, f.pair, f.pair_t, f.st, f.cfg = inbox, words, pair, pair_t, st, cfg
        f.reqs, f.statuses, f.counts, f.cells = reqs, statuses, counts, cells
        f.me, f.p, f.node, f.h0, f.head, f.op, f.divisor, f.kind, f.doubling = (
            me, p, node, h0, head, op, divisor, kind, doubling)
        return f

    return impl


@njit(cache=True)
def _new_fixed(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, cfg, reqs, statuses,
               counts, cells, me, p, node, h0, head, op, divisor, kind, doubling):
    """A :class:`_Fixed` holding these (arrays by reference)."""
    return _make_fixed(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, cfg, reqs,
                       statuses, counts, cells, me, p, node, h0, head, op, divisor, kind, doubling)


def _user_of(dst, partial, direct):
    """(``dst`` as bytes, ``dst``) where the exchange reduces in it (clause 11), else empty
    arrays of those types: chosen when compiled, for only a C-contiguous ``dst`` of the
    payload's dtype can be."""


@overload(_user_of, inline="always")
def _user_of_typed(dst, partial, direct):
    if dst.layout == "C" and dst.dtype == partial.dtype:
        def mine(dst, partial, direct):
            n = dst.shape[0] if direct else 0
            return dst.view(np.uint8)[:n * dst.itemsize], dst[:n]
        return mine
    return lambda dst, partial, direct: (np.empty(0, np.uint8), np.empty(0, partial.dtype))


def _divide_in_place(dst, divisor, kind):
    """``dst /= divisor`` (floor division for integers; 16-bit formats ``kind`` in float32,
    rounded once), chosen when compiled from ``dst``'s dtype."""


@overload(_divide_in_place, inline="always")
def _divide_in_place_typed(dst, divisor, kind):
    if dst.dtype == types.uint16:
        return lambda dst, divisor, kind: kreduce.divide_16(dst, divisor, 0, dst.shape[0], kind)
    if isinstance(dst.dtype, types.Integer):
        return lambda dst, divisor, kind: kreduce.divide_int(dst, divisor, 0, dst.shape[0])
    return lambda dst, divisor, kind: kreduce.divide_float(dst, divisor, 0, dst.shape[0])


@njit(nogil=True, cache=True)
def _divided(dst, divisor, kind):
    """:func:`_divide_in_place`, callable from Python (the exchange finished there)."""
    _divide_in_place(dst, divisor, kind)


@njit(nogil=True, cache=True)
def _node_step(src, partial, rows, h, me, table, col, sig, step, op, kind, scratch, acc, lo, words, node, p):
    """Steps 1-2 of NOTE [one-shot across nodes] for :func:`_fused` and :func:`_fused_tcp`:
    this rank's row and signature published, its part of the node's partial reduced into
    ``partial``, and this node's table (each local rank's signature digest) written into
    ``words[node]``; False where the node's ranks had not all arrived within the yields (the
    caller returns LOCAL_WAIT: steps 1-2 done but for that wait, no table written)."""
    state = koneshot.oneshot_allreduce(src, partial, rows, h, me, table, col, sig, step, op, 1, kind, scratch,
                                       acc, ONESHOT_SPINS, lo)
    if state == koneshot.WAITING:
        if not ksync.yield_until(table[:, 0], step, ROUND_SPINS, YIELDS):
            return False
        if ksync.rows_equal(table[:, col:col + SIG_WORDS]) < 0:
            koneshot.finish(partial, rows, h + lo, op, 1, kind, scratch, acc)
    for r in range(p):  # this node's table: each local rank's signature digest (its rank is set)
        words[node, r * TABLE_COLS] = ksync.sig_digest(table[r, col:col + SIG_WORDS])
    return True


@structref.register
class _FixedTcpType(types.StructRef):
    """Numba's type of :class:`_FixedTcp`."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class _FixedTcp(structref.StructRefProxy):
    """:func:`_fused_tcp`'s arguments that do not change from call to call (clause 13): the
    one-shot's arrays, as :class:`_Fixed` holds them, the inbox's words, and the TCP ring's
    (its state, the framed schedule's tables and scratch cells: NOTE [a ring's schedule in
    compiled code] in comm/transports/tcp_native.py), with this rank's place, the streams'
    descriptors, the inbox's address and the frame's word. Made by :func:`_new_fixed_tcp`;
    every array the transport's, only referenced."""


structref.define_boxing(_FixedTcpType, _FixedTcp)


_TCP_FIELDS = ("rows", "table", "sig", "scratch", "acc", "parts", "inbox", "words", "pair", "pair_t", "st",
               "sends", "recvs", "fds", "round_sends", "round_recvs", "cells", "clock", "me", "p", "node",
               "h0", "head", "frame", "right", "left", "base", "lowat", "first", "op", "divisor", "kind",
               "doubling")


def _make_fixed_tcp(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends, recvs, fds,
                    round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame, right, left, base,
                    lowat, first, op, divisor, kind, doubling):
    raise NotImplementedError("compiled code only (_new_fixed_tcp)")


@overload(_make_fixed_tcp)
def _make_fixed_tcp_impl(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends,
                         recvs, fds, round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame,
                         right, left, base, lowat, first, op, divisor, kind, doubling):
    values = (rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends, recvs, fds,
              round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame, right, left, base, lowat,
              first, op, divisor, kind, doubling)
    fixed_type = _FixedTcpType(list(zip(_TCP_FIELDS, values, strict=True)))

    def impl(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends, recvs, fds,
             round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame, right, left, base, lowat,
             first, op, divisor, kind, doubling):
        f = structref.new(fixed_type)
        f.rows, f.table, f.sig, f.scratch, f.acc, f.parts = rows, table, sig, scratch, acc, parts
        f.inbox, f.words, f.pair, f.pair_t, f.st = inbox, words, pair, pair_t, st
        f.sends, f.recvs = sends, recvs
        f.fds, f.round_sends, f.round_recvs, f.cells, f.clock = fds, round_sends, round_recvs, cells, clock
        f.me, f.p, f.node, f.h0, f.head, f.frame, f.right, f.left = me, p, node, h0, head, frame, right, left
        f.base, f.lowat, f.first, f.op, f.divisor, f.kind, f.doubling = (
            base, lowat, first, op, divisor, kind, doubling)
        return f

    return impl


@njit(cache=True)
def _new_fixed_tcp(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends, recvs, fds,
                   round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame, right, left, base,
                   lowat, first, op, divisor, kind, doubling):
    """A :class:`_FixedTcp` holding these (arrays by reference)."""
    return _make_fixed_tcp(rows, table, sig, scratch, acc, parts, inbox, words, pair, pair_t, st, sends,
                           recvs, fds, round_sends, round_recvs, cells, clock, me, p, node, h0, head, frame,
                           right, left, base, lowat, first, op, divisor, kind, doubling)


@njit(nogil=True, cache=True)
def _fused_tcp(src, dst, fx, h, step, col, lo, hi, whole, until_ns):
    """Steps 1-4 of NOTE [one-shot across nodes] in one compiled call over the TCP ring between
    machines (clause 13): DONE, or where it stopped for the caller to go on in Python:
    LOCAL_WAIT (as :func:`_fused`'s), DISAGREE (every table known: describe the mismatch), or
    PENDING (the exchange under way at ``until_ns``, CLOCK_MONOTONIC, or failed: the
    transport's exchange takes it from where it stands and names what happened). ``fx``: a
    :class:`_FixedTcp`; the rest as for :func:`_fused`."""
    rows, table, sig, scratch, acc, parts = fx.rows, fx.table, fx.sig, fx.scratch, fx.acc, fx.parts
    words, me, p, node, h0, head = fx.words, fx.me, fx.p, fx.node, fx.h0, fx.head
    op, divisor, kind = fx.op, fx.divisor, fx.kind
    partial = parts[node, h0:h0 + hi - lo]
    if not _node_step(src, partial, rows, h, me, table, col, sig, step, op, kind, scratch, acc, lo, words,
                      node, p):
        return LOCAL_WAIT
    nbytes = head + (hi - lo) * parts.itemsize
    words[node, fx.frame] = nbytes  # NOTE [a ring over TCP] 8
    st = fx.st
    if fx.doubling:  # NOTE [a ring over TCP] 9: the partials reduced on the way
        code = tcp_native.doubling(st, fx.fds, fx.round_sends, fx.round_recvs, fx.inbox, head, fx.frame,
                                   nbytes, fx.pair, fx.pair_t, partial, op, kind, node, fx.lowat, until_ns,
                                   fx.cells, fx.clock, False)
    else:
        tcp_native.start(st, fx.first)
        code = tcp_native.advance(st, fx.sends, fx.recvs, fx.right, fx.left, fx.base, 0, fx.lowat,
                                  st[tcp_native.S_SPIN_NS], until_ns, fx.cells, fx.clock)
    if code != tcp_native.DONE:
        return mpi_native.PENDING
    if not ksync.tables_agree(words, head // 8, TABLE_COLS, words[node, :TABLE_COLS - 1]):
        return mpi_native.DISAGREE
    for q in range(words.shape[0]):
        if words[q, fx.frame] != nbytes:
            return mpi_native.DISAGREE
    finals = parts[node:node + 1] if fx.doubling else parts  # clause 8
    if whole:
        koneshot.finish(dst, finals, h0, op, divisor, kind, scratch, acc)
    else:
        koneshot.finish(rows[me, h + lo:h + hi], finals, h0, op, divisor, kind, scratch, acc)
    return mpi_native.DONE


@njit(nogil=True, cache=True)
def _fused(src, dst, fx, h, step, col, lo, hi, whole, direct):
    """Steps 1-4 of NOTE [one-shot across nodes] in one compiled call, the exchange by MPI's C
    API (NOTE [MPI from compiled code] in comm/transports/mpi_native.py): DONE, or where it
    stopped for the caller to go on in Python: LOCAL_WAIT (the node's ranks not all there
    after its yields: steps 1-2 done, the wait and the rest to do), PENDING (the exchange
    posted and polled: resume it), DISAGREE (every table known: describe the mismatch), or
    minus an MPI error code. ``fx``: a :class:`_Fixed`, the one-shot's and the exchange's
    arrays and this rank's place; this call's half ``h``, board ``step`` and signature
    column ``col``, its part ``[lo, hi)`` of the message, whether it goes ``whole`` (clause
    9), whether the exchange reduces in ``dst`` (clause 11: ``direct``)."""
    rows, table, sig, scratch, acc, parts = fx.rows, fx.table, fx.sig, fx.scratch, fx.acc, fx.parts
    inbox, words, pair, pair_t, st, cfg = fx.inbox, fx.words, fx.pair, fx.pair_t, fx.st, fx.cfg
    reqs, statuses, counts, cells = fx.reqs, fx.statuses, fx.counts, fx.cells
    me, p, node, h0, head = fx.me, fx.p, fx.node, fx.h0, fx.head
    op, divisor, kind = fx.op, fx.divisor, fx.kind
    partial = parts[node, h0:h0 + hi - lo]
    # clause 11: reducing in dst, the node's step only publishes the signature (no row, no
    # partial). Otherwise src is at least as long as partial, so partial[:n_in] is all of it.
    n_in = 0 if direct else src.shape[0]
    if not _node_step(src[:n_in], partial[:n_in], rows, h, me, table, col, sig, step, op, kind, scratch, acc,
                      lo, words, node, p):
        return LOCAL_WAIT
    nbytes = head + (hi - lo) * parts.itemsize
    user, user_t = _user_of(dst, partial, direct)
    state = mpi_native.advance_reducing(st, cfg, reqs, statuses, counts, cells, inbox, words, head, nbytes,
                                        pair, NATIVE_SPINS, partial, pair_t, op, kind, user, user_t)
    if state != mpi_native.DONE:
        return state
    if direct:
        if divisor > 1:
            _divide_in_place(dst, divisor, kind)
        return mpi_native.DONE
    # clause 8: by recursive doubling the partials were reduced on the way: the last step only
    # divides this node's row
    finals = parts[node:node + 1] if fx.doubling else parts
    if whole:
        koneshot.finish(dst, finals, h0, op, divisor, kind, scratch, acc)
    else:
        koneshot.finish(rows[me, h + lo:h + hi], finals, h0, op, divisor, kind, scratch, acc)
    return mpi_native.DONE


def _build(shm, dtype: np.dtype, op: int, kind: int, coll: str, sig: np.ndarray, check, size: int):
    rows, scratch = shm.rows(dtype), shm.private_row(dtype)
    half = rows.shape[1] // 2
    board, me, acc, p = shm.board, shm.local_rank, shm.acc, shm.local_size
    table, timeout = board.table, shm.timeout
    inbox, head = shm.inbox()
    parts = inbox.view(dtype)  # (nodes, width / itemsize): every node's message, as dtype
    h0 = head // dtype.itemsize  # where the payloads begin in those rows
    cross = shm.cross
    node = cross.rank
    mine = parts[node]
    # NOTE [one-shot across nodes] 8: by recursive doubling the partials are reduced on the way,
    # and the last step only divides this node's row.
    doubling = cross.doubling
    divisor = size if op == kreduce.AVG else 1
    compiled = {}
    native = cross.native
    fixed = None  # _fused's (or _fused_tcp's) arguments that do not change from call to call
    over_tcp = native is None and cross.name == "tcp" and cross.size > 1  # clause 13
    if native is not None:
        pair = shm.pair if shm.pair is not None else native.no_pair
        fixed = _new_fixed(rows, table, sig, scratch, acc, parts, inbox, native.words(inbox), pair,
                           pair.view(dtype), native.st, native.cfg, native.reqs, native.statuses,
                           native.counts, native.cells, me, p, node, h0, head, op, divisor, kind, doubling)
    elif over_tcp:
        (st, sends, recvs, fds, round_sends, round_recvs, cells, clock, right, left, base, lowat, first,
         frame) = cross.compiled_exchange(inbox, head)
        pair = shm.pair if shm.pair is not None else np.zeros((2, 64), np.uint8)
        fixed = _new_fixed_tcp(rows, table, sig, scratch, acc, parts, inbox, inbox.view(np.int64), pair,
                               pair.view(dtype), st, sends, recvs, fds, round_sends, round_recvs, cells,
                               clock, me, p, node, h0, head, frame, right, left, base, lowat, first, op,
                               divisor, kind, doubling)

    def call(src: np.ndarray, dst: np.ndarray) -> None:
        run(src, dst, in_place(src) if src is dst else _how(src, dst))

    def in_place(x: np.ndarray):
        """How a call in place on arrays like ``x`` runs (clause 7), for :func:`run`: compiled
        and looked up once per size and type (the latency path keeps it, comm/select.py)."""
        flags = x.flags
        key = (x.shape[0], x.dtype, flags.c_contiguous, flags.writeable)
        how = compiled.get(key)
        if how is None:
            how = compiled[key] = _compile(x, x)
        return how

    def _how(src: np.ndarray, dst: np.ndarray):
        key = (src.shape[0], src.dtype, src.flags.c_contiguous, src.flags.writeable, dst.dtype,
               dst.flags.c_contiguous)
        how = compiled.get(key)
        if how is None:
            how = compiled[key] = _compile(src, dst)
        return how

    def run(src: np.ndarray, dst: np.ndarray, how) -> None:
        """The call, ``how`` it runs for arrays like these (:func:`in_place`)."""
        fns, whole, part, lo, hi, direct = how
        h = shm.next_half() * half
        step, col = board.reserve()
        state = LOCAL_WAIT
        if fns[4] is not None:  # all of it in one compiled call, Python only where it stops
            last = time.monotonic_ns() + _TCP_FUSED_NS if over_tcp else direct
            state = fns[4](src, dst, fixed, h, step, col, lo, hi, whole, last)
        if state != mpi_native.DONE:
            _go_on(state, src, dst, fns, h, step, col, lo, hi, whole, direct)
        if not whole:  # 5
            board.barrier(timeout, coll)
            fns[3](dst, rows, h, part, kind)

    def _go_on(state, src, dst, fns, h, step, col, lo, hi, whole, direct) -> None:
        """Steps 1-4 in Python around the compiled kernels, from where _fused stopped (or from
        the start where MPI's C API is not reached from compiled code). ``direct`` only where
        _fused started (never LOCAL_WAIT then: a node of one rank has no one to wait for)."""
        partial = mine[h0:h0 + hi - lo]
        if state < 0:
            cross.raise_native_error(coll, state)
        if state == mpi_native.DISAGREE:
            counts = native.counts if native is not None else cross.counts(inbox, head)
            cross.raise_mismatch(coll, inbox, head, counts, check, board.sigs(step))
        if state == LOCAL_WAIT:
            # 1, 2: done by _fused, which stopped waiting for the node's ranks; else done here
            state = koneshot.WAITING if fns[4] is not None else fns[0](
                src, partial, rows, h, me, table, col, sig, step, op, 1, kind, scratch, acc, ONESHOT_SPINS,
                lo)
            if state == koneshot.WAITING:
                board.wait(step, timeout, coll)
                if ksync.rows_equal(board.sigs(step)) < 0:
                    fns[1](partial, rows, h + lo, op, 1, kind, scratch, acc)
        # 3 (or the rest of it, PENDING): a node's mismatch too is raised here, on every rank of
        # every node; clause 8: by recursive doubling the partials are reduced on the way
        reduction = (partial, op, kind, scratch, acc) if doubling else None
        shm.agree_across(coll, board.sigs(step), check, (hi - lo) * dtype.itemsize, reduction,
                         dst if direct else None)
        if direct:  # clause 11: the result is in dst
            if divisor > 1:
                _divided(dst, divisor, kind)
            return
        out = dst if whole else rows[me, h + lo:h + hi]
        fns[2](out, parts[node:node + 1] if doubling else parts, h0, op, divisor, kind, scratch, acc)  # 4

    def _compile(src, dst):
        """How a call of these sizes and types runs: every kernel it may run, compiled (or
        loaded) before its rank publishes (NOTE [symmetric completion] in
        comm/algorithms/oneshot.py); whether it goes whole, its part, and the part's [lo, hi).
        What Numba's type of an array depends on: dtype, layout, writeability; _fused is
        compiled for calls in place only (the latency path's: each of its specializations
        costs seconds of compilation on a first run), and only those may reduce in ``dst``
        (clause 11)."""
        n = src.shape[0]
        # clause 9: a message this small goes whole from every local rank, with no step 5
        whole = p == 1 or n * dtype.itemsize <= ONESHOT_WHOLE_BYTES
        part = n if whole else part_of(n, p)
        lo = 0 if whole else min(me * part, n)
        hi = min(lo + part, n)
        h, step, col = 0, 1, 1  # any: only their types count here
        partial = mine[h0:h0 + hi - lo]
        out = dst if whole else rows[me, h + lo:h + hi]
        local = (src, partial, rows, h, me, table, col, sig, step, op, 1, kind, scratch, acc, ONESHOT_SPINS,
                 lo)
        gather = (dst, rows, h, part, kind)
        fns = (entry_point(koneshot.oneshot_allreduce, local),
               entry_point(koneshot.finish, (partial, rows, h + lo, op, 1, kind, scratch, acc)),
               entry_point(koneshot.finish, (out, parts, h0, op, divisor, kind, scratch, acc)),
               entry_point(koneshot.collect, gather) if p > 1 else None,
               entry_point(_fused_tcp if over_tcp else _fused,
                           (src, dst, fixed, h, step, col, lo, hi, whole, 0 if over_tcp else False))
               if fixed is not None and src is dst and src.flags.writeable else None)
        direct = (fns[4] is not None and not over_tcp and p == 1 and dst.dtype == dtype
                  and dst.flags.c_contiguous and bool(mpi_native.halves(native.cfg, n * dtype.itemsize)))
        return fns, whole, part, lo, hi, direct

    call.in_place = in_place
    call.run = run
    return call
