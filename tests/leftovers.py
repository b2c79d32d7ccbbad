"""What a test's job may leave behind, told apart from what other programs on the machine have
(``make test``'s other lane, a user's own job): terrapipe's shared-memory files by the pid their
name carries, processes by a mark in their environment.

A file new since a test began is that test's leftover only if its creator is gone (a live
creator's file is a group still setting up: its segments are unlinked once every rank mapped
them) or is one of the test's own processes."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from terrapipe.comm import alive
from terrapipe.comm.transports.shm import PREFIX


def segments() -> set[str]:
    """The names of every terrapipe shared-memory file now (collectives' and loaders')."""
    return {p.name for p in Path("/dev/shm").glob(f"{PREFIX}*")}


def creator(name: str) -> int | None:
    """The pid in a terrapipe shared-memory name (``terrapipe_[<kind>_]<uid>_<pid>_...``)."""
    tokens = name[len(PREFIX):].split("_")
    while tokens and not tokens[0].isdigit():
        tokens.pop(0)
    return int(tokens[1]) if len(tokens) > 1 and tokens[1].isdigit() else None


def left_behind(before: set[str]) -> set[str]:
    """Files new since ``before`` whose creating process is gone: a finished or killed job's
    leftovers."""
    return {n for n in segments() - before if (pid := creator(n)) is None or not alive(pid)}


def made_by(pids: Iterable[int], before: set[str]) -> set[str]:
    """Files new since ``before`` that one of ``pids`` made and that are still there."""
    pids = set(pids)
    return {n for n in segments() - before if creator(n) in pids}


def marked(mark: str) -> list[int]:
    """Processes still running with ``mark`` in their environment."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            pass
    return found
