"""hvd.elastic (horovod.torch.elastic, 0.28): training that survives workers leaving and joining.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                step()
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

Under ``terrapipe run --horovod -np N --min-np A [--max-np B] (--hosts H | --host-discovery-script S)``
(terrapipe/engine/elastic.py) each worker's world is a generation of the job (NOTE [elastic
generations] in terrapipe/comm/rendezvous.py). When a collective fails (a worker died),
:func:`run` catches the HorovodInternalError, restores the last commit, leaves the world
(``hvd.shutdown()``), joins the next generation (``hvd.init()``), syncs the state from the new
rank 0 and calls the function again. When workers are added or removed, every rank raises
HostsUpdatedInterrupt at the same commit and does the same without the restore. Outside such a
launcher (mpiexec, a lone process) the world never changes and the state objects only commit,
restore and sync.
"""

from __future__ import annotations

import functools

from .. import basics
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]


def run(func):
    """Decorate the training function ``func(state, *args, **kwargs)``: the state is synced from
    rank 0 before each call; a failed collective (HorovodInternalError) restores the last commit,
    HostsUpdatedInterrupt keeps the state as it is; either way the world is left and joined again
    (``hvd.shutdown(); hvd.init()``), the state's reset callbacks run, and ``func`` is called
    again, until it returns. ``func`` itself must not be a collective: a new worker would run it
    while the others sync."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            _reset()
            state.on_reset()

    return wrapper


def _reset() -> None:
    basics.shutdown()
    basics.init()
