"""The worker's side of an elastic job's rendezvous: which generation of the job this process
belongs to, at which rank, and the group it forms with that generation's other members.

An elastic job (``terrapipe run --horovod --min-np ...``, terrapipe/engine/elastic.py) has no
fixed world. Its launcher hosts a key-value store (torch c10d's ``TCPStore``) and decides the
members of each *generation*: the workers alive and wanted at that moment, in rank order. A
worker joins a generation with :func:`join` and leaves it with ``comm.finalize()``; after a
failure it joins the next one.

NOTE [elastic generations]
    The store's keys (values are JSON text, never pickles):

    1. ``elastic/latest``: the newest generation's number, a counter the launcher alone
       increments (read with ``add(key, 0)``, which never blocks).
    2. ``elastic/gen/<g>``: ``{"members": [worker ids in rank order], "why": "...", "update":
       flags}``, written before ``latest`` reaches ``g``. ``update`` is Horovod's
       HostUpdateResult: 1 workers removed, 2 added, 3 both. A member of an older generation
       learns of it with :func:`pending_update` (hvd.elastic's ``check_host_updates``).
    3. ``elastic/gen/<g>/ready/<worker>``: set by each member that came to generation ``g``;
       ``elastic/gen/<g>/go``: set by the launcher once every member is ready. A member waits
       for ``go`` before it builds the group, so no member builds a group with a worker that
       died before it arrived: the launcher, seeing that death, publishes ``g + 1`` instead,
       and the waiting members move on to it (a generation superseded before ``go`` is dropped).
    4. ``elastic/reset/<g>/<worker>``: a member of ``g`` whose group failed asks for a newer
       generation (the launcher also makes one, unasked, when a worker's process ends or the
       hosts change).
    5. ``elastic/removed/<worker>``: the launcher took this worker out of the job (its host
       left the discovery script's list): :func:`join` raises :class:`WorkerRemoved`.
    6. Each generation's group sets itself up under ``elastic/gen/<g>/group`` (a
       :class:`~terrapipe.comm.store.StoreComm` prefix): a fresh segment, fresh keys, nothing
       shared with an earlier generation's group.

NOTE [a launcher that dies]
    1. The launcher is the job's one coordinator: it alone forms generations, and the store
       lives in its process. Without it a worker could train on until its next failure or
       update and then wait for a generation that never comes, or finish with nobody to
       collect its exit code. So, as horovodrun's workers die with it, every worker stops
       when its launcher is gone, whatever it is doing (a step, a collective, a wait).
    2. How a worker knows: a daemon thread (:func:`_watch_launcher`), started with the first
       connection, asks the store a question every ``_WATCH_SECONDS`` over a connection of
       its own. When the question fails and a new connection to the launcher's port is
       refused or times out too, the launcher is gone (a launcher that is only slow still
       accepts connections): the worker says so on stderr, naming the launcher's address,
       and sends itself SIGTERM. Its segments were unlinked when made (NOTE [shm segment
       lifetime] in comm/transports/shm.py) and its loader's processes die with it (NOTE
       [the loader's worker process] in pipeline/worker_process.py), so nothing is left behind.
    3. A script that handles SIGTERM (to save a checkpoint) gets the chance; otherwise the
       process ends at once. Remote workers stop the same way, and their ``ssh`` sessions
       end with them.
    4. The watcher is stopped and joined at exit (an ``atexit`` hook, :func:`_stop_watching`),
       before the interpreter finalizes. A daemon thread still running then is ended by
       Python (``pthread_exit``) when it next takes the GIL; the watcher's question is a call
       into torch's C++ that releases the GIL, and one returning during finalization retakes
       it in a destructor, where the unwinding aborts the process ("terminate called without
       an active exception", SIGABRT, exit code -6 for a job that had finished). Joining waits
       for at most the question in flight (the watcher's store timeout, ``_WATCH_TIMEOUT``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from .. import settings
from .errors import CollectiveTimeoutError, CommError

__all__ = ["Generations", "LauncherGone", "Membership", "WorkerRemoved", "is_elastic", "join",
           "last_generation", "connect", "pending_update"]

_POLL = 0.02  # seconds between looks at the store while waiting for the launcher
_WATCH_SECONDS = 0.5  # between questions to the launcher's store (NOTE [a launcher that dies] 2)
_WATCH_TIMEOUT = 10.0  # seconds one question may take before the port itself is tried


class WorkerRemoved(CommError):
    """The launcher took this worker out of the job (its host was removed); it should exit."""


class LauncherGone(CommError):
    """The elastic job's launcher is gone: its store no longer answers (NOTE [a launcher that
    dies]); the job is over."""


@contextlib.contextmanager
def _asking_the_launcher():
    """Turn a lost connection to the launcher's store into :class:`LauncherGone`, which names
    the launcher, where torch's error names a socket."""
    try:
        yield
    except Exception as e:
        from torch.distributed import DistNetworkError

        if not isinstance(e, DistNetworkError):
            raise
        raise LauncherGone(_gone_message(settings.get("TERRAPIPE_ELASTIC"), _first_line(e))) from e


