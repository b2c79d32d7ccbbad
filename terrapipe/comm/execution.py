"""The order a group's collectives run in: sync calls inline, async ones on one worker thread,
every rank in the same order; and the :class:`Handle` an async call returns.

NOTE [collective ordering]
    1. Every rank of a group issues its collectives in the same order, sync and async alike.
    2. Async calls run on the group's single worker thread in submission order; a sync call runs
       inline when nothing async is queued or running, else it queues behind them.
    3. Issuing never waits for a running collective: the queue's state has its own lock
       (``_state``), distinct from the one a running body holds (``_exec``).
    4. Every collective starts with a signature agreement: all ranks exchange (collective, op,
       dtype, shape, root, algorithm) over the group's control transport and compare before any
       data moves, so a mismatch raises CollectiveMismatchError on every rank (comm/group.py).
       Small allreduces on one node publish signature and data together (the one-shot,
       comm/algorithms/oneshot.py). Across nodes each node's table of signatures travels in
       the exchange between nodes, so every rank checks every rank's signature and all raise
       alike: a node's ranks raising before that exchange would leave the other nodes' ranks
       one agreement behind, each later collective compared with the wrong one
       (ShmTransport.agree).
    5. A collective that timed out leaves the ranks' step counters out of step: the group takes
       no further calls (CommError naming the first failure).
    6. Nor can the process leave through MPI_Finalize, which waits for every rank of the job,
       the unreachable and the stuck too: the first failure of any group is kept for the process
       (:func:`first_failure`), and comm's exit hook ends the job with MPI_Abort instead
       (comm/collectives.py). ``comm.finalize()`` called by the program forgets it.
    7. MPI_Abort has the launcher kill every rank it can reach, among them this node's ranks
       that are still reporting their own error (a node peer raises from the same failure a few
       milliseconds later). So the exit hook first marks this rank exiting on its node's board
       and waits, at most ``_EXIT_SETTLE`` seconds (comm/collectives.py), until every other
       rank of the node has reached its exit too or died; only then it aborts.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .. import timeline
from .errors import CollectiveTimeoutError, CommError

__all__ = ["Executor", "Handle", "first_failure", "forget_failures"]

_process_failure: list[str] = []  # the first failure of any group in this process (clause 6)


def first_failure() -> str | None:
    """The first collective failure of any group in this process since the last
    :func:`forget_failures`, or None (NOTE [collective ordering] 6)."""
    return _process_failure[0] if _process_failure else None


def forget_failures() -> None:
    _process_failure.clear()


def _failed(executor: Executor, error: Exception) -> None:
    executor.failed = str(error)  # NOTE [collective ordering] 5
    if not _process_failure:
        _process_failure.append(executor.failed)  # clause 6


class Handle:
    """An outstanding async collective. ``wait()`` returns its result (or raises its error)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None):
        """The collective's result, once it completed (its error raised here); ``timeout``:
        seconds to wait at most (concurrent.futures.TimeoutError after)."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    @property
    def future(self) -> Future:
        """The concurrent.futures.Future the handle waits on (for callbacks: a torch
        ``Work``'s future completes from it, terrapipe.distributed)."""
        return self._future


class Executor:
    """Runs one group's collective bodies in issue order (NOTE [collective ordering])."""

    def __init__(self) -> None:
        self._state = threading.Lock()  # pending and the pool (NOTE [collective ordering] 3)
        self._exec = threading.RLock()  # held while a collective body runs
        self._pool: ThreadPoolExecutor | None = None
        self.pending = 0  # async collectives issued and not yet completed (read-only outside)
        self.failed: str | None = None  # the first failure (NOTE [collective ordering] 5)

    def run(self, fn, async_op: bool, label: tuple[str, int] | None = None):
        """Run ``fn()`` in issue order: inline (its result) or on the worker thread (a Handle).
        ``label``: (name, bytes) for the timeline, which records the body as a span and an async
        call from issue to completion."""
        if self.failed:
            raise CommError(f"this group is unusable after an earlier failure: {self.failed}")
        if label is not None and timeline.enabled():
            fn = _traced(fn, label)
        if async_op:
            with self._state:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="terrapipe-comm")
                self.pending += 1
                fut = self._pool.submit(self._guarded, fn)
            fut.add_done_callback(self._one_done)
            if label is not None and timeline.enabled():
                _trace_handle(fut, label)
            return Handle(fut)
        with self._state:
            inline = self.pending == 0
            if inline:
                # Free: nothing is queued, and a body releases _exec before its future completes.
                self._exec.acquire()
        if inline:
            try:
                return self._guarded(fn)
            finally:
                self._exec.release()
        return self.run(fn, True).wait()

    def run_if_idle(self, fn, *args) -> bool:
        """Run ``fn(*args)`` inline when no async collective is pending and return True; else run
        nothing and return False (the caller queues it the ordinary way). The latency path's
        entry: no wrapper, and not the queue's lock (``pending`` is read twice instead: before
        waiting for a body another thread runs inline, and again once this call holds
        ``_exec``, where an async body that ran meanwhile may not have completed yet)."""
        if self.pending:
            return False
        running = self._exec
        running.acquire()
        try:
            if self.pending:
                return False
            if self.failed:
                raise CommError(f"this group is unusable after an earlier failure: {self.failed}")
            fn(*args)
        except CollectiveTimeoutError as e:
            _failed(self, e)
            raise
        finally:
            running.release()
        return True

    def close(self) -> None:
        """Wait for the queued collectives and stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _one_done(self, _fut) -> None:
        with self._state:
            self.pending -= 1

    def _guarded(self, fn):
        with self._exec:
            try:
                return fn()
            except CollectiveTimeoutError as e:
                _failed(self, e)
                raise


_handle_ids = itertools.count(1)


def _traced(fn, label: tuple[str, int]):
    name, nbytes = label

    def body():
        with timeline.span("comm", name, args={"bytes": nbytes}):
            return fn()

    return body


def _trace_handle(fut: Future, label: tuple[str, int]) -> None:
    """An async collective on the timeline from issue to completion (NOTE [timeline recording] 5)."""
    name, nbytes = label
    ident = next(_handle_ids)
    timeline.async_begin("comm", name, ident, {"bytes": nbytes})
    fut.add_done_callback(lambda _f: timeline.async_end("comm", name, ident))
