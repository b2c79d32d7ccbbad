"""The ways a script calls an allreduce, for tests that run one call each way (or each rank its
own way into the same call: the signature must not depend on it)."""

from __future__ import annotations

import numpy as np

from terrapipe import comm

WAYS = 3


def allreduce_by_way(x: np.ndarray, op: str, how: int) -> np.ndarray:
    """``comm.allreduce`` of ``x`` way ``how`` % 3: in place, into a new ``out`` (``x`` left as
    it was), or async in place and waited for. Returns the array holding the result."""
    how %= WAYS
    if how == 0:
        comm.allreduce(x, op)
        return x
    if how == 1:
        out = np.empty_like(x)
        comm.allreduce(x, op, out=out)
        return out
    comm.allreduce(x, op, async_op=True).wait()
    return x