def _first_line(e: Exception) -> str:
    """The first line of ``e``'s text (torch's errors append a C++ backtrace), or its type."""
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__


def _gone_message(where: str, why: str) -> str:
    worker = settings.get("TERRAPIPE_ELASTIC_WORKER")
    return (f"worker {worker}: the elastic job's launcher ({where}) is gone ({why}); this worker stops "
            "(NOTE [a launcher that dies])")


@dataclass(frozen=True)
class Membership:
    """This worker's place in one generation: ``generation``, ``rank`` of ``size``, and every
    member's worker id in rank order (``members``)."""

    generation: int
    rank: int
    size: int
    members: tuple[str, ...]


_client = None  # the store connection, one per process, reused by every generation
_last = 0  # the newest generation this process joined
_watcher: threading.Thread | None = None  # NOTE [a launcher that dies] 2, started with _client
_stop_watch = threading.Event()  # set at exit (NOTE [a launcher that dies] 4)


def is_elastic() -> bool:
    """Whether this process was started by an elastic launcher (``TERRAPIPE_ELASTIC`` set)."""
    return bool(settings.get("TERRAPIPE_ELASTIC"))


def connect(timeout: float):
    """The launcher's store (``TERRAPIPE_ELASTIC`` = ``host:port``), connected once."""
    global _client, _watcher
    if _client is None:
        from torch.distributed import TCPStore

        where = settings.get("TERRAPIPE_ELASTIC")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"TERRAPIPE_ELASTIC: expected host:port, got {where!r}")
        _client = TCPStore(host, int(port), is_master=False,
                           timeout=datetime.timedelta(seconds=float(timeout)))
        _watcher = threading.Thread(target=_watch_launcher, args=(host, int(port)),
                                    name="terrapipe-launcher-watch", daemon=True)
        _watcher.start()
        atexit.register(_stop_watching)
    return _client


def _stop_watching() -> None:
    """NOTE [a launcher that dies] 4: stop the watcher and wait for its question in flight."""
    _stop_watch.set()
    if _watcher is not None and _watcher is not threading.current_thread():
        _watcher.join()


