"""A compiled kernel's entry point for given arguments' types: what a caller that calls the same
kernel with the same types many times calls directly, skipping Numba's type dispatch per call
(a few microseconds, which the smallest collectives pay on every rank)."""

from __future__ import annotations

import numba

__all__ = ["entry_point"]


def entry_point(kernel, args: tuple):
    """The compiled entry point of ``kernel`` (a ``numba.njit`` dispatcher) for the types of
    ``args``, compiled (or loaded from Numba's cache) now, without running it. Called with
    arguments of exactly those types; ``args`` are only looked at, never kept.

    Compiling ahead is also what NOTE [symmetric completion] in comm/algorithms/oneshot.py asks
    of a collective: no rank does first-call work after a meeting point its peers skip."""
    key = tuple(numba.typeof(a) for a in args)
    kernel.compile(key)
    return kernel.overloads[key].entry_point
