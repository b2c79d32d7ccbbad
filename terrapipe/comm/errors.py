"""Errors raised by terrapipe.comm, on every rank involved, naming the ranks at fault."""

from __future__ import annotations

__all__ = ["CommError", "SetupAbandoned", "CollectiveMismatchError", "CollectiveTimeoutError"]


class CommError(RuntimeError):
    """Base class: a collective could not complete."""


class CollectiveMismatchError(CommError):
    """Ranks called a collective with different signatures (op, dtype, shape, count, root)."""


class CollectiveTimeoutError(CommError):
    """Some ranks did not reach a collective within the timeout (or died); ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class SetupAbandoned(CommError):
    """A group's set-up gave up waiting because the group will never be complete (an elastic
    generation superseded by a newer one: comm/rendezvous.py)."""
