"""``horovod.runner.util.threads.in_thread``: what Horovod's test helpers import from it."""

from __future__ import annotations

import threading


def in_thread(target, args: tuple = (), name: str | None = None, daemon: bool = True,
              silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return the thread. ``silent``: an exception
    the target raises is swallowed instead of reported. ``args`` must be a tuple (ValueError
    otherwise, as Horovod's)."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")

    def quiet(*a):
        try:
            target(*a)
        except Exception:  # noqa: BLE001 - what silent asks for
            pass

    thread = threading.Thread(target=quiet if silent else target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
