"""The one way a rank waits for other ranks: poll, yield the core, then sleep; name who is late.

Every wait on a peer goes through :func:`wait_until`: the shared-memory board's step counters
(comm/transports/board.py), MPI requests (comm/transports/mpi.py, the parameter server's wire) and
a shard's chunk locks (terrapipe.ps). What differs between them is only what is polled, how a
rank sleeps when it has waited long, and how the late ranks are found and named.

NOTE [waiting for a peer]
    1. Poll ``done()`` (callers make it cheap; the board's spins a compiled loop inside).
    2. Between polls yield the core: ranks may outnumber cores, and the rank being waited for
       may need this one's core to get there.
    3. After ``sleep_after`` seconds of yielding, sleep instead: ``nap()`` when the caller can
       sleep on what it waits for (a futex on the board's counter, NOTE [sleeping on a counter]
       in kernels/sync.py; it returns True once done), else short sleeps growing to 1 ms. A rank
       that waits milliseconds for its peer then no longer takes the core its own work needs.
       ``sleep_after=None`` never sleeps (a wait for MPI requests, whose completion needs this
       rank's own progress calls).
    4. ``progress()`` between rounds keeps MPI's progress engine turning while a rank waits
       elsewhere (NOTE [MPI progress] in comm/algorithms/ring.py).
    5. Every ``check_every`` rounds, and every round once sleeping, ``failure(timed_out)`` is
       asked for the error to raise: a peer that died (at once, whatever the timeout), or after
       ``timeout`` seconds the ranks that never arrived; None to go on waiting. Naming who is late
       is the caller's: it alone knows whom it waits for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["wait_until"]

_MAX_PAUSE = 1e-3  # the longest sleep between polls without a nap (seconds)


def wait_until(done: Callable[[], bool], timeout: float, failure: Callable[[bool], Exception | None], *,
               nap: Callable[[], bool] | None = None, progress: Callable[[], None] | None = None,
               sleep_after: float | None = 50e-6, check_every: int = 256) -> None:
    """Return once ``done()`` is true, or raise what ``failure(timed_out)`` returns (NOTE
    [waiting for a peer]). ``timeout``: seconds from this call; ``nap()``: a bounded sleep on
    what is awaited, True once done; ``progress()``: called between rounds; ``sleep_after``:
    seconds of yielding before sleeping (None: never sleep); ``check_every``: rounds between
    calls of ``failure`` while not sleeping."""
    start = time.monotonic()
    rounds = 0
    pause = 0.0
    while not done():
        slept = sleep_after is not None and time.monotonic() - start > sleep_after
        if not slept:
            os.sched_yield()
        elif nap is not None:
            if nap():
                return
        else:
            time.sleep(pause)
            pause = min(pause * 2 + 2e-5, _MAX_PAUSE)
        if progress is not None:
            progress()
        rounds += 1
        if rounds % check_every and not slept:
            continue
        error = failure(time.monotonic() - start > timeout)
        if error is not None:
            raise error
