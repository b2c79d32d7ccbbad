"""Horovod's matching of collectives by name, over one terrapipe Group per process set.

NOTE [name negotiation]
    Horovod matches collectives across ranks by name, not by issue order: ranks may issue named
    collectives in different orders, a shape or dtype mismatch fails on every rank and leaves
    the library usable, and a rank that joined takes part in the others' allreduces. terrapipe's
    comm matches by order (NOTE [collective ordering] in comm/group.py); this module builds
    Horovod's semantics on top of it.
    1. Every hvd collective is an :class:`Entry` (name, metadata, tensors, executor) queued on
       its process set's :class:`Coordinator`, whose one thread runs entries in rounds on the
       set's Group. As in Horovod, a name is its kind and the user's name ("allreduce.loss"),
       so an allgather and an allreduce may share a user's name. Names in flight on a rank are
       unique (ValueError at issue). A name is in flight from issue until its handle is
       synchronized; a handle never synchronized keeps its name until 1 s after its collective
       finished. Horovod frees a name when the collective ran, but its background cycle (>= 1 ms)
       makes an immediate second issue fail every time, which its tests and users rely on; here a
       small collective can finish before the issuing thread gets the GIL back.
    2. A round starts with the fast check: one small allreduce (max) of
       ``[h(name), h(meta), -h(name), -h(meta)]`` of each rank's oldest entry. When every rank
       has the same head, that entry runs. Ranks that issue in the same order (every training
       loop) pay one small one-shot allreduce per collective, no more.
    3. Otherwise a slow round: ranks allgather their whole pending lists (JSON: name, metadata,
       age) and each computes the same decision from the same lists:
       a. a name every rank that has not joined has issued is ready; ready names run in order
          of first appearance, rank 0's list first, then rank 1's, ...;
       b. a ready name whose metadata differ across ranks fails on every rank that issued it,
          naming each rank's call; no data moves and the set stays usable;
       c. a name some rank lacks waits; once it has waited ``timeout`` seconds on some rank it
          fails, naming the ranks that never issued it;
       d. a rank that joined takes part in every ready allreduce (with zeros) and barrier it
          lacks; any other kind fails on the ranks that issued it while some rank has joined
          ("... is not supported with Join at this time", Horovod's controller: an allgather,
          broadcast, alltoall or reducescatter has no meaning with a rank that left);
       e. when every rank has joined, join completes, returning the last rank to join.
       f. an unnamed collective is "<kind>.noname.<n>", n counting this rank's unnamed
          collectives; a joined rank counts the others' as issued (it cannot issue one itself
          while joined), whether it took part or the collective failed for Join, so after join
          the ranks' next unnamed names agree again. Counted only where it ran, a rank that
          joined first while the others' unnamed allgather failed came back one behind, and at
          4 ranks the next unnamed collective waited out the name timeout (Horovod's
          test_horovod_join_allgather; tests/horovod/test_negotiation.py regression).
       A round that runs nothing sleeps before the next (1 ms, doubling to 20 ms).
    4. Only a rank with something queued enters a round; one with nothing waits on its queue
       without using a core. A rank whose peers have not issued anything yet waits inside the
       fast check like in any collective, until the Group's own timeout (then every pending
       entry fails with HorovodInternalError naming the ranks that never came, and the set is
       closed).
    5. The two limits differ on purpose: ``timeout`` (3c) bounds how long a *name* waits and
       is measured from issue on each rank; the Group's timeout bounds one transport wait and
       is never shorter than comm's default (basics._transport_timeout). With one limit, a
       short stall limit (tests set 3 s) made a rank descheduled for that long on a loaded
       machine look dead and closed the set (tests/horovod/test_negotiation.py regression).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable

import numpy as np

from .. import comm, timeline
from .errors import HorovodInternalError

__all__ = ["Entry", "Coordinator", "JOIN"]

JOIN = "join"
_MASK = (1 << 62) - 1
_SLEEP_FIRST, _SLEEP_MAX = 0.001, 0.02
_NAME_HOLD = 1.0  # seconds a finished, never-synchronized entry keeps its name (NOTE 1)
# The kinds a joined rank takes part in (NOTE [name negotiation] 3d); as in Horovod, the others
# fail while any rank of the set has joined.
_WITH_JOIN = ("allreduce", "barrier")


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


class Entry:
    """One collective issued on this rank.

    ``meta``: a JSON-able list that must be equal on every rank issuing ``name``: its kind first
    (which runner moves the data: :meth:`Coordinator.register`), then op, dtypes, shapes with
    the dimensions that may differ replaced by -1, device type, ...; ``args``: what the runner
    reads (tensors, outputs); ``describe``: one line for error messages.
    """

    __slots__ = ("name", "meta", "describe", "args", "t0", "done", "result", "error",
                 "_meta_json", "callbacks", "t_done", "released", "owner")

    def __init__(self, name: str, meta: list, describe: str, args=None) -> None:
        self.name, self.meta, self.describe, self.args = name, meta, describe, args
        self._meta_json = json.dumps(meta)
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.callbacks: list[Callable] = []
        self.t_done = 0.0
        self.released = False
        self.owner: Coordinator | None = None

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.t_done = time.monotonic()
        self.done.set()
        for cb in self.callbacks:
            cb(self)

    def wait(self):
        """Block until the entry ran and free its name; its result, or raise its error
        (HorovodInternalError)."""
        self.done.wait()
        self.release()
        if self.error is not None:
            raise self.error
        return self.result

    def release(self) -> None:
        """The issuer is done with the entry (its handle was synchronized): its name is free."""
        self.released = True
        if self.owner is not None:
            self.owner._free_name(self)

    def holds_name(self) -> bool:
        """Whether the entry still keeps its name from a new issue (NOTE [name negotiation] 1)."""
        return not self.released and not (self.done.is_set() and time.monotonic() - self.t_done > _NAME_HOLD)


class Coordinator:
    """Runs the entries of one process set in negotiated rounds (NOTE [name negotiation]).

    ``group``: the set's terrapipe Group, used by this coordinator's thread only; ``timeout``:
    seconds a name may wait for the ranks that have not issued it. ``ranks``: global rank of
    each member, for messages.
    """

    def __init__(self, group: comm.Group, timeout: float, ranks: list[int], label: str) -> None:
        self.group, self.timeout, self.ranks, self.label = group, float(timeout), ranks, label
        self._cv = threading.Condition()
        self._queue: list[Entry] = []
        self._names: dict[str, Entry] = {}  # entries holding their names (NOTE [name negotiation] 1)
        self._closing = False
        self._dead: str | None = None
        self._joined_seen: list[int] = []  # ranks seen joined, in the order first seen
        self._fast = np.zeros(4, np.int64)
        self.unnamed = 0  # collectives issued without a name: "<kind>.noname.<n>", as Horovod names them
        self._thread = threading.Thread(target=self._loop, name=f"terrapipe-hvd-{label}", daemon=True)
        self._thread.start()

    # -- issuing ---------------------------------------------------------------------------------
    def submit(self, entry: Entry) -> Entry:
        with self._cv:
            if self._dead:
                raise HorovodInternalError(f"{self.label}: unusable after an earlier failure: {self._dead}")
            if self._closing:
                raise HorovodInternalError(f"{self.label}: Horovod has been shut down")
            held = self._names.get(entry.name)
            if held is not None and held.holds_name():
                raise ValueError(
                    f"{entry.describe}: another collective named {entry.name!r} is still in flight on "
                    f"this rank; names in flight must be unique (wait for it, or use another name)")
            self._names[entry.name] = entry
            entry.owner = self
            self._queue.append(entry)
            self._cv.notify()
        return entry

    def _free_name(self, entry: Entry) -> None:
        with self._cv:
            if self._names.get(entry.name) is entry:
                del self._names[entry.name]

    def close(self, wait: float = 10.0) -> bool:
        """Stop after the queued entries ran; True when the thread has ended."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(wait)
        return not self._thread.is_alive()

    @property
    def dead(self) -> str | None:
        return self._dead

    # -- the thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        sleep = 0.0
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                pending = list(self._queue)
            if sleep:
                time.sleep(sleep)
            try:
                progressed = self._round(pending)
            except BaseException as e:  # a peer died or never came: nothing can run any more
                self._fail_all(e)
                return
            sleep = 0.0 if progressed else min(_SLEEP_MAX, max(_SLEEP_FIRST, 2 * sleep))

    def _fail_all(self, e: BaseException) -> None:
        with self._cv:
            self._dead = f"{type(e).__name__}: {e}"
            pending, self._queue = self._queue, []
            self._names.clear()
        for entry in pending:
            err = HorovodInternalError(f"{entry.describe}: {self._dead}")
            err.__cause__ = e
            entry.finish(error=err)

    def _retire(self, entry: Entry, result=None, error: BaseException | None = None) -> None:
        with self._cv:
            self._queue.remove(entry)
        entry.finish(result, error)

    def _execute(self, entry: Entry | None, meta: list, describe: str):
        """Run one ready collective; a local error (bad input found late) fails only the entry.
        A comm error means the ranks are out of step: it propagates and ends the set."""
        if timeline.enabled() and entry is not None:
            start = timeline.now()
            timeline.record("comm", f"NEGOTIATE_{meta[0].upper()}",
                            start - int((time.monotonic() - entry.t0) * 1e9), start, entry.name)
            entry.callbacks.append(lambda e: timeline.record(
                "comm", meta[0].upper(), start, timeline.now(), e.name,
                {"error": str(e.error)} if e.error is not None else None))
        try:
            result = self._runners[meta[0]](self.group, entry, meta)
        except comm.CommError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the caller through its handle
            if entry is None:
                raise
            self._retire(entry, error=HorovodInternalError(f"{describe}: {e}"))
            return
        if entry is not None:
            self._retire(entry, result)

    def _follow_unnamed(self, name: str) -> None:
        """A joined rank counts the others' unnamed collective as issued, whether it took part
        or the collective failed for Join, so its next unnamed collective gets the same name as
        theirs (3f)."""
        k = _noname_index(name)
        if k is not None:
            with self._cv:
                self.unnamed = max(self.unnamed, k)

    _runners: dict[str, Callable] = {}

    @classmethod
    def register(cls, kind: str, run: Callable) -> None:
        """``run(group, entry, meta) -> result`` moves the data of entries whose ``meta[0]`` is
        ``kind``, on the coordinator's thread; ``entry`` is None on a rank that joined and lacks
        it, which takes part with empty inputs built from ``meta`` (NOTE [name negotiation] 3d)."""
        cls._runners[kind] = run

    # -- rounds ----------------------------------------------------------------------------------
    def _round(self, pending: list[Entry]) -> bool:
        """One negotiation round over ``pending`` (this rank's queue, oldest first); True when
        something ran."""
        g = self.group
        head = pending[0]
        if timeline.marks_cycles():
            timeline.instant("comm", "CYCLE_START", lane=self.label)
        if g.size == 1:
            if head.name == JOIN:
                self._retire(head, self.ranks[0])
            else:
                self._execute(head, head.meta, head.describe)
            return True
        v = self._fast
        v[0], v[1] = _h(head.name), _h(head._meta_json)
        v[2], v[3] = -v[0], -v[1]
        comm.allreduce(v, "max", group=g)
        if v[0] == -v[2] and v[1] == -v[3]:  # NOTE [name negotiation] 2: every head the same
            if head.name == JOIN:
                fresh = [r for r in range(g.size) if r not in self._joined_seen]
                last = max(fresh) if fresh else self._joined_seen[-1]
                self._joined_seen = []
                self._retire(head, self.ranks[last])
            else:
                self._execute(head, head.meta, head.describe)
            return True
        return self._slow_round(pending)

    def _slow_round(self, pending: list[Entry]) -> bool:
        g = self.group
        now = time.monotonic()
        mine = [[e.name, e.meta, now - e.t0, e.describe] for e in pending]
        lists = [json.loads(b) for b in _allgather_bytes(g, json.dumps(mine).encode())]
        joined = [any(item[0] == JOIN for item in lst) for lst in lists]
        for r, j in enumerate(joined):
            if j and r not in self._joined_seen:
                self._joined_seen.append(r)
        by_name: dict[str, dict[int, list]] = {}
        for r, lst in enumerate(lists):
            for item in lst:
                by_name.setdefault(item[0], {})[r] = item
        local = {e.name: e for e in pending}
        if all(joined):
            last = self._joined_seen[-1]
            self._joined_seen = []
            self._retire(local[JOIN], self.ranks[last])
            return True
        progressed = False
        for name, have in by_name.items():  # insertion order: rank 0's list first (3a)
            if name == JOIN:
                continue
            missing = [r for r in range(g.size) if r not in have and not joined[r]]
            entry = local.get(name)
            first = next(iter(have.values()))
            if missing:
                age = max(item[2] for item in have.values())
                if age > self.timeout and entry is not None:  # 3c
                    who = ", ".join(f"rank {self.ranks[r]}" for r in missing)
                    self._retire(entry, error=HorovodInternalError(
                        f"{entry.describe}: {who} did not issue it within {self.timeout:g}s "
                        f"(issued by {', '.join(f'rank {self.ranks[r]}' for r in have)})"))
                    progressed = True
                continue
            metas = {json.dumps(item[1]) for item in have.values()}
            if len(metas) > 1:  # 3b
                if entry is not None:
                    calls = "; ".join(f"rank {self.ranks[r]}: {item[3]}" for r, item in sorted(have.items()))
                    self._retire(entry, error=HorovodInternalError(
                        f"{name}: ranks issued it with different arguments: {calls}"))
                progressed = True
                continue
            meta = first[1]
            if any(joined) and meta[0] not in _WITH_JOIN:  # 3d
                if entry is None:  # 3f: counted as issued here too, or the next unnamed names differ
                    self._follow_unnamed(name)
                else:
                    self._retire(entry, error=HorovodInternalError(
                        f"{first[3]}: {meta[0].capitalize()} is not supported with Join at this time"
                        + (" (sparse gradients: DistributedOptimizer(sparse_as_dense=True))"
                           if meta[0] == "allgather" else "")))
                progressed = True
                continue
            if entry is None:
                self._follow_unnamed(name)
            self._execute(entry, meta, first[3])  # 3a, 3d
            progressed = True
        return progressed


def _noname_index(name: str) -> int | None:
    head, _, tail = name.rpartition(".noname.")
    return int(tail) if head and tail.isdigit() else None


def _allgather_bytes(g: comm.Group, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` in rank order: lengths, then one allgather padded to the longest."""
    n = np.array([len(payload)], np.int64)
    lengths = comm.allgather(n, group=g)[:, 0]
    buf = np.zeros(int(lengths.max()), np.uint8)
    buf[:len(payload)] = np.frombuffer(payload, np.uint8)
    rows = comm.allgather(buf, group=g)
    return [rows[r, :int(lengths[r])].tobytes() for r in range(g.size)]
