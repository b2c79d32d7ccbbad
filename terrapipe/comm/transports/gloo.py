"""The Gloo transport: collectives over torch.distributed for jobs launched by torchrun or SLURM
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), where there is no MPI.

Signatures are agreed with an all_gather of the same 24-word record the shared-memory board
uses, so mismatches raise CollectiveMismatchError on every rank here too. float16 and bfloat16
reductions are all-gathered and reduced with the kernels in float32, as on MPI.

NOTE [naming a late rank over Gloo]
    Gloo reports a timeout ("Timed out waiting ... for recv") or a closed connection, not which
    rank is missing. Every collective starts with the agreement, which counts collectives per
    group (``_seq``). When one fails, each rank that reached it writes
    ``terrapipe/<group>/<seq>/<rank>`` to torch's store (served by rank 0's process) and looks
    for the others' keys for up to the timeout (ranks reach the failure up to that far apart):
    the ranks without a key never arrived, and CollectiveTimeoutError names them.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable

import numpy as np

from ...kernels import reduce as kreduce
from .. import ops
from ..errors import CollectiveTimeoutError, CommError
from ..message import NO_GATE, Fused, divide, segments
from .base import OwnCollectives

__all__ = ["GlooTransport", "MachinesAgreement"]

_SIGN_IN_SECONDS = 30.0  # the longest a failing rank looks for the others' keys


class GlooTransport(OwnCollectives):
    """Collectives over the torch.distributed process group ``pg`` (None: the default group,
    initialised here over Gloo if nothing initialised it: ``owns_init``)."""

    name = "gloo"

    def __init__(self, timeout: float, pg=None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.owns_init = pg is None and not dist.is_initialized()
        if self.owns_init:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        self.pg = pg
        self.timeout = timeout
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        world_ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.size))
        self._key = "terrapipe/" + ("world" if pg is None else "-".join(map(str, world_ranks)))
        self._seq = 0
        self._acc = np.empty(kreduce.TILE, np.float32)
        # As MpiTransport's, for the exchange between machines of a group with shared memory on
        # each (NOTE [a peer lost across nodes] in transports/board.py): told around each wait
        # on other machines, and of the peer (by ``members``) a failed one could not reach.
        self.members = list(range(self.size))
        self.on_lost: Callable[[int], None] = lambda rank: None
        self.on_waiting: Callable[[bool], None] = lambda waiting: None

    # -- errors ------------------------------------------------------------------------------------
    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.pg, **kwargs)
        except RuntimeError as e:
            text = str(e)
            timed_out = "imed out" in text or "timeout" in text.lower()
            closed = any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe"))
            if not (timed_out or closed):
                raise CommError(f"{what}: {text}") from e
            late = [self.members[q] for q in self._late_ranks()]  # as the group numbers them
            if late:
                self.on_lost(late[0])
            names = ", ".join(f"rank {r}" for r in late) or "no rank (every rank signed in)"
            cause = f"Timed out after {self.timeout:g}s" if timed_out else "a connection closed"
            raise CollectiveTimeoutError(f"{what}: {cause} waiting for {names} (gloo): {text}", late) from e

    def _late_ranks(self) -> list[int]:
        """NOTE [naming a late rank over Gloo]."""
        others = [q for q in range(self.size) if q != self.rank]
        if len(others) == 1:
            return others  # nothing to ask: it is the one peer
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:  # noqa: BLE001 - no default group: every other rank is a suspect
            return others
        # The store's own timeout may be many minutes, and its host may be the one cut off:
        # every question to it waits at most this look's own bound.
        bound = min(self.timeout, _SIGN_IN_SECONDS)
        before = store.timeout
        store.set_timeout(datetime.timedelta(seconds=bound))
        try:
            prefix = f"{self._key}/{self._seq}/"
            store.set(prefix + str(self.rank), "1")
            deadline = time.monotonic() + bound
            missing = others
            while missing and time.monotonic() < deadline:
                missing = [q for q in missing if not store.check([prefix + str(q)])]
                time.sleep(0.05)
            return missing
        except Exception:  # noqa: BLE001 - no store reachable (its host is gone or cut off)
            return others
        finally:
            store.set_timeout(before)

    def _t(self, arr: np.ndarray):
        # Gloo has no 16-bit integer types: bit patterns travel as float16, which gather,
        # broadcast and scatter copy bit for bit (they are only reduced by our kernels).
        return self._torch.from_numpy(arr.view(np.float16) if arr.dtype == np.uint16 else arr)

    def _reduce_host(self, flat: np.ndarray, op: int, kind: int, what: str) -> None:
        if kind:
            gathered = np.empty((self.size, flat.shape[0]), flat.dtype)
            self._call(what, self._dist.all_gather, list(self._t(gathered).unbind(0)), self._t(flat))
            kreduce.reduce_many_16(flat, gathered, op, 0, flat.shape[0], kind, self._acc)
        else:
            rop = getattr(self._dist.ReduceOp, ops.by_code(op).gloo)
            self._call(what, self._dist.all_reduce, self._t(flat), op=rop)
        if op == kreduce.AVG:
            divide(flat, self.size, kind)

    @contextlib.contextmanager
    def afar(self):
        """Around a call that waits on other machines: its own sign-in keys should it fail
        (NOTE [naming a late rank over Gloo]), and this rank marked waiting, not late, for its
        machine's ranks meanwhile (NOTE [a peer lost across nodes] 1 in transports/board.py)."""
        self._seq += 1
        self.on_waiting(True)
        try:
            yield
        finally:
            self.on_waiting(False)  # a peer marked lost stays marked

    def allreduce_array(self, buf: np.ndarray, op: int, kind: int, what: str) -> None:
        """Gloo's allreduce in place on ``buf`` (1-D, C-contiguous; uint16 bits for ``kind``);
        ``avg`` sums (the caller divides, by the size of the whole group when this is its part
        between machines, NOTE [machines over Gloo] in comm/group.py)."""
        with self.afar():
            self._reduce_host(buf, kreduce.SUM if op == kreduce.AVG else op, kind, what)

    # -- collectives ---------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        self._seq += 1
        mine = self._t(np.array(sig))
        sigs = self._torch.empty((self.size, mine.shape[0]), dtype=mine.dtype)
        self._call(coll, self._dist.all_gather, list(sigs.unbind(0)), mine)
        all_sigs = sigs.numpy()
        if not (all_sigs == all_sigs[0]).all():
            check(all_sigs, list(range(self.size)))

    def allreduce(self, srcs: Fused, dsts: Fused, op, dtype, kind, ckind=0, root=-1, gate=NO_GATE) -> None:
        flat = np.empty(srcs.n, dtype)
        gate.ready(srcs.n)
        srcs.read(0, srcs.n, flat, ckind)
        self._reduce_host(flat, op, kind, "allreduce" if root < 0 else "reduce")
        if root < 0 or root == self.rank:
            dsts.write(0, flat, ckind)
        gate.wrote(srcs.n)

    def broadcast(self, flat, root) -> None:
        self._call("broadcast", self._dist.broadcast, self._t(flat), src=self._global(root))

    def allgather(self, flat, out, root=-1) -> None:
        rows = list(self._t(out).unbind(0))
        if root >= 0:
            self._call("gather", self._dist.gather, self._t(flat),
                       gather_list=rows if self.rank == root else None, dst=self._global(root))
        else:
            self._call("allgather", self._dist.all_gather, rows, self._t(flat))

    def scatter(self, full, out, root) -> None:
        n = out.shape[0]
        parts = list(self._t(full.reshape(self.size, n)).unbind(0)) if self.rank == root else None
        self._call("scatter", self._dist.scatter, self._t(out), scatter_list=parts, src=self._global(root))

    def reduce_scatter(self, flat, out, op, kind) -> None:
        tmp = flat.copy()
        self._reduce_host(tmp, op, kind, "reduce_scatter")
        lo, hi = segments(flat.shape[0], self.size)[self.rank]
        out[...] = tmp[lo:hi]

    def barrier(self) -> None:
        pass  # the agreement (an allgather of signatures) was the barrier

    def send(self, flat, dest, tag) -> None:
        self._call(f"send to rank {dest}", self._dist.send, self._t(flat), dst=self._global(dest), tag=tag)

    def recv(self, flat, source, tag) -> None:
        self._call(f"recv from rank {source}", self._dist.recv, self._t(flat), src=self._global(source),
                   tag=tag)

    def _global(self, rank: int) -> int:
        """torch.distributed's functions take global ranks, even with a subgroup."""
        return rank if self.pg is None else self._dist.get_global_rank(self.pg, rank)

    def split(self, color: int, key: int, timeout: float) -> tuple[GlooTransport, dict[int, list[int]]]:
        """Ranks of one ``color`` in a new process group, ordered by ``key``, waiting ``timeout``
        seconds on its peers (collective); with every color's members (this group's ranks, in
        their new order)."""
        pairs = [None] * self.size
        self._call("split", self._dist.all_gather_object, pairs, (int(color), int(key), self.rank))
        mine, colors = None, {}
        for c in sorted({p[0] for p in pairs}):
            colors[c] = [p[2] for p in sorted((q for q in pairs if q[0] == c), key=lambda q: (q[1], q[2]))]
            # Every rank makes every group, each with the timeout asked for (torch's default: 30 min).
            pg = self._dist.new_group([self._global(q) for q in colors[c]],
                                      timeout=datetime.timedelta(seconds=timeout))
            if c == color:
                mine = GlooTransport(timeout, pg)
        return mine, colors

    def close(self) -> None:
        if self.owns_init and self._dist.is_initialized():
            # Torn down here, not by the interpreter's exit: process groups destroyed during
            # shutdown (split() subgroups included) can abort in C++ ("terminate called ...").
            self._dist.destroy_process_group()
            self.owns_init = False


class MachinesAgreement:
    """The signature agreement of a Gloo group with shared memory on each machine (NOTE
    [machines over Gloo] 6 in comm/group.py): the machine's signatures meet on its board (``shm``),
    then each local rank swaps its machine's with its peers of the other machines over its Gloo
    group (``cross``), so every rank holds every rank's signature. ``ranks``: the group rank of
    each row of that whole table (machines in ``cross``'s order, each machine's ranks in local
    order)."""

    name = "gloo"

    def __init__(self, shm, cross: GlooTransport, ranks: list[int]) -> None:
        self.shm, self.cross, self.ranks = shm, cross, ranks

    def agree(self, coll, sig, check) -> None:
        board = self.shm.board
        mine = board.sigs(board.barrier(self.shm.timeout, coll, sig))
        every = np.empty((self.cross.size, mine.size), mine.dtype)
        with self.cross.afar():
            self.cross.allgather(np.ascontiguousarray(mine).reshape(-1), every)
        every = every.reshape(-1, mine.shape[1])
        if not (every == every[0]).all():
            check(every, self.ranks)  # every rank holds the same table: all raise alike
