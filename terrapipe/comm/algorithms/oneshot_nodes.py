"""The one-shot across nodes: a small allreduce over several nodes and its agreement in two
meetings, a board step on each node and one exchange between nodes, where the hierarchical
path takes an agreement of its own and then three more (the segment in, an allreduce between
nodes per part, the segment out). Each meeting costs a scheduling round trip where ranks
outnumber cores, a network round trip between nodes, so the count is the latency.

NOTE [one-shot across nodes]
    1. Each rank writes its data into its row of the node's segment (a row half, NOTE [row
       halves] in comm/transports/shm.py) and publishes its signature on the board: one step.
    2. Every local rank then reduces every local row, in local rank order, into a private
       partial: the node's partial, the same bits on each of the node's ranks.
    3. Each rank sends its node's signatures and the partial to the ranks of its own local rank
       on the other nodes and receives theirs (NOTE [agreement across nodes] in
       comm/transports/shm.py): every signature of the group is checked on every rank before
       any result is written, whatever sizes the ranks passed.
    4. Every rank combines the nodes' partials in node order, so every rank of the group ends
       with the same bits (16-bit formats: accumulated in float32 within a node and across
       nodes, rounded once per node and once at the end).
    5. A rank writes a row half again two calls later, after the next call's board step, which
       no local rank reaches before it finished reading this call's rows (NOTE [row halves]).
    6. What it costs: each rank reads local_size rows of n bytes and sends n bytes to each other
       node, so a node's link carries local_size x n per other node where the hierarchical
       path sends about 2n in all: it wins for small messages only (ONESHOT_NODES_BYTES, NOTE
       [algorithm selection] 4 in comm/select.py).
"""

from __future__ import annotations

import numpy as np

from ...kernels import compress, decompress
from ...kernels import reduce as kreduce
from ..message import divide

__all__ = ["allreduce", "limit", "ONESHOT_NODES_BYTES"]

# Measured over emulated 1gbit links on two cores (float32 sum; each algorithm pinned, rounds
# interleaved), us at 4 / 16 / 32 / 64 KiB: at 2 nodes x 2 ranks the one-shot across nodes
# 397 / 517 / 568 / 1109, the hierarchical segment 633 / 921 / 934 / 970, MPI's own allreduce
# after the agreement 630 / 809 / 918 / 794; at 4 x 1 597 / 658 / 827 / 1654 against 1117 /
# 1106 / 1221 / 897 and 1059 / 923 / 1106 / 810. At 64 KiB each node's link carries
# local_size x 64 KiB per other node and loses (clause 6).
ONESHOT_NODES_BYTES = 32 << 10


def limit(shm) -> int:
    """The largest allreduce (bytes as exchanged) the one-shot across nodes takes: half a row
    of the node's segment, and at most ``ONESHOT_NODES_BYTES``."""
    return min(shm.row_bytes // 2, ONESHOT_NODES_BYTES)


def allreduce(shm, src: np.ndarray, dst: np.ndarray, dtype: np.dtype, op: int, kind: int, ckind: int,
              coll: str, sig: np.ndarray, check, size: int) -> None:
    """``dst`` = op over every rank's ``src`` on every node (NOTE [one-shot across nodes]), with
    the agreement on ``sig`` (``check(sigs, ranks)`` raises on a mismatch, on every rank).

    ``src``, ``dst``: 1-D, ``n`` elements of ``dtype`` (the rows' dtype: uint16
    holding 16-bit format ``kind``, 0 for native dtypes), or float32 when ``ckind`` (then equal
    to ``kind``) sends them rounded to that format; ``dst`` may be ``src``. At most
    :func:`limit` bytes exchanged. ``shm``: this node's ShmTransport, with its cross-node
    transport; ``size``: ranks in the group (``avg`` divides by it). The caller owns both
    arrays; the rows and the private row are the transport's."""
    rows = shm.rows(dtype)
    n = src.shape[0]
    h = shm.next_half() * (rows.shape[1] // 2)
    me = shm.local_rank
    if ckind:
        compress(src, rows[me, h:h + n], ckind)
    else:
        rows[me, h:h + n] = src
    board = shm.board
    step = board.barrier(shm.timeout, coll, sig)  # 1
    partial = shm.private_row(dtype)  # 2: columns [h, h + n), as in the rows
    if kind:
        kreduce.reduce_many_16(partial, rows, op, h, n, kind, shm.acc)
    else:
        kreduce.reduce_many_native(partial, rows, op, h, n)
    parts = shm.agree_across(coll, board.sigs(step), check, partial[h:h + n])  # 3
    gathered = np.empty((len(parts), n), dtype)  # 4
    for i, part in enumerate(parts):
        gathered[i] = part.view(dtype)
    out = np.empty(n, dtype) if ckind else dst
    if kind:
        kreduce.reduce_many_16(out, gathered, op, 0, n, kind, shm.acc)
    else:
        kreduce.reduce_rows_into(out, gathered, op, 0, n)
    if op == kreduce.AVG:
        divide(out, size, kind)
    if ckind:
        decompress(out, dst, ckind)
