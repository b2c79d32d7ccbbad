"""A node communicator over a key-value store, for groups that have no MPI (torchrun, or a
``torch.distributed`` backend's rendezvous).

Shared memory needs only two things from the ranks of a node at set-up: the segment's name
broadcast from local rank 0, and a barrier before the name is unlinked (NOTE [shm segment
lifetime] in comm/transports/shm.py). :class:`StoreComm` gives exactly those, plus an all-gather
of small strings, over any store with torch c10d's ``set`` / ``get`` / ``wait`` (values are bytes; the
store is the one every rank of the job already reached). Values are plain text, never pickles.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

from .errors import CollectiveTimeoutError, CommError, SetupAbandoned

__all__ = ["StoreComm", "node_of", "hosted_tcp_store"]


class StoreComm:
    """The subset of an mpi4py communicator that :class:`~terrapipe.comm.transports.shm.Segment` and
    :class:`~terrapipe.comm.transports.shm.ShmTransport` use: ``rank``, ``Get_rank``, ``Get_size``,
    ``bcast`` (str or None), ``Barrier`` and ``allgather`` (JSON values).

    store: a c10d Store (or anything with set/get/wait); prefix: this communicator's key space,
    unique per communicator; rank/size: within it; timeout: seconds a rank waits for the others.
    abandon: None, or a function called while waiting that returns why to stop waiting (an
    elastic generation superseded: comm/rendezvous.py) or None; its reason is raised as SetupAbandoned.
    """

    _SLICE = 0.2  # seconds between calls of ``abandon``

    def __init__(self, store, prefix: str, rank: int, size: int, timeout: float, abandon=None) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.size = int(rank), int(size)
        self.timeout = datetime.timedelta(seconds=float(timeout))
        self.abandon = abandon
        self._seq = 0

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def _key(self, what: str) -> str:
        self._seq += 1
        return f"{self.prefix}/{self._seq}/{what}"

    def _wait(self, keys: list[str], ranks: list[int], what: str) -> None:
        """Until every key is set; CollectiveTimeoutError naming the ranks whose key is missing
        after the timeout (the store's own error says only that a wait timed out)."""
        try:
            self._wait_abandoning(keys, what)
        except CommError:
            raise
        except Exception as e:  # c10d raises DistStoreError (a RuntimeError) on a timeout
            missing = [r for k, r in zip(keys, ranks, strict=True) if not self.store.check([k])]
            if not missing:
                raise
            names = ", ".join(f"rank {r}" for r in missing)
            raise CollectiveTimeoutError(
                f"{what} over the store ({self.prefix!r}): Timed out after "
                f"{self.timeout.total_seconds():g}s waiting for {names}", missing) from e

    def _wait_abandoning(self, keys: list[str], what: str) -> None:
        if self.abandon is None:
            self.store.wait(keys, self.timeout)
            return
        end = time.monotonic() + self.timeout.total_seconds()
        while True:
            left = end - time.monotonic()
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(0.001, min(self._SLICE, left))))
                return
            except Exception:
                why = self.abandon()
                if why:
                    raise SetupAbandoned(f"{what} over the store ({self.prefix!r}) abandoned: "
                                     f"{why}") from None
                if left <= 0:
                    raise

    def allgather(self, value) -> list:
        """Every rank's ``value`` (JSON-serialisable), in rank order."""
        key = self._key("allgather")
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        keys = [f"{key}/{r}" for r in range(self.size)]
        self._wait(keys, list(range(self.size)), "set-up (allgather)")
        return [json.loads(self.store.get(k)) for k in keys]

    def bcast(self, value, root: int = 0):
        key = self._key("bcast")
        if self.rank == root:
            self.store.set(key, json.dumps(value))
        self._wait([key], [root], "set-up (bcast)")
        return json.loads(self.store.get(key))

    def Barrier(self) -> None:  # noqa: N802
        self.allgather(None)


def node_of() -> str:
    """What identifies this machine to the ranks of a job: its host name and boot id (two
    containers on one host with separate /dev/shm have different boot ids only when their
    kernels differ; ranks that share /dev/shm share both)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def hosted_tcp_store(rank: int, size: int, share, timeout: float):
    """A torch c10d ``TCPStore`` for ``size`` ranks, hosted by rank 0 on a port the kernel gives
    it and reached by the others; returns the store (pass it to ``init_process_group(store=)``).

    ``share(value)``: rank 0's value on every rank (a broadcast over a group that already
    exists, MPI's for instance); called once on every rank. The address is ``MASTER_ADDR`` or
    rank 0's hostname. Rank 0 binds the port itself: a port picked free, closed, and then handed
    to the store can be taken in between (EADDRINUSE).
    """
    import os

    from torch.distributed import TCPStore

    td = datetime.timedelta(seconds=float(timeout))
    store = where = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = TCPStore(host, 0, size, is_master=True, wait_for_workers=False, timeout=td)
        where = (host, store.port)
    host, port = share(where)
    if rank != 0:
        store = TCPStore(host, port, size, is_master=False, timeout=td)
    return store
