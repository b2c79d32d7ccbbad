"""hvd.elastic's state objects (horovod.common.elastic and horovod.torch.elastic.state): what a
training loop keeps in memory so that a failure costs only the steps since the last commit.

A state is *committed* (copied aside in host memory), *restored* (the copy put back, after a
failed collective left the step half done) and *synced* (rank 0's copy sent to every rank, after
the world changed and new workers know nothing). Only rank 0's state matters after a sync.
"""

from __future__ import annotations

import abc
import copy

import torch

from ... import comm
from ...engine import kept_copy
from .. import basics
from ..errors import HostsUpdatedInterrupt
from ..mpi_ops import broadcast_object
from ..optimizer import broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = ["State", "ObjectState", "TorchState", "StateHandler", "get_handler_registry",
           "set_handler_registry"]

REMOVED, ADDED = 1, 2  # Horovod's HostUpdateResult flags (NOTE [elastic generations] 2 in comm)


class _Committed(abc.ABC):
    """What a state (and each handler of one) does: ``save`` (commit), ``restore`` (back to the
    last commit), ``sync`` (rank 0's everywhere)."""

    @abc.abstractmethod
    def save(self) -> None: ...

    @abc.abstractmethod
    def restore(self) -> None: ...

    @abc.abstractmethod
    def sync(self) -> None: ...


class State(_Committed):
    """Base of the state objects: commit / restore / sync, reset callbacks, and the check for
    workers added or removed.

    bcast_object: a function sending rank 0's object to every rank (default: hvd.broadcast_object);
    get_rank: this worker's rank (default: hvd.rank).
    """

    def __init__(self, bcast_object=None, get_rank=None) -> None:
        self._bcast_object = bcast_object or (lambda obj: broadcast_object(obj, 0))
        self._rank = get_rank or basics.rank
        self._seen = 0  # the newest generation whose update this state has acted on
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (no arguments) after every reset, when the world changed: e.g. to
        scale the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state (a copy in host memory: its cost is why one commits every
        few steps, not every step), then :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank at once when the launcher formed a newer
        generation of workers. Rank 0's view decides (broadcast), so all ranks raise at the same
        commit or none does. Collective."""
        latest, flags = comm.pending_update() if self._rank() == 0 else (0, 0)
        before = self._seen
        latest, flags = self._bcast_object((max(latest, before), flags))
        self._seen = latest
        if latest > before and flags:
            raise HostsUpdatedInterrupt(skip_sync=flags == REMOVED)

    def reset(self) -> None:
        """Called after the world changed, before the callbacks and the sync."""


class ObjectState(State):
    """State of plain Python values, given as keyword arguments and kept as attributes
    (``state.epoch``, ``state.batch``); synced by broadcasting rank 0's values (picklable
    objects, sent between the job's own processes). As in Horovod, a commit keeps the
    attributes' objects, not copies: rebind an attribute (``state.x = x + 1``,
    ``state.seen = seen + [i]``) rather than mutate its object in place, or a restore cannot
    undo the change."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class StateHandler(_Committed):
    """How one kind of object is committed, restored, synced and reset after the world changed
    (the value lives in ``value``)."""

    def __init__(self, value) -> None:
        self.value = value

    def reset(self) -> None:
        """The world changed (before the sync, which a removal alone skips)."""

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """An object with ``state_dict`` / ``load_state_dict``: the state dict kept on commit
    (:func:`terrapipe.engine.kept_copy`), and a copy of it loaded on restore (a module copies
    what it loads, but an optimizer keeps the tensors it is given: the steps after a restore
    would write into the commit itself)."""

    def __init__(self, value) -> None:
        super().__init__(value)
        self._saved = None
        self.save()

    def save(self) -> None:
        self._saved = kept_copy(self._saved, self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))


class ModelStateHandler(_StateDictHandler):
    """A module: rank 0's parameters and buffers broadcast."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """An optimizer: rank 0's state broadcast."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """An ElasticSampler: rank 0's position loaded everywhere, which re-deals the epoch's
    unprocessed indices over the new world."""

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))

    def reset(self) -> None:
        # A reset without a sync (workers only removed) still changes the world: deal the rest
        # of the epoch over it (Horovod leaves the sampler dealing for the old world there).
        self.value.reset()


_handler_registry: list[tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type]]:
    """The (type, StateHandler subclass) pairs TorchState picks a handler from, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = list(registry)


def _handler_for(value) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process: ``model`` and ``optimizer`` (either may be None) and
    any keyword attributes. A value with a handler (a module, an optimizer, an ElasticSampler)
    is committed and synced by it; anything else as in ObjectState. Assigning an attribute that
    has a handler (``state.model = other``) hands the new object to the handler and commits it.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        # What was synced is also what a restore returns to, as for the plain attributes: a
        # worker that joined and fails before its first commit may be the next rank 0, and must
        # not hand its own initial model to everyone (Horovod restores the pre-sync one there).
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def __setattr__(self, name: str, value) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)
