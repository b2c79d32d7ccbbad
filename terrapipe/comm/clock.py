"""One clock for the timeline across nodes: each rank's offset to rank 0, measured at comm.init.

Ranks of one machine share CLOCK_MONOTONIC and need nothing. Between machines rank 0 answers a
few ping-pongs from each rank in turn, and each rank keeps the round trip with the least delay
(timeline.estimate_offset, NOTE [timeline recording] 4 in terrapipe/timeline.py). The exchange
runs on a duplicate of the world's communicator (or over Gloo for a torch-launched world), so it
never meets a collective's messages.
"""

from __future__ import annotations

import time

import numpy as np

from .. import timeline

__all__ = ["align", "ROUNDS"]

ROUNDS = 8  # round trips per rank; the least delayed one wins


def align(group) -> tuple[int, int]:
    """Measure this rank's clock offset to rank 0 of ``group`` (collective) and set it on the
    timeline; returns ``(offset_ns, bound_ns)``: (0, 0) on rank 0, and on one node, where every
    process reads the same clock."""
    if group.size == 1 or group.nnodes == 1:
        return 0, 0
    if group.comm is not None:
        send, recv, done = _over_mpi(group.comm)
    elif group.gloo is not None:
        send, recv, done = _over_gloo(group.gloo)
    else:
        return 0, 0
    buf = np.zeros(1, np.int64)
    try:
        if group.rank == 0:
            for peer in range(1, group.size):
                for _ in range(ROUNDS):
                    recv(buf, peer)
                    buf[0] = timeline.now()
                    send(buf, peer)
            offset, bound = 0, 0
        else:
            def exchange(t: int) -> int:
                buf[0] = t
                send(buf, 0)
                recv(buf, 0)
                return int(buf[0])

            offset, bound = timeline.estimate_offset(exchange, ROUNDS, time.monotonic_ns)
    finally:
        done()
    timeline.set_clock_offset(offset)
    return offset, bound


def _over_mpi(world):
    comm = world.Dup()

    def send(buf, peer):
        comm.Send(buf, dest=peer, tag=7)

    def recv(buf, peer):
        comm.Recv(buf, source=peer, tag=7)

    return send, recv, comm.Free


def _over_gloo(gloo):
    def send(buf, peer):
        gloo.send(buf, peer, 7)

    def recv(buf, peer):
        gloo.recv(buf, peer, 7)

    return send, recv, lambda: None