def _watch_launcher(host: str, port: int) -> None:
    """NOTE [a launcher that dies] 2: stop this process once the launcher is gone."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=_WATCH_TIMEOUT))
    except Exception:  # noqa: BLE001 - the main connection reports what is wrong
        return
    while not _stop_watch.wait(_WATCH_SECONDS):
        try:
            store.check(["elastic/latest"])
            continue
        except Exception as e:  # noqa: BLE001 - whatever the store raises, ask the port itself
            why = _first_line(e)
        try:
            socket.create_connection((host, port), timeout=2).close()
            continue  # it still accepts connections: only slow
        except OSError as e:
            why = f"{why}; connecting again: {e}"
        print(f"terrapipe: {_gone_message(f'{host}:{port}', why)}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        return


def last_generation() -> int:
    """The newest generation this process joined (0: none yet)."""
    return _last


def _worker() -> str:
    worker = settings.get("TERRAPIPE_ELASTIC_WORKER")
    if not worker:
        raise ValueError("TERRAPIPE_ELASTIC_WORKER is not set: this process was not started by "
                         "an elastic launcher (terrapipe run --horovod --min-np ...)")
    return worker


def join(timeout: float) -> tuple[Membership, object]:
    """Join the first generation newer than the last one this process joined (or, for a worker
    the launcher started for generation g, g itself: ``TERRAPIPE_ELASTIC_FIRST``) that has this
    worker as a member; returns it and the store (NOTE [elastic generations]).

    Waits at most ``timeout`` seconds for the launcher (CollectiveTimeoutError after that);
    raises :class:`WorkerRemoved` when the launcher took this worker out of the job.
    """
    with _asking_the_launcher():
        return _join(timeout)


def _join(timeout: float) -> tuple[Membership, object]:
    global _last
    store = connect(timeout)
    me = _worker()
    after = _last or settings.get("TERRAPIPE_ELASTIC_FIRST") - 1
    if _last:
        store.set(f"elastic/reset/{_last}/{me}", "1")  # 4: our generation is over
    deadline = time.monotonic() + timeout
    while True:
        if store.check([f"elastic/removed/{me}"]):
            raise WorkerRemoved(f"worker {me}: removed from the job by its launcher")
        latest = int(store.add("elastic/latest", 0))
        if latest > after:
            members = json.loads(store.get(f"elastic/gen/{latest}"))["members"]
            if me in members and _ready(store, latest, me, deadline):
                _last = latest
                return Membership(latest, members.index(me), len(members), tuple(members)), store
            after = latest  # superseded before its go, or a generation without this worker
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"worker {me}: no generation of the elastic job after {after} came within "
                f"{timeout:g}s (is the launcher alive?)", [])
        time.sleep(_POLL)


def _ready(store, g: int, me: str, deadline: float) -> bool:
    """Mark ``me`` ready in generation ``g`` and wait for its ``go`` (True), or for a newer
    generation superseding it (False) (NOTE [elastic generations] 3)."""
    store.set(f"elastic/gen/{g}/ready/{me}", "1")
    while time.monotonic() <= deadline:
        if store.check([f"elastic/gen/{g}/go"]):
            return True
        if int(store.add("elastic/latest", 0)) > g:
            return False
        time.sleep(_POLL)
    return False


def pending_update() -> tuple[int, int]:
    """``(latest, flags)``: the newest generation the launcher formed, and the union of the
    ``update`` flags of every generation newer than the one this process joined (0: none; 1
    workers removed, 2 added). ``(0, 0)`` outside an elastic job or before the first join."""
    if _client is None or not _last:
        return 0, 0
    with _asking_the_launcher():
        latest = int(_client.add("elastic/latest", 0))
        flags = 0
        for g in range(_last + 1, latest + 1):
            flags |= int(json.loads(_client.get(f"elastic/gen/{g}")).get("update", 0))
    return latest, flags


def superseded(store, g: int):
    """A predicate for waits inside generation ``g``'s set-up: why to give up (a newer
    generation exists), or None."""
    def check() -> str | None:
        with _asking_the_launcher():
            latest = int(store.add("elastic/latest", 0))
        return f"generation {g} was superseded by {latest}" if latest > g else None

    return check


class Generations:
    """The launcher's side of NOTE [elastic generations]: it alone writes generations into
    ``store`` (a c10d Store it hosts) and reads the workers' answers."""

    def __init__(self, store) -> None:
        self.store = store
        self.latest = 0

    def publish(self, members: list[str], why: str, update: int) -> int:
        """Make generation ``latest + 1`` of ``members`` (worker ids, in rank order); ``update``:
        1 workers were removed since the last one, 2 added, 3 both (2). Returns its number."""
        g = self.latest + 1
        self.store.set(f"elastic/gen/{g}", json.dumps({"members": list(members), "why": why,
                                                       "update": int(update)}))
        self.latest = int(self.store.add("elastic/latest", 1))
        if self.latest != g:
            raise RuntimeError(f"elastic/latest is {self.latest}, expected {g}: two launchers share a store")
        return g

    def ready(self, g: int, members: list[str]) -> list[str]:
        """The members of ``g`` that came to it (3)."""
        return [m for m in members if self.store.check([f"elastic/gen/{g}/ready/{m}"])]

    def go(self, g: int) -> None:
        """Every member of ``g`` came: they may build its group (3)."""
        self.store.set(f"elastic/gen/{g}/go", "1")

    def resets(self, g: int, members: list[str]) -> list[str]:
        """The members of ``g`` that asked for a newer generation (4)."""
        return [m for m in members if self.store.check([f"elastic/reset/{g}/{m}"])]

    def remove(self, worker: str) -> None:
        """Take ``worker`` out of the job (5)."""
        self.store.set(f"elastic/removed/{worker}", "1")
