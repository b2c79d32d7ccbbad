"""One Chrome trace for the job: loader, collectives and engine on one clock (standard library only;
imports no terrapipe layer, so every layer may record into it).

Turned on by ``TERRAPIPE_TIMELINE=path.json`` (``terrapipe run --timeline path.json`` sets it) or
:func:`start`; off by default. Each rank writes its part ``path.json.rank<r>`` (one JSON event per
line) while it runs; when the job ends the parts become one trace ``path.json``, one process track
per rank, readable in Perfetto and chrome://tracing (NOTE [one trace per job]). ``terrapipe
timeline summary path.json`` tells, per rank, how much of each step waited for data, computed, and
waited on communication (terrapipe/timeline_summary.py).

NOTE [timeline recording]
    1. Off costs one global read: every recorder returns at once when nothing records, and
       :func:`span` hands out one shared no-op context manager.
    2. No lock on the recording path. Each thread appends tuples to its own ring (a deque, found
       through ``threading.local``); only the background writer pops from it. A ring holds at most
       ``capacity`` events: a full ring refuses new events and counts them (:func:`dropped`), so
       memory is bounded by ``capacity`` per recording thread whatever the job does.
    3. A daemon writer thread drains every ring each ``FLUSH_S`` seconds (and on :func:`flush` /
       :func:`stop` / exit) into the part file, naming each recording thread's row on first sight.
    4. Times are ``time.monotonic_ns()`` plus this process's offset, in microseconds in the file.
       CLOCK_MONOTONIC is one clock for every process of a machine; between machines comm.init
       measures each rank's offset to rank 0 (:func:`estimate_offset`, the round trip with the
       least delay of several) and sets it here, so ranks share rank 0's clock to within half that
       round trip.
    5. Rows: one per recording thread (named after the thread: ``MainThread``,
       ``terrapipe-loader_k``, ``terrapipe-comm_k``); ``lane=`` gives events a row of their own,
       named ``lane`` (Horovod's timeline keeps a row per tensor name). Complete events
       (``"ph": "X"``) of one row nest; work that overlaps other work on its thread (an async
       collective from issue to completion) is an async event pair (``"b"`` / ``"e"``, matched
       by ``id``).

NOTE [one trace per job]
    1. Whoever launched the job, ``TERRAPIPE_TIMELINE=path.json`` ends with one trace at
       ``path.json`` and no parts beside it. Each rank of a launched job (``mpiexec``, ``terrapipe
       run``, torchrun: :mod:`terrapipe.launch_env` knows its rank and world size) leaves a mark
       ``path.json.rank<r>.done`` at exit, after its part is complete; the rank that sees every
       rank's mark takes the merge (an exclusive create of ``path.json.merging``, so exactly one
       does) and removes parts and marks. A lone process merges its own part.
    2. A rank that dies leaves no mark, so no rank merges; ``terrapipe run`` merges what the ranks
       left when the job ends, and ``terrapipe timeline merge path.json`` does it by hand.
    3. The marks live beside the trace: on several machines that share no file system each
       machine's parts stay there (``terrapipe timeline merge`` once they are brought together).
    4. Only a rank's main process records from the variable. A helper process it starts with
       ``multiprocessing`` (spawn or forkserver) imports this module with the same environment, and
       would otherwise write over its rank's part and mark it done early.
    5. A live trace (``start(path, live=True)``: Horovod's ``HOROVOD_TIMELINE``, which rank 0
       alone records) has no parts, marks or merge: the process writes ``path`` itself, every
       ``LIVE_FLUSH_S``. Each drain is one ``pwrite`` of its events and a closing ``]`` at the
       offset of the last ``]``, so between drains the file is one whole JSON array that a reader
       may open mid-run (as Horovod keeps its coordinator's file); a read that overlaps the
       write's own copy into the page cache (microseconds, not the drain) can see a mix, and a
       reader that fails to parse reads again.
    6. Each rank's ``process_name`` row carries ``start_time_since_epoch_in_micros``, Horovod's
       field: the wall-clock time at ``ts = 0``, so a tool puts an event at that plus ``ts``.

Why one module: it is a leaf every layer imports (standard library only); recording,
parts and the merge at exit share one file format and one clock.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import glob
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

__all__ = ["enabled", "now", "span", "record", "phase", "instant", "async_begin", "async_end", "start",
           "stop", "flush", "dropped", "path", "live", "marks_cycles", "set_clock_offset", "clock_offset",
           "estimate_offset", "has_parts", "merge", "load", "CAPACITY", "FLUSH_S", "LIVE_FLUSH_S"]

CAPACITY = 1 << 16  # events per recording thread between two drains (NOTE [timeline recording] 2)
FLUSH_S = 0.5  # seconds between drains (NOTE [timeline recording] 3)
LIVE_FLUSH_S = 0.05  # a live trace's (NOTE [one trace per job] 5): a reader sees a span soon after

_on = False
_path: str | None = None
_mark_cycles = False
_offset_ns = 0
_gen = 0  # bumped by start(): rings of an earlier recording are not reused
_local = threading.local()
_rings: list[_Ring] = []
_rings_lock = threading.Lock()  # taken when a thread makes its ring, and by the writer
_writer: _Writer | None = None


class _Ring:
    __slots__ = ("events", "dropped", "thread", "gen")

    def __init__(self, thread: threading.Thread, gen: int) -> None:
        self.events: collections.deque = collections.deque()
        self.dropped = 0
        self.thread = thread
        self.gen = gen


def _ring() -> _Ring:
    ring = getattr(_local, "ring", None)
    if ring is None or ring.gen != _gen:
        ring = _local.ring = _Ring(threading.current_thread(), _gen)
        with _rings_lock:
            _rings.append(ring)
    return ring


def _push(event: tuple) -> None:
    ring = _ring()
    if len(ring.events) >= CAPACITY:  # only the writer shrinks it meanwhile: the count is exact
        ring.dropped += 1
        return
    ring.events.append(event)


# -- recording ---------------------------------------------------------------------------------
def enabled() -> bool:
    """Whether events are being recorded."""
    return _on


def now() -> int:
    """The timeline's clock: nanoseconds, monotonic, shared by the ranks (NOTE [timeline recording] 4)."""
    return time.monotonic_ns() + _offset_ns


