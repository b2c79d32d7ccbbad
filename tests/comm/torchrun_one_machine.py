"""The body of tests/comm/test_torchrun_one_machine.py, run by ``torchrun --standalone``: the
world comm.init makes there is the machine's segment (NOTE [machines over Gloo] 9 in
comm/group.py), every collective exact, as selected and pinned to Gloo, over the world, a split
and a duplicate; a mismatch raises on every rank; point to point still goes over Gloo."""

import sys

import numpy as np
import torch

import terrapipe.comm as comm
from tests.comm import stress


def main() -> None:
    world = comm.init(timeout=60)
    r, p = world.rank, world.size
    assert world.shm is not None and world.nnodes == 1, "one machine: the segment"
    assert (world.local_rank, world.local_size) == (r, p)
    log = world.record_algorithms()
    for name, g in stress.groups_under_test(world).items():
        ran = stress.run(g, seed=11, n_ops=60)
        assert ran == 60, name
        if g.size > 1:
            assert g.shm is not None, name
    for pin in ("gloo", None):  # Gloo's own stays reachable by pinning, and agrees
        world.use_algorithm("allreduce", pin)
        x = np.full(1000, r + 1.0, np.float32)
        comm.allreduce(x)
        assert np.all(x == p * (p + 1) / 2), pin
    ran = {a for _, a, _ in log}
    assert {"oneshot", "segment"} <= ran and "gloo" in ran, ran
    assert not any(a == "gloo" for c, a, _ in log if c != "allreduce"), "a collective went over Gloo"
    try:
        comm.allgather(np.zeros(3 if r == 0 else 4, np.float32))
    except comm.CollectiveMismatchError as e:
        assert "ranks called it differently" in str(e)
    else:
        raise AssertionError("a mismatch went unnoticed")
    t = torch.full((5,), float(r))
    if r == 0:
        comm.send(t, 1)
    elif r == 1:
        comm.recv(t, 0)
        assert torch.equal(t, torch.zeros(5))
    comm.barrier()
    print(f"rank {r} of {p}: ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
