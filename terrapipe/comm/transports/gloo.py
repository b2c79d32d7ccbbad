"""The Gloo transport: collectives over torch.distributed for jobs launched by torchrun or SLURM
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), where there is no MPI.

Signatures are agreed with an all_gather of the same 24-word record the shared-memory board
uses, so mismatches raise CollectiveMismatchError on every rank here too. float16 and bfloat16
reductions are all-gathered and reduced with the kernels in float32, as on MPI.

NOTE [naming a late rank over Gloo]
    Gloo reports a timeout ("Timed out waiting ... for recv") or a closed connection, not which
    rank is missing. Every collective starts with the agreement, which counts collectives per
    group (``_seq``). When one fails, each rank that reached it writes
    ``terrapipe/<group>/<seq>/<rank>`` to torch's store (served by rank 0's process; a group of
    our own's store, NOTE [Gloo groups of our own] 2) and looks
    for the others' keys for up to the timeout (ranks reach the failure up to that far apart):
    the ranks without a key never arrived, and CollectiveTimeoutError names them.
"""

from __future__ import annotations

import datetime
import json
import time

import numpy as np

from ...kernels import reduce as kreduce
from .. import ops
from ..errors import CollectiveTimeoutError, CommError
from ..message import NO_GATE, Fused, divide, reduce_flat, segments
from .base import OwnCollectives

__all__ = ["GlooTransport"]

_SIGN_IN_SECONDS = 30.0  # the longest a failing rank looks for the others' keys