def record(cat: str, name: str, start: int, end: int, lane: str | None = None,
           args: dict | None = None) -> None:
    """A complete event from ``start`` to ``end`` (:func:`now` nanoseconds) on this thread's row
    (or its row ``lane``). ``cat``: the layer ("loader", "comm", "engine"); ``args``: small,
    JSON-serializable details shown with the event."""
    if _on:
        _push(("X", cat, name, start, end - start, lane, args))


def phase(cat: str, name: str, start: int, args: dict | None = None) -> int:
    """Record ``[start, now]`` as a complete event and return now: consecutive phases of one
    piece of work (``t = phase("comm", "copy in", t)``) at one clock read each. Call it only
    when :func:`enabled` (the caller keeps ``t`` only then)."""
    t = now()
    _push(("X", cat, name, start, t - start, None, args))
    return t


def instant(cat: str, name: str, when: int | None = None, lane: str | None = None,
            args: dict | None = None) -> None:
    """A point in time (default: now) on this thread's row (an epoch's start, a bucket ready)."""
    if _on:
        _push(("i", cat, name, now() if when is None else when, 0, lane, args))


def async_begin(cat: str, name: str, ident: int, args: dict | None = None) -> None:
    """Start async event ``ident`` (unique among this process's open async events of ``cat``):
    work that overlaps the thread that started it, ended by :func:`async_end` on any thread."""
    if _on:
        _push(("b", cat, name, now(), ident, None, args))


def async_end(cat: str, name: str, ident: int, args: dict | None = None) -> None:
    if _on:
        _push(("e", cat, name, now(), ident, None, args))


