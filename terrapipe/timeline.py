"""Chrome-trace recording shared by every layer (standard library only; imports no terrapipe layer).

With ``TERRAPIPE_TIMELINE=path.json`` (``terrapipe run --timeline-filename path.json`` sets it)
each process records complete events (``"ph": "X"``, ``pid`` = its rank, ``cat`` the layer:
"comm", "loader", "engine") and writes them at exit to ``path.json.rank<r>``; ``terrapipe run``
then merges the parts into ``path.json`` (or ``python -m terrapipe.timeline merge path.json``),
one trace for the job, readable in chrome://tracing or Perfetto. Times are wall-clock
microseconds, so ranks on one machine line up. Without the variable nothing is recorded.
:func:`start` / :func:`stop` turn recording on and off while a process runs (Horovod's
``hvd.start_timeline`` / ``hvd.stop_timeline``); ``mark_cycles`` also records each round of a
Horovod coordinator as a ``CYCLE_START`` instant.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import sys
import threading

__all__ = ["enabled", "record", "instant", "snapshot", "flush", "merge", "start", "stop", "path",
           "marks_cycles"]

_PATH = os.environ.get("TERRAPIPE_TIMELINE") or None
_events: list[dict] = []
_tids: dict[str, int] = {}
_lock = threading.Lock()
_mark_cycles = False


def enabled() -> bool:
    return _PATH is not None


def path() -> str | None:
    """The file being recorded to (None when not recording)."""
    return _PATH


def marks_cycles() -> bool:
    return _PATH is not None and _mark_cycles


def start(path: str, mark_cycles: bool = False) -> None:
    """Record from now on into ``<path>.rank<r>`` (this process's part; :func:`merge` joins
    the parts). Events recorded before, for another path, are dropped."""
    global _PATH, _mark_cycles
    if not path:
        raise ValueError("timeline.start: path must be a file name")
    with _lock:
        _PATH, _mark_cycles = os.path.abspath(path), bool(mark_cycles)
        _events.clear()
        _tids.clear()


def stop(write: bool = True) -> list[dict]:
    """Stop recording; returns this process's events (with their row names), which are also
    written to its part file when ``write``. Nothing recorded: an empty list."""
    global _PATH
    if _PATH is None:
        return []
    events = snapshot()
    if write:
        _write(events)
    with _lock:
        _PATH = None
        _events.clear()
        _tids.clear()
    return events


def _rank() -> int:
    from . import launch_env

    return launch_env.world()[0]


def record(cat: str, name: str, start: float, end: float, lane: str = "", args: dict | None = None) -> None:
    """One complete event from ``start`` to ``end`` (``time.time()`` seconds) in row ``lane``
    of this rank (events of one lane must nest; Horovod's timeline gives each tensor name one)."""
    if _PATH is None:
        return
    with _lock:
        tid = _tids.setdefault(lane, len(_tids))
        event = {"ph": "X", "cat": cat, "name": name, "pid": _rank(), "tid": tid,
                 "ts": round(start * 1e6, 1), "dur": round(max(end - start, 0.0) * 1e6, 1)}
        if args:
            event["args"] = args
        _events.append(event)


def instant(cat: str, name: str, when: float, lane: str = "") -> None:
    """One instant event (``"ph": "i"``) at ``when`` (``time.time()`` seconds) in row ``lane``."""
    if _PATH is None:
        return
    with _lock:
        tid = _tids.setdefault(lane, len(_tids))
        _events.append({"ph": "i", "s": "t", "cat": cat, "name": name, "pid": _rank(), "tid": tid,
                        "ts": round(when * 1e6, 1)})


def snapshot() -> list[dict]:
    """This process's events so far, after the metadata naming its rank and rows."""
    with _lock:
        events = list(_events)
        lanes = dict(_tids)
    rank = _rank()
    meta = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}]
    meta += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane or "main"}}
             for lane, tid in lanes.items()]
    return meta + events


def flush() -> None:
    """Write this process's events to ``<path>.rank<r>`` (also at exit)."""
    if _PATH is None:
        return
    _write(snapshot())


def _write(events: list[dict]) -> None:
    part = f"{_PATH}.rank{_rank()}"
    with open(part + ".tmp", "w") as f:
        json.dump(events, f)
    os.replace(part + ".tmp", part)


atexit.register(flush)


def merge(path: str) -> int:
    """Join the ranks' parts ``<path>.rank*`` into ``path`` (one JSON array) and remove them;
    returns the number of events."""
    events: list = []
    parts = sorted(glob.glob(glob.escape(path) + ".rank*"))
    for part in parts:
        if part.endswith(".tmp"):
            continue
        with open(part) as f:
            events.extend(json.load(f))
    with open(path, "w") as f:
        json.dump(events, f)
    for part in parts:
        os.unlink(part)
    return len(events)


if __name__ == "__main__":
    if sys.argv[1:2] != ["merge"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m terrapipe.timeline merge PATH")
    print(f"{merge(sys.argv[2])} events in {sys.argv[2]}")
