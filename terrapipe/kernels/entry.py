"""A compiled kernel's entry point for given arguments' types: what a caller that calls the same
kernel with the same types many times calls directly, skipping Numba's type dispatch per call
(a few microseconds, which the smallest collectives pay on every rank).

NOTE [one compiler per kernel]
    1. The ranks of a node call the same kernels with the same types, so on a first run (an
       empty Numba cache) each would compile each one at once, all of them missing the cache
       together. Where the ranks outnumber the cores (four ranks on two cores in CI, a laptop)
       that multiplies the first call's wait: the four-node collective tests took 103 s from
       an empty cache at four ranks on a 2-core Xeon, 66 s with one compiler at a time.
    2. So every compile of a terrapipe kernel for a signature (whether asked for by
       :func:`entry_point`, by a first call from Python, or by the typing of a compiled caller)
       runs in one process of the machine at a time: the first takes an exclusive ``flock`` on
       a file beside Numba's cache of that kernel and compiles, which saves it to the cache;
       the others wait for a shared lock on the same file (granted once the compiler is done)
       and then load it from the cache. :func:`install` wraps Numba's ``Dispatcher.compile``
       for the functions of the packages it is given, from the top of ``terrapipe.kernels``;
       where Numba's classes are not as expected it wraps nothing and returns False, and
       ``tests/kernels/test_entry.py`` fails, saying so.
    3. Waiters compile after the wait, not under the lock: where the cache could not be saved
       they compile side by side, as without the lock, never one after the other. Where the
       kernel has no file cache, or the lock file cannot be made, nothing waits.
    4. A process takes these locks only while it holds Numba's own compiler lock, so one
       thread of a process at a time holds any, and a compile that waits for another process
       waits only for a kernel its own kernel calls (the typing of a caller compiles its
       callees). A wait for a wait therefore follows the call graph, which has no cycle, so no
       two processes can wait for each other; a process that dies holding a lock releases it.
       A waiter gives up waiting after ``_WAIT_SECONDS`` (a compiler stopped, not dead) and
       compiles. A compile the same thread re-enters for the same kernel and types takes no
       second lock.
    5. Until 2026-12-07 only :func:`entry_point` took the lock, and most of comm calls its
       kernels straight from Python: from an empty cache, ``make test``'s processes spent 127 s
       (of 333 s compiling in all) on kernels that another process compiled too, both ranks of
       the 2-rank job compiling the same ones side by side (a 2-core Zen 3).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import time

import numba

__all__ = ["entry_point", "install"]

_WAIT_SECONDS = 600.0  # the longest a process waits for another's compile (clause 4)


def entry_point(kernel, args: tuple):
    """The compiled entry point of ``kernel`` (a ``numba.njit`` dispatcher) for the types of
    ``args``, compiled (or loaded from Numba's cache) now, without running it. Called with
    arguments of exactly those types; ``args`` are only looked at, never kept.

    Compiling ahead is also what NOTE [symmetric completion] in comm/algorithms/oneshot.py asks
    of a collective: no rank does first-call work after a meeting point its peers skip. One
    process of a machine compiles a kernel at a time, the others load it (NOTE [one compiler
    per kernel])."""
    key = tuple(numba.typeof(a) for a in args)
    if key not in kernel.overloads:
        kernel.compile(key)
    return kernel.overloads[key].entry_point


_PACKAGES: set[str] = set()
_held: set[tuple[int, tuple]] = set()  # (kernel, types) this process compiles now (clause 4)


def install(packages: tuple[str, ...] = ("terrapipe",)) -> bool:
    """Make every compile of a function of ``packages`` from now on run in one process of the
    machine at a time (NOTE [one compiler per kernel] 2). Idempotent; False where Numba's
    internals are not as expected."""
    from numba.core import sigutils
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.dispatcher import Dispatcher

    original = getattr(Dispatcher, "compile", None)
    if original is None or not hasattr(sigutils, "normalize_signature"):
        return False
    _PACKAGES.update(packages)
    if getattr(original, "_terrapipe_one_compiler", False):
        return True

    @functools.wraps(original)
    def compile(self, sig):
        module = getattr(getattr(self, "py_func", None), "__module__", None) or ""
        if module.split(".")[0] not in _PACKAGES:
            return original(self, sig)
        key = tuple(sigutils.normalize_signature(sig)[0])
        if key in self.overloads:
            return original(self, sig)
        with global_compiler_lock:  # clause 4: one thread of this process holds our locks
            held = (id(self), key)
            if held in _held:
                return original(self, sig)
            with _one_compiler(self, key):
                _held.add(held)
                try:
                    return original(self, sig)
                finally:
                    _held.discard(held)

    compile._terrapipe_one_compiler = True
    Dispatcher.compile = compile
    return True


@contextlib.contextmanager
def _one_compiler(kernel, key: tuple):
    """NOTE [one compiler per kernel] 2-3: compile under an exclusive lock, or wait for the
    process holding it and then compile (load) without it."""
    path, fd = _lock_path(kernel, key), -1
    if path is not None:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    if fd < 0:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process compiles it: wait for it, then load its result
            _wait_for_shared(fd, time.monotonic() + _WAIT_SECONDS)
        yield
    finally:
        os.close(fd)


def _lock_path(kernel, key: tuple) -> str | None:
    """The lock file of ``kernel`` compiled for ``key``, beside its Numba cache; None where the
    kernel has no file cache."""
    cache = getattr(kernel, "_cache", None)
    where = getattr(cache, "cache_path", None) if type(cache).__name__ == "FunctionCache" else None
    if not where:
        return None
    func = kernel.py_func
    name = hashlib.sha1(f"{func.__module__}.{func.__qualname__}{key}".encode()).hexdigest()[:20]
    return os.path.join(where, f"terrapipe-compiling-{name}.lock")


def _wait_for_shared(fd: int, deadline: float) -> None:
    """Take and drop a shared lock on ``fd`` (granted once no process holds it exclusively),
    or return at ``deadline`` without it."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
            continue
        fcntl.flock(fd, fcntl.LOCK_UN)
        return
