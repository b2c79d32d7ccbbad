"""The shared-memory transport: a segment per node, the board its ranks synchronise on, each
rank's row of it, the shared arrays it maps (NOTE [shared arrays] in comm/algorithms/shared.py)
and the peers' addresses for single-copy reads (comm/transports/cma.py). Its board (step counters,
signatures, pids) is comm/transports/board.py. The algorithms that
move data through it are comm/algorithms/oneshot.py, segment.py, shared.py and single_copy.py.

NOTE [shm segment lifetime]
    The node's first rank creates ``/dev/shm/terrapipe_<uid>_<pid>_<n>``, every rank of the node
    maps it, and once all have (an MPI barrier) the creator unlinks the name. The mapping lives on
    until each process unmaps or exits, so a rank killed with ``kill -9`` leaves no file behind.
    Only a crash inside the create-to-unlink window can leave one; ``remove_stale`` deletes those
    whose creator pid is gone, at the next init.

NOTE [row halves]
    1. Each local rank owns a row of the segment, split in two halves used by alternate chunks
       (a counter that runs on across calls). A rank writes half h for chunk k + 2 only after
       the barrier of chunk k + 1, which every rank publishes after finishing its reads of
       chunk k: so one barrier per chunk suffices for copies, two for reductions (data in,
       reduced parts ready).
    2. So the node's ranks must agree on the counter: each reads the others' rows at its own
       half.
    3. A mismatched call breaks that: a rank that took a one-shot wrote a half before the
       agreement, one that took the segment stopped at it, and their counters differ by one
       from then on (every later call read the wrong halves, silently, until this was found).
       Every rank raises on a mismatch, and each first starts the counter over
       (:meth:`ShmTransport.realign`). Starting over is safe: the mismatched call wrote nothing
       a rank still needs, and a rank still reading it (a one-shot's rows, before it raises)
       reads values it then discards.

NOTE [agreement across nodes]
    1. On several nodes a rank first agrees with its node on the board (one step, signatures
       published with it), then sends its node's table of signatures to the ranks of the same
       local rank on every other node, and receives theirs (``NodeTables.agree_tables``), so
       every rank checks every rank's signature: a rank raising on its own node's mismatch
       before the exchange would leave the other nodes' ranks one agreement behind.
    2. The exchange is point to point, not an MPI collective: a message may carry a payload
       after the table (the one-shot across nodes, comm/algorithms/oneshot_nodes.py, sends its
       part of its node's partial result with it), and ranks that called different
       collectives, or the same one with different sizes, still complete the same exchange and
       then raise CollectiveMismatchError on every rank, where an allgather of unequal lengths
       would be erroneous in MPI. Each message is received into its sender's row of the
       transport's inbox (:meth:`ShmTransport.inbox`), whole rows posted before the sends (no
       message of an exchange is longer than a row: a table and at most the one-shot's limit),
       each one's length read from its status (over MPI; over the TCP ring between machines,
       from the message itself: NOTE [a ring over TCP] 8 in comm/transports/tcp.py). Rows are
       ``payload_bytes`` past the table on every rank (:func:`payload_bytes`: more between two
       nodes of several ranks and among a power of two of nodes, for the one-shot across
       nodes' larger messages there): a 64
       KiB one-shot's message met by a rank in another collective's agreement once overran a
       row sized for tables alone, and MPI failed on the truncation (regression test in
       tests/comm/test_collectives.py).
    3. Among a power of two of at least four nodes (``MpiTransport.doubling``) the exchange goes
       by recursive doubling instead (``MpiTransport.exchange_doubling``): log2(nodes) rounds,
       in round k a rank and the rank 2**k away swap their halves' tables so far and their
       payloads, which the caller reduces on the way (the one-shot's partials, lower half
       first: both sides compute the same bits), so a link carries log2(nodes) payloads where
       the exchange to all sent nodes - 1 (4 nodes: two, not three). Every agreement of such a
       group goes this way, whatever the collective, so ranks in different calls still meet
       round by round, each ends with every table, and every rank raises the mismatch. A wait
       that fails names the peer's half: the peer may itself be waiting on a rank of it.
    4. A table's row is a rank's signature digest (``kernels.sync.sig_digest``, 8 bytes) and its
       group rank, not the signature's 24 words: at 4 nodes x 1 over 1gbit a 16 KiB allreduce
       runs at the links' bound, where the 600 bytes of whole signatures a call carried set it
       2.7% behind MPICH's (16 KiB less those 600 bytes: 0.99 of MPICH's time, interleaved). Where
       digests differ every rank sees it (each holds every table), and every rank then swaps the
       whole signatures in a second exchange, of tables alone, to name the mismatch
       (``NodeTables.raise_mismatch``). Two signatures that differ share a digest by a chance
       of 2**-64 per pair.

NOTE [shared segment reservation]
    A shared array's segment (:meth:`ShmTransport.alloc_shared`) is reserved when it is made
    (``posix_fallocate``), so a full ``/dev/shm`` refuses at once, with OSError on every rank of
    the node, instead of killing a process with SIGBUS at its first touch of a missing page.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from ... import settings
from ...kernels import reduce as kreduce
from ...kernels import sync as ksync
from ...launch_env import alive, create_shm_file, remove_orphaned_files
from . import cma, hugepages
from .base import Transport
from .board import LOST, SIG_WORDS, TABLE_COLS, Board, wait_mode

__all__ = ["Segment", "Board", "ShmTransport", "remove_stale", "alive", "PREFIX", "PAYLOAD_BYTES",
           "PAIR_PAYLOAD_BYTES", "DOUBLING_PAYLOAD_BYTES", "DOUBLING_ALONE_PAYLOAD_BYTES", "payload_bytes",
           "row_bytes", "wait_mode", "SIG_WORDS"]

PREFIX = "terrapipe_"
_SHM_DIR = "/dev/shm"
# Each rank's row of the segment holds two halves (NOTE [row halves]), each one one-shot
# message: p x row = 8 MiB per node whatever p, and at least 1 MiB a row.
_SEGMENT_BYTES = 8 << 20
_MIN_ROW_BYTES = 1 << 20


def row_bytes(local_size: int) -> int:
    """Bytes of each rank's row for a node of ``local_size`` ranks (TERRAPIPE_SHM_ROW_BYTES
    overrides)."""
    forced = settings.get("TERRAPIPE_SHM_ROW_BYTES")
    row = forced or max(_MIN_ROW_BYTES, _SEGMENT_BYTES // max(local_size, 1))
    return row // 64 * 64


def remove_stale() -> list[str]:
    """Unlink terrapipe segments whose creating process no longer exists; returns their paths."""
    return remove_orphaned_files(_SHM_DIR, PREFIX)


class Segment:
    """A shared mapping of ``nbytes`` among the ranks of one node (see NOTE [shm segment lifetime]).

    ``node_comm`` is an mpi4py communicator of the node's ranks.
    """

    def __init__(self, node_comm, nbytes: int, reserve: bool = False) -> None:
        nbytes = max(int(nbytes), mmap.PAGESIZE)
        name = None
        if node_comm.rank == 0:
            try:  # reserve: NOTE [shared segment reservation], refuse now, not SIGBUS later
                name = create_shm_file(_SHM_DIR, PREFIX, nbytes, reserve)
            except OSError as e:
                name = [e.errno, f"{e.strerror}: {nbytes} bytes in {_SHM_DIR}"]
        name = node_comm.bcast(name, root=0)
        if isinstance(name, list):  # every rank of the node raises alike
            raise OSError(*name)
        fd = os.open(name, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        node_comm.Barrier()
        if node_comm.rank == 0:
            os.unlink(name)
        self.nbytes = nbytes
        self.name = name  # where it was made (unlinked by now): the creator's pid is in it
        self.buf = np.frombuffer(self._map, np.uint8)

    def close(self) -> None:
        self.buf = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


# The largest payload a message of the exchange across nodes carries after its table (the one-shot
# across nodes' part, comm/algorithms/oneshot_nodes.py): every inbox row is this wide, so a
# message never outgrows the receive posted for it, whichever collective its sender called.
PAYLOAD_BYTES = 64 << 10
# Between two nodes of several ranks each the one-shot across nodes takes messages up to a row
# half (NOTE [one-shot across nodes] 10 in comm/algorithms/oneshot_nodes.py): there the inbox's
# two rows are this much wider.
PAIR_PAYLOAD_BYTES = 2 << 20
# Among a power of two of four or more nodes (recursive doubling) it takes up to this much
# (NOTE [one-shot across nodes] 10-11), with the inbox of a rank kept within INBOX_BUDGET_BYTES:
# its rows are one per node, so among eight nodes the payload is 512 KiB, and among many it
# shrinks back to PAYLOAD_BYTES.
DOUBLING_PAYLOAD_BYTES = 1 << 20
INBOX_BUDGET_BYTES = 4 << 20
# On nodes of one rank, where the one-shot reduces in the caller's array (NOTE [one-shot across
# nodes] 11-12) and a node holds one inbox, not one per local rank, twice that: 2 MiB among four
# nodes, 1 MiB among eight.
DOUBLING_ALONE_PAYLOAD_BYTES = 2 << 20
INBOX_ALONE_BUDGET_BYTES = 8 << 20


def payload_bytes(nodes: int, largest_node: int, doubling: bool) -> int:
    """The most an exchange's message carries past its table among ``nodes`` nodes whose
    largest holds ``largest_node`` ranks (the same on every rank of the exchange)."""
    if nodes == 2 and largest_node > 1:
        return PAIR_PAYLOAD_BYTES
    if doubling:
        most, budget = ((DOUBLING_ALONE_PAYLOAD_BYTES, INBOX_ALONE_BUDGET_BYTES) if largest_node == 1
                        else (DOUBLING_PAYLOAD_BYTES, INBOX_BUDGET_BYTES))
        return max(PAYLOAD_BYTES, min(most, budget // nodes // 64 * 64))
    return PAYLOAD_BYTES


class ShmTransport(Transport):
    """The shared segment of this rank's node: the board (``board``), each local rank's row
    (:meth:`rows`), shared arrays (:meth:`alloc_shared`) and the peers' memory (``peers``, NOTE
    [single-copy allreduce] 4 in comm/algorithms/single_copy.py). ``cross``: the transport
    over the ranks of the same local rank on every node (MPI's, or a ring of TCP streams
    between machines: :class:`~terrapipe.comm.transports.base.NodeTables`), or None on one
    node; the agreement runs over it too.

    ``node_comm``: mpi4py communicator of this node's ranks (for creating the segment);
    ``rank``/``size``: in the whole group; ``node_ranks``: group rank of each local rank."""

    name = "shm"

    def __init__(self, node_comm, rank: int, size: int, node_ranks: list[int], timeout: float,
                 cross=None) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = node_comm.Get_rank(), node_comm.Get_size()
        self.timeout = timeout
        self.cross = cross
        p = self.local_size
        row = self.row_bytes = row_bytes(p)
        board_bytes = Board.nbytes(p)
        self.segment = Segment(node_comm, board_bytes + p * row)
        self.board = Board(self.segment.buf[:board_bytes].view(np.int64), p, self.local_rank, node_ranks,
                           cross.describe if cross is not None else "rank {}".format)
        self._rows_u8 = self.segment.buf[board_bytes:board_bytes + p * row].reshape(p, row)
        self._private_u8 = np.empty(row, np.uint8)
        self.acc = np.empty(kreduce.TILE, np.float32)  # float32 scratch of the 16-bit kernels
        self.plans: dict[tuple, object] = {}  # the one-shot's, per signature (algorithms/oneshot.py)
        self._half = 0
        self._node_comm = node_comm  # for the segments of alloc_shared
        self._shared: dict[int, tuple[int, int, np.ndarray, Segment]] = {}  # id: (addr, bytes, rows, segment)
        self._shared_made = 0
        # NOTE [single-copy allreduce] 4 (algorithms/single_copy.py): None where the node cannot
        self.peers = self._probe_single_copy() if p > 1 and cma.enabled() else None
        self._staging = np.empty(0, np.uint8)  # contiguous copies of fused messages (single copy)
        # The exchange across nodes (agree_across): its message rows, made once and as wide as
        # any message of an exchange can be, whichever call each rank made (NOTE [agreement
        # across nodes] 2); this node's table in its own row: signature digest and group rank
        # per row (clause 4), rank -1 pads.
        self._inbox = self._head = self._node_table = self.pair = None
        self.payload_bytes = PAYLOAD_BYTES  # the most an exchange's message carries past its table
        if cross is not None:
            rows = cross.largest_node(p)
            # the transport's own rows (a TCP stream's frame: NOTE [a ring over TCP] 8) follow
            self._head = (rows + cross.frame_rows) * TABLE_COLS * 8
            # the same on every rank of cross (its size, the largest node), as the rows must be
            self.payload_bytes = payload_bytes(cross.size, rows, cross.doubling)
            width = -(-(self._head + self.payload_bytes) // 64) * 64
            self._inbox = np.empty((cross.size, width), np.uint8)
            table = self._inbox[cross.rank, : self._head].view(np.int64)
            self._node_table = table.reshape(rows + cross.frame_rows, TABLE_COLS)
            self._node_table[:] = -1
            # Recursive doubling's two messages of a round (NOTE [agreement across nodes] 3):
            # half the nodes' tables and a payload at most.
            pair_width = -(-(cross.size // 2 * self._head + self.payload_bytes) // 64) * 64
            self.pair = np.empty((2, pair_width), np.uint8) if cross.doubling else None
            self._node_table[:p, -1] = self.board.ranks
        self.hugepages = hugepages.Advisor()  # NOTE [huge pages for reused buffers] in hugepages.py

    def late(self) -> tuple[list[int], str] | None:
        """(group ranks, why) of this node that died, else the far rank one of them lost
        (``why``: LOST), else those that have not reached this rank's step; or None."""
        board = self.board
        if board is None:
            return None
        dead = [board.ranks[q] for q in range(self.local_size) if not alive(int(board.pids[q]))]
        if dead:
            return dead, "died"
        lost = [int(board.lost[q]) - 1 for q in range(self.local_size) if board.lost[q] > 0]
        if lost:  # NOTE [a peer lost across nodes] in board.py
            return lost[:1], LOST
        behind = [board.ranks[q] for q in range(self.local_size) if board.steps[q] < board.step]
        if behind:
            return behind, "not arrived at this collective"
        return None

    # -- agreement -----------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        step = self.board.barrier(self.timeout, coll, sig)
        sigs = self.board.sigs(step)
        if self.cross is None:
            if ksync.rows_equal(sigs) >= 0:
                check(sigs, self.board.ranks)
            return
        self.agree_across(coll, sigs, check)

    def inbox(self) -> tuple[np.ndarray, int]:
        """(inbox, head) of the exchange across nodes (NOTE [agreement across nodes]): inbox is
        (nodes, head + ``payload_bytes`` rounded up to 64) uint8, row j node j's message in the
        cross communicator's order (this node's at ``cross.rank``): its table, ``head`` bytes,
        then its payload. A payload is written at ``inbox[cross.rank, head:]`` before
        :meth:`agree_across`; the others' arrive in their rows. The transport's; None on one
        node."""
        return self._inbox, self._head

    def agree_across(self, coll, sigs: np.ndarray, check, payload_bytes: int = 0,
                     reduction: tuple | None = None, user: np.ndarray | None = None) -> None:
        """NOTE [agreement across nodes]: this node's signatures ``sigs`` (local_size, words),
        read off the board, to every other node, with the ``payload_bytes`` (at most the
        transport's) this rank wrote after its table in :meth:`inbox`; returns once every
        signature agrees, every node's payload then in its row of the inbox. Where the
        exchange goes by recursive doubling (``cross.doubling``, clause 3) the payloads are
        reduced on the way instead, as ``reduction`` says: (partial, op, kind, scratch, acc),
        ``partial`` this rank's payload as its dtype, which then ends as the whole group's
        reduction (``NodeTables.agree_tables``); required there when there is a payload.
        ``user``: the caller's array the payload is read from and whose result it receives, where
        the compiled exchange reduce-scatters (NOTE [MPI from compiled code] 10 in
        comm/transports/mpi_native.py); else None."""
        if payload_bytes > self.payload_bytes:
            raise ValueError(f"payload_bytes: at most {self.payload_bytes}, got {payload_bytes}")
        ksync.sig_digests(sigs, self._node_table, 0)
        if self.pair is not None and payload_bytes and reduction is None:
            raise ValueError("reduction: recursive doubling reduces payloads on the way")
        self.cross.agree_tables(coll, self._inbox, self._head, self._head + payload_bytes, check, sigs,
                                self.pair, reduction if payload_bytes else None, user)

    def barrier(self) -> None:
        self.board.barrier(self.timeout, "barrier")

    # -- the rows --------------------------------------------------------------------------------
    def rows(self, dtype) -> np.ndarray:
        """(local_size, row) of ``dtype``: every local rank's row of the segment (NOTE [row
        halves]). The whole C-contiguous array: kernels get it with an offset rather than a
        column slice, whose runtime strides would keep their loops from vectorizing (3x slower)."""
        return self._rows_u8.view(dtype)

    def private_row(self, dtype) -> np.ndarray:
        """A private row's worth of ``dtype`` (the one-shot's scratch)."""
        return self._private_u8.view(dtype)

    def realign(self) -> None:
        """Start the row-half counter over (NOTE [row halves] 3): every rank of the node calls it
        on a mismatched call, before raising."""
        self._half = 0

    def next_half(self) -> int:
        """The row half (0 or 1) the next chunk uses (NOTE [row halves]: alternate, across calls)."""
        h = self._half
        self._half ^= 1
        return h

    # -- shared arrays (NOTE [shared arrays] in comm/algorithms/shared.py) ---------------------------
    def alloc_shared(self, nbytes: int) -> np.ndarray:
        """This rank's row of a new node segment with a row of ``nbytes`` (uint8, 64-byte
        aligned) per local rank. Collective over the node, in the group's order; OSError on
        every rank of the node when /dev/shm cannot hold it (NOTE [shared segment reservation])."""
        stride = -(-max(int(nbytes), 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        segment = Segment(self._node_comm, self.local_size * stride, reserve=True)
        rows = segment.buf.reshape(self.local_size, stride)
        mine = rows[self.local_rank, :nbytes]
        self._shared_made += 1
        self._shared[self._shared_made] = (rows[self.local_rank].ctypes.data, stride, rows, segment)
        return mine

    def release_shared(self, arr: np.ndarray) -> bool:
        """Stop treating the segment holding ``arr`` as shared (its memory goes once the last
        view of it does; each peer's mapping lives on with its own views). Local."""
        found = self.locate(arr)
        if found is None:
            return False
        ident = found[0]
        self._shared.pop(ident)[3].close()
        return True

    def shared_rows(self, ident: int) -> np.ndarray:
        """(local_size, stride) uint8: every local rank's row of shared segment ``ident``."""
        return self._shared[ident][2]

    def locate(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(segment id, byte offset in this rank's row) when ``arr``'s memory lies within a row
        of :meth:`alloc_shared`, else None."""
        if not self._shared or arr.size == 0:
            return None
        addr = arr.__array_interface__["data"][0]
        end = addr + arr.nbytes
        for ident, (base, stride, _rows, _seg) in self._shared.items():
            if base <= addr and end <= base + stride:
                return ident, addr - base
        return None

    # -- single copy (NOTE [single-copy allreduce] in comm/algorithms/single_copy.py) -------------
    def _probe_single_copy(self) -> cma.Peers | None:
        """Whether every rank of the node can read every other's memory (NOTE [single-copy
        allreduce] 4), agreed on the board: the Peers to do it with, or None on every rank."""
        board, me = self.board, self.local_rank
        mark = np.array([os.getpid()], np.int64)  # what a peer must read at this address
        board.addrs[me, 0] = mark.ctypes.data
        board.barrier(self.timeout, "start-up")
        ok = all(q == me or cma.read_value(int(board.pids[q]), int(board.addrs[q, 0])) == board.pids[q]
                 for q in range(self.local_size))
        step = board.barrier(self.timeout, "start-up", np.array([1 if ok else 2], np.int64))
        if (board.sigs(step)[:, 0] != 1).any():
            return None
        return cma.Peers(board.pids.copy(), list(board.ranks))

    def post_single_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Publish this rank's source and destination for the single-copy collective whose
        agreement comes next (its release store makes them visible); buffers posted again and
        again get huge pages (NOTE [huge pages for reused buffers] in hugepages.py)."""
        self.hugepages.saw(src.ctypes.data, src.nbytes)
        if dst.ctypes.data != src.ctypes.data:
            self.hugepages.saw(dst.ctypes.data, dst.nbytes)
        self.board.addrs[self.local_rank] = (src.ctypes.data, dst.ctypes.data)

    def staging(self, nbytes: int) -> np.ndarray:
        """A private contiguous uint8 buffer of ``nbytes`` for a fused message's single copy
        (kept and grown: a fresh one would pay a page fault per 4 KiB on every call)."""
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        return self._staging[:nbytes]

    def close(self, healthy: bool = True) -> None:
        """Unmap the segments; ``healthy``: also free the node communicator (an MPI call every
        rank of the node makes; skipped after a failure)."""
        for *_, segment in self._shared.values():
            segment.close()
        self._shared.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.board = None
        free = getattr(self._node_comm, "Free", None)
        if healthy and free is not None:
            free()
        self._node_comm = None