class _Span:
    __slots__ = ("cat", "name", "lane", "args", "t0")

    def __init__(self, cat: str, name: str, lane: str | None, args: dict | None) -> None:
        self.cat, self.name, self.lane, self.args = cat, name, lane, args

    def __enter__(self) -> _Span:
        self.t0 = now()
        return self

    def __exit__(self, kind, value, tb) -> None:
        args = self.args
        if kind is not None:
            args = dict(args or {}, error=f"{kind.__name__}: {value}")
        record(self.cat, self.name, self.t0, now(), self.lane, args)


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind, value, tb) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(cat: str, name: str, lane: str | None = None, args: dict | None = None):
    """``with span("loader", "decode"): ...`` records the block as a complete event (with the
    error, if it raised). Off: a shared no-op (NOTE [timeline recording] 1)."""
    if not _on:
        return _NO_SPAN
    return _Span(cat, name, lane, args)


def dropped() -> int:
    """Events refused so far by full rings (NOTE [timeline recording] 2)."""
    with _rings_lock:
        return sum(r.dropped for r in _rings)


# -- clock -------------------------------------------------------------------------------------
def set_clock_offset(offset_ns: int) -> None:
    """Add ``offset_ns`` to this process's clock from now on (comm.init sets rank 0's offset)."""
    global _offset_ns
    _offset_ns = int(offset_ns)


def clock_offset() -> int:
    return _offset_ns