class GlooTransport(OwnCollectives):
    """Collectives over a Gloo process group: ``pg``, one torch.distributed made
    (``new_group``; None: the default group, initialised here over Gloo if nothing initialised
    it: ``owns_init``), or, with ``store``, a ``ProcessGroupGloo`` made directly over that
    store and not registered with torch.distributed (NOTE [Gloo groups of our own]).

    NOTE [Gloo groups of our own]
        1. Calls go to the process group's own methods (``pg.allreduce([t], opts)``), in the
           group's rank numbering, not through ``torch.distributed``'s functions: those accept
           only groups torch registered, and a group made inside a ``torch.distributed``
           backend (distributed/process_group.py), or among some ranks only, is not.
        2. A group of our own is made by its members alone (``ProcessGroupGloo(store, ...)``),
           where ``new_group`` is collective over torch's whole world; its ``store`` (a key space
           of the group's own) also takes the sign-ins that name a late rank (NOTE [naming a
           late rank over Gloo]), where a registered group's go to torch's default store.
    """

    name = "gloo"

    def __init__(self, timeout: float, pg=None, store=None) -> None:
        import torch
        import torch._C._distributed_c10d as c10d
        import torch.distributed as dist

        self._torch, self._dist, self._c10d = torch, dist, c10d
        self.owns_init = pg is None and not dist.is_initialized()
        if self.owns_init:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        self.pg = pg
        self.store = store
        self._pg = pg if pg is not None else dist.group.WORLD
        self.timeout = timeout
        self.rank, self.size = self._pg.rank(), self._pg.size()
        if store is not None:
            self._key = "terrapipe"  # the store is the group's own
        else:
            world_ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self.size))
            self._key = "terrapipe/" + ("world" if pg is None else "-".join(map(str, world_ranks)))
        self._seq = 0
        self._splits = 0
        self._acc = np.empty(kreduce.TILE, np.float32)

    @classmethod
    def of_its_own(cls, store, rank: int, size: int, timeout: float) -> GlooTransport:
        """A Gloo group of ``size`` ranks made over ``store`` (a key space for this group alone)
        by its members alone, not registered with torch.distributed (NOTE [Gloo groups of our
        own]). Collective over those ranks; each waits ``timeout`` seconds for the others."""
        import torch.distributed as dist

        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/", store), int(rank), int(size),
                                   datetime.timedelta(seconds=float(timeout)))
        return cls(timeout, pg, dist.PrefixStore("late/", store))

    # -- errors ------------------------------------------------------------------------------------
    def _call(self, what: str, method: str, *args):
        """``self._pg.<method>(*args)``, waited on (NOTE [Gloo groups of our own] 1); Gloo's
        timeouts and closed connections raised naming the late ranks."""
        try:
            return getattr(self._pg, method)(*args).wait()
        except RuntimeError as e:
            text = str(e)
            timed_out = "imed out" in text or "timeout" in text.lower()
            closed = any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe"))
            if not (timed_out or closed):
                raise CommError(f"{what}: {text}") from e
            late = self._late_ranks()
            names = ", ".join(f"rank {r}" for r in late) or "no rank (every rank signed in)"
            cause = f"Timed out after {self.timeout:g}s" if timed_out else "a connection closed"
            raise CollectiveTimeoutError(f"{what}: {cause} waiting for {names} (gloo): {text}", late) from e

    def _late_ranks(self) -> list[int]:
        """NOTE [naming a late rank over Gloo]."""
        others = [q for q in range(self.size) if q != self.rank]
        if len(others) == 1:
            return others  # nothing to ask: it is the one peer
        store = self.store
        if store is None:
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
        # Gloo has no 16-bit integer types: int16 and uint16 (bfloat16's and float16's bits
        # among them) travel as float16, which gather, broadcast and scatter copy bit for bit
        # (they are only reduced by our kernels).
        if arr.dtype.itemsize == 2 and arr.dtype.kind in "iu":
            arr = arr.view(np.float16)
        return self._torch.from_numpy(arr)

    def _options(self, kind: str, **fields):
        opts = getattr(self._c10d, kind)()
        for k, v in fields.items():
            setattr(opts, k, v)
        return opts

    def _allgather_rows(self, what: str, rows: np.ndarray, mine: np.ndarray) -> None:
        """Every rank's ``mine`` into ``rows`` ((size, n), rank order)."""
        self._call(what, "allgather", [list(self._t(rows).unbind(0))], [self._t(mine)],
                   self._options("AllgatherOptions"))

    def _reduce_host(self, flat: np.ndarray, op: int, kind: int, what: str) -> None:
        if kind:
            gathered = np.empty((self.size, flat.shape[0]), flat.dtype)
            self._allgather_rows(what, gathered, flat)
            kreduce.reduce_many_16(flat, gathered, op, 0, flat.shape[0], kind, self._acc)
        else:
            rop = getattr(self._dist.ReduceOp, ops.by_code(op).gloo)
            self._call(what, "allreduce", [self._t(flat)], self._options("AllreduceOptions", reduceOp=rop))
        if op == kreduce.AVG:
            divide(flat, self.size, kind)

    # -- collectives ---------------------------------------------------------------------------
    def agree(self, coll, sig, check) -> None:
        self._seq += 1
        mine = np.array(sig)
        all_sigs = np.empty((self.size, mine.shape[0]), mine.dtype)
        self._allgather_rows(coll, all_sigs, mine)
        if not (all_sigs == all_sigs[0]).all():
            check(all_sigs, list(range(self.size)))

    def allreduce(self, srcs: Fused, dsts: Fused, op, dtype, kind, ckind=0, root=-1, gate=NO_GATE) -> None:
        gate.ready(srcs.n)
        what = "allreduce" if root < 0 else "reduce"
        reduce_flat(srcs, dsts, dtype, ckind, root < 0 or root == self.rank,
                    lambda buf: self._reduce_host(buf, op, kind, what))
        gate.wrote(srcs.n)

    def broadcast(self, flat, root) -> None:
        self._call("broadcast", "broadcast", [self._t(flat)],
                   self._options("BroadcastOptions", rootRank=root, rootTensor=0))

    def allgather(self, flat, out, root=-1) -> None:
        if root >= 0:
            rows = [list(self._t(out).unbind(0))] if self.rank == root else []
            self._call("gather", "gather", rows, [self._t(flat)],
                       self._options("GatherOptions", rootRank=root))
        else:
            self._allgather_rows("allgather", out, flat)

    def scatter(self, full, out, root) -> None:
        n = out.shape[0]
        parts = [list(self._t(full.reshape(self.size, n)).unbind(0))] if self.rank == root else []
        self._call("scatter", "scatter", [self._t(out)], parts,
                   self._options("ScatterOptions", rootRank=root))

    def reduce_scatter(self, flat, out, op, kind) -> None:
        tmp = flat.copy()
        self._reduce_host(tmp, op, kind, "reduce_scatter")
        lo, hi = segments(flat.shape[0], self.size)[self.rank]
        out[...] = tmp[lo:hi]

    def barrier(self) -> None:
        pass  # the agreement (an allgather of signatures) was the barrier

    def send(self, flat, dest, tag) -> None:
        self._call(f"send to rank {dest}", "send", [self._t(flat)], dest, tag)

    def recv(self, flat, source, tag) -> None:
        self._call(f"recv from rank {source}", "recv", [self._t(flat)], source, tag)

    def allgather_objects(self, obj) -> list:
        """Every rank's ``obj`` (JSON: numbers, strings, lists, dicts; tuples come back as lists),
        in rank order. Not a collective of the group's order: for set-up between them."""
        mine = np.frombuffer(json.dumps(obj).encode(), np.uint8)
        sizes = np.empty((self.size, 1), np.int64)
        self._allgather_rows("exchange", sizes, np.array([mine.size], np.int64))
        rows = np.zeros((self.size, int(sizes.max())), np.uint8)
        padded = np.zeros(rows.shape[1], np.uint8)
        padded[:mine.size] = mine
        self._allgather_rows("exchange", rows, padded)
        return [json.loads(rows[q, :sizes[q, 0]].tobytes()) for q in range(self.size)]

    def split(self, color: int, key: int, timeout: float) -> tuple[GlooTransport, dict[int, list[int]]]:
        """Ranks of one ``color`` in a new Gloo group, ordered by ``key``, waiting ``timeout``
        seconds on its peers (collective); with every color's members (this group's ranks, in
        their new order). A registered group's splits are ``new_group``s (every rank makes every
        color's, as torch requires); a group of our own's are its own too, made by their members
        over its store (NOTE [Gloo groups of our own] 2)."""
        pairs = np.empty((self.size, 3), np.int64)
        self._allgather_rows("split", pairs, np.array([color, key, self.rank], np.int64))
        mine, colors = None, {}
        self._splits += 1
        for c in sorted({int(p[0]) for p in pairs}):
            ordered = sorted((q for q in pairs if q[0] == c), key=lambda q: (q[1], q[2]))
            colors[c] = [int(p[2]) for p in ordered]
            if self.store is not None:
                if c == color:
                    mine = GlooTransport.of_its_own(
                        self._dist.PrefixStore(f"split{self._splits}/{c}/", self.store),
                        colors[c].index(self.rank), len(colors[c]), timeout)
                continue
            world = self._dist.get_process_group_ranks(self._pg)
            # Every rank makes every group, each with the timeout asked for (torch's default: 30 min).
            pg = self._dist.new_group([world[q] for q in colors[c]],
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