def estimate_offset(exchange: Callable[[int], int], rounds: int = 8,
                    clock: Callable[[], int] = time.monotonic_ns) -> tuple[int, int]:
    """This process's offset to a reference clock: ``(offset_ns, bound_ns)``, such that
    ``clock() + offset_ns`` reads the reference's clock to within ``bound_ns``.

    ``exchange(t)`` sends ``t`` to the reference and returns the reference's clock reading taken
    between receiving and answering. Of ``rounds`` round trips the one with the least delay wins
    (Cristian's algorithm): the reference read its clock somewhere inside that round trip, so the
    midpoint is wrong by at most half of it."""
    best = None
    for _ in range(max(1, rounds)):
        t1 = clock()
        ref = exchange(t1)
        t2 = clock()
        if best is None or t2 - t1 < best[0]:
            best = (t2 - t1, ref - (t1 + t2) // 2)
    rtt, offset = best
    return int(offset), int(rtt // 2 + 1)


# -- control -----------------------------------------------------------------------------------
def path() -> str | None:
    """The trace being recorded (None when not recording)."""
    return _path


def marks_cycles() -> bool:
    return _on and _mark_cycles


def start(path: str, mark_cycles: bool = False, live: bool = False) -> None:
    """Record from now on into ``path`` (this process writes ``<path>.rank<r>``; :func:`merge`
    joins the parts). A recording already running is stopped (and written) first.
    ``mark_cycles``: Horovod's coordinator rounds as ``CYCLE_START`` instants. ``live``: this
    process writes ``path`` itself, a whole Chrome trace at every moment, with no parts and no
    merge (NOTE [one trace per job] 5)."""
    global _on, _path, _mark_cycles, _gen, _writer
    if not path:
        raise ValueError("timeline.start: path must be a file name")
    if _on:
        stop()
    target = os.path.abspath(path)
    writer = _Writer(target if live else f"{target}.rank{_rank()}", live)  # raises naming the file
    _path, _mark_cycles = target, bool(mark_cycles)
    with _rings_lock:
        _rings.clear()
        _gen += 1
    _writer = writer
    writer.start()
    _on = True


def stop(write: bool = True) -> list[dict]:
    """Stop recording; returns this process's events (metadata rows first). With ``write`` they
    stay in its part file (a live trace: in ``path``); without, that file is removed. Not
    recording: ``[]``."""
    global _on, _path, _writer
    if not _on:
        return []
    _on = False
    writer, _writer = _writer, None
    writer.close()
    if writer.file is None:  # nothing was recorded
        _path = None
        return []
    _path = None
    try:
        events = load(writer.part) if writer.live else _read_part(writer.part)
    except FileNotFoundError:  # removed while recording (a test's temporary folder): nothing to keep
        return []
    if not write:
        os.unlink(writer.part)
    return events


def live() -> bool:
    """Whether a live trace (NOTE [one trace per job] 5) is being recorded."""
    writer = _writer
    return writer is not None and writer.live


def flush() -> None:
    """Write every event recorded so far to the part file now."""
    writer = _writer
    if writer is not None:
        writer.drain()


def _rank() -> int:
    from . import launch_env

    return launch_env.world()[0]


class _Writer(threading.Thread):
    """Drains the rings into the part file (NOTE [timeline recording] 3)."""

    def __init__(self, part: str, live: bool = False) -> None:
        super().__init__(name="terrapipe-timeline", daemon=True)
        self.part = part
        self.live = live
        self.lines = 0  # a live trace: events written, its drain's text, where its "]" starts
        self.pending: list[str] = []
        self.tail = 0
        self.rank = _rank()
        folder = os.path.dirname(part)
        if not os.access(folder, os.W_OK):
            raise OSError(f"timeline: cannot write {part}: no write access to {folder}")
        # Opened at the first event: a process that records nothing (the launcher itself, which
        # sees the same variable) writes no part and so never clobbers a rank's.
        self.file = None
        self.closed = False
        self.lock = threading.Lock()  # one drain at a time (the thread, flush(), close())
        self.halt = threading.Event()
        self.rows: dict[tuple[int, str | None], int] = {}
        self.reported_dropped = 0

    def _open(self) -> None:
        try:  # a live trace is written with os.pwrite (NOTE [one trace per job] 5)
            self.file = open(self.part, "wb" if self.live else "w", buffering=0 if self.live else -1)  # noqa: SIM115
        except OSError as e:
            raise OSError(f"timeline: cannot write {self.part}: {e}") from e
        pid = self.rank
        if self.live:
            self.pending.append("[\n")
        epoch_us = (time.time_ns() - now()) // 1000  # NOTE [one trace per job] 6
        self._line({"ph": "M", "name": "process_name", "pid": pid,
                    "args": {"name": f"rank {pid}", "start_time_since_epoch_in_micros": epoch_us}})
        self._line({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})

    def _line(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":"))
        if not self.live:
            self.file.write(line)
            self.file.write("\n")
            return
        if self.lines:
            self.pending.append(",\n")
        self.pending.append(line)
        self.lines += 1

    def run(self) -> None:
        while not self.halt.wait(LIVE_FLUSH_S if self.live else FLUSH_S):
            self.drain()

    def _tid(self, ring: _Ring, lane: str | None) -> int:
        key = (id(ring), lane)
        tid = self.rows.get(key)
        if tid is None:
            tid = self.rows[key] = len(self.rows)
            name = ring.thread.name if lane is None else lane
            self._line({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                        "args": {"name": name}})
        return tid

    def drain(self) -> None:
        with self.lock:
            if self.closed:
                return
            with _rings_lock:
                rings = list(_rings)
            if self.file is None:
                if not any(r.events or r.dropped for r in rings):
                    return
                self._open()
            pid = self.rank
            for ring in rings:
                events = ring.events
                while events:
                    ph, cat, name, ts, extra, lane, args = events.popleft()
                    e = {"ph": ph, "cat": cat, "name": name, "pid": pid, "tid": self._tid(ring, lane),
                         "ts": ts / 1000}
                    if ph == "X":
                        e["dur"] = extra / 1000
                    elif ph == "i":
                        e["s"] = "t"
                    else:
                        e["id"] = extra
                    if args:
                        e["args"] = args
                    self._line(e)
            lost = sum(r.dropped for r in rings)
            if lost > self.reported_dropped:
                self._line({"ph": "i", "s": "p", "cat": "timeline", "name": "events dropped", "pid": pid,
                            "tid": 0, "ts": now() / 1000, "args": {"dropped": lost}})
                self.reported_dropped = lost
            if self.live:
                self._write_live()
            else:
                self.file.flush()

    def _write_live(self) -> None:
        """The drain's events and the closing bracket in one write over the last bracket (NOTE
        [one trace per job] 5)."""
        if not self.pending:
            return
        chunk = "".join(self.pending).encode()
        self.pending.clear()
        os.pwrite(self.file.fileno(), chunk + b"\n]\n", self.tail)
        self.tail += len(chunk)

    def close(self) -> None:
        self.halt.set()
        if self.is_alive():
            self.join()
        self.drain()
        with self.lock:
            self.closed = True
            if self.file is not None:
                self.file.close()


def _at_exit() -> None:
    if not _on:
        return
    trace, recorded, alone = _path, _writer is not None and _writer.file is not None, live()
    stop()
    if not alone:  # a live trace is whole already (NOTE [one trace per job] 5)
        _finish_job(trace, recorded)


def _finish_job(trace: str, recorded: bool) -> None:
    """This rank's end of NOTE [one trace per job] 1: mark its part complete, and merge the
    parts if every rank of the job has."""
    from . import launch_env

    launched = launch_env.mpi_launched() or launch_env.torch_launched()
    rank, size = launch_env.world()
    if not launched and not recorded:
        return  # not a rank (a launcher sees the variable too), and nothing of its own to merge
    try:
        with open(f"{trace}.rank{rank}.done", "w"):
            pass
        if not all(os.path.exists(f"{trace}.rank{r}.done") for r in range(size)):
            return  # a rank still running merges
        fd = os.open(f"{trace}.merging", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return  # another rank merges (or the folder went away): nothing of this rank is lost
    os.close(fd)
    try:
        if _parts(trace):
            merge(trace)
    finally:
        _clear_marks(trace)


def _clear_marks(trace: str) -> None:
    for mark in glob.glob(glob.escape(trace) + ".rank*.done") + [trace + ".merging"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mark)


atexit.register(_at_exit)


# -- files -------------------------------------------------------------------------------------
def _read_part(part: str) -> list[dict]:
    out = []
    with open(part) as f:
        for k, line in enumerate(f):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                # A rank killed mid-write leaves one partial last line; anything else is damage.
                if f.readline():
                    raise ValueError(f"timeline: {part}: line {k + 1} is not a JSON event") from None
    return out


def _parts(path: str) -> list[str]:
    """The ranks' part files ``<path>.rank<r>``, in rank order (not ``.tmp`` leftovers)."""
    prefix = len(path) + len(".rank")
    parts = [p for p in glob.glob(glob.escape(path) + ".rank*") if p[prefix:].isdigit()]
    return sorted(parts, key=lambda p: int(p[prefix:]))


def has_parts(path: str) -> bool:
    """Whether ranks' parts ``<path>.rank<r>`` wait to be merged."""
    return bool(_parts(path))


def merge(path: str) -> int:
    """Join the ranks' parts ``<path>.rank*`` into ``path`` (one JSON array, ranks in order) and
    remove them; returns the number of events. No parts: ValueError naming ``path``."""
    parts = _parts(path)
    if not parts:
        raise ValueError(f"timeline.merge: no parts {path}.rank<r> to merge")
    events = [e for part in parts for e in _read_part(part)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("[\n")
        f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in events))
        f.write("\n]\n")
    os.replace(tmp, path)
    for part in parts:
        os.unlink(part)
    _clear_marks(path)
    return len(events)


def load(path: str) -> list[dict]:
    """The events of trace ``path``: a merged file (a JSON array, or an object with
    ``traceEvents``), or, when only the parts exist, the parts."""
    parts = _parts(path)
    if not os.path.exists(path) and parts:
        return [e for part in parts for e in _read_part(part)]
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("traceEvents", [])
    if not isinstance(data, list):
        raise ValueError(f"timeline: {path} is not a Chrome trace (a JSON array of events)")
    return data


def _start_from_settings() -> None:
    from . import settings  # a leaf too

    trace = settings.get("TERRAPIPE_TIMELINE")
    if trace and multiprocessing.current_process().name == "MainProcess":
        start(trace)  # NOTE [one trace per job] 4


_start_from_settings()
