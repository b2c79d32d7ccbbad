"""``ShardedTensor``: a tensor sharded over the ranks of a group, pushed to and pulled from
asynchronously by every rank while each rank trains.

NOTE [shard chunks]
    1. Shard ``r`` (``Layout.shard(r)``) belongs to group rank ``r``. Each shard is cut into
       chunks (``chunk_bytes``, 1 MiB by default); a chunk is the unit of atomicity: a push
       applies to a chunk under its lock, a pull copies a chunk under its lock, so concurrent
       adds are never lost and a pull never sees half of a push within a chunk. Across chunks
       there is no such promise (as in TorchMPI and Downpour: each shard is its own server).
    2. A rank's pushes and pulls run on one client thread per tensor, in issue order: a pull
       issued after a push of the same rank sees it (with or without waiting in between), and
       ``Handle.wait()`` of a push means every shard has applied it, so any rank's pull issued
       afterwards sees it too.
    3. On the owner's node the client applies to the shard in shared memory itself (NOTE [node
       shards] in node_shards.py); a request for a shard on another node goes through this
       process's wire thread to the owner's (NOTE [one thread on the wire] in wire_thread.py,
       NOTE [shard wire protocol] in wire.py). The client hands over the remote requests
       first, applies the local chunks while they travel, then waits for the replies.
    4. Sources and destinations are the caller's until the handle completes: a push reads ``x``
       and a pull writes ``out`` on the client thread (a CUDA tensor is staged through host
       memory: a push copies it at issue, a pull copies into it on the client thread).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..comm import CollectiveTimeoutError, CommError, Handle, connect_ranks
from ..comm import world as _world
from ..kernels import shard as kshard
from .connections import Endpoint, Request
from .layout import Layout
from .node_shards import NodeShards
from .wire import Peer
from .wire_thread import wire_thread

__all__ = ["ShardedTensor"]

_DTYPES = ("float32", "float64", "int32", "int64")
_names = itertools.count()


def _host(x, what: str, arg: str):
    """(flat host ndarray view or copy, is_torch, device) of a tensor or array."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).reshape(-1), False, None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach()
        device = t.device if t.device.type != "cpu" else None
        if device is not None:
            t = t.to("cpu")
        return t.contiguous().reshape(-1).numpy(), True, device
    raise TypeError(f"{what}: {arg} must be a numpy array or a torch tensor, got {type(x).__name__}")


class ShardedTensor:
    """A tensor of ``init``'s shape and dtype, sharded over ``group``'s ranks (NOTE [shard
    chunks]). Collective: every rank passes a tensor of the same shape and dtype; rank ``r``'s
    shard starts as rank ``r``'s values of ``init`` (as TorchMPI's parameter server: pass the
    same values everywhere, e.g. after broadcasting parameters, for one consistent start).

    ``init``: numpy array or torch tensor (CPU or CUDA), float32/float64/int32/int64, any shape.
    ``group``: a ``terrapipe.comm`` group launched under MPI, or a lone process (default: the
    world). ``chunk_bytes``: the unit of locking and of messages. ``timeout``: seconds a request
    waits for a peer or a lock (default: the group's).
    """

    def __init__(self, init, group=None, chunk_bytes: int = 1 << 20,
                 timeout: float | None = None) -> None:
        group = _world() if group is None else group
        arr, self._torch, device = _host(init, "ShardedTensor", "init")
        self.shape = tuple(init.shape)
        self.dtype = arr.dtype
        if self.dtype.name not in _DTYPES:
            raise TypeError(f"ShardedTensor: init has dtype {self.dtype.name}; supported: "
                            f"{', '.join(_DTYPES)}")
        if int(chunk_bytes) < self.dtype.itemsize:
            raise ValueError(f"ShardedTensor: chunk_bytes must hold one element, got {chunk_bytes}")
        self._torch_dtype = getattr(init, "dtype", None) if self._torch else None
        self.device = device
        self.timeout = float(group.timeout if timeout is None else timeout)
        self.group, self.rank, self.size = group, group.rank, group.size
        self.name = f"ps tensor {next(_names)}"
        if group.size > 1 and group.comm is None:
            raise ValueError("ShardedTensor: group runs over torch.distributed; the parameter "
                             "server needs a group launched under MPI (mpiexec, terrapipe run)")
        mine = (self.shape, self.dtype.name, int(chunk_bytes))
        everyone = group.exchange_objects(mine)
        odd = [r for r, v in enumerate(everyone) if v != everyone[0]]
        if odd:
            raise ValueError(f"ShardedTensor: ranks disagree on (shape, dtype, chunk_bytes): rank 0 "
                             f"has {everyone[0]}, " + ", ".join(f"rank {r} has {everyone[r]}" for r in odd))
        self.layout = Layout(arr.size, self.size, self.dtype.itemsize, chunk_bytes)
        self._wire = self._endpoint = None
        if group.comm is None:
            node_ranks, node_comm = [0], None
            self.peers = [Peer(0, os.uname().nodename, os.getpid())]
        else:
            node_ranks = group.node_ranks
            node_comm = group.comm.Split(min(node_ranks), key=self.rank)
            self.peers = [Peer(r, h, p) for r, (h, p) in
                          enumerate(group.comm.allgather((os.uname().nodename, os.getpid())))]
        try:
            self._shards = NodeShards(node_comm, node_ranks, self.rank, self.layout, self.dtype,
                                      self.timeout)
        finally:
            if node_comm is not None:
                node_comm.Free()
        start, stop = self.layout.shard(self.rank)
        self._shards.shards[self.rank][:] = arr[start:stop]
        me = node_ranks.index(self.rank)
        self._local = node_ranks[me:] + node_ranks[:me]  # own shard first: less lock contention
        self._remote = [r for r in range(self.size) if r not in node_ranks]
        if self._remote:
            # Also the barrier: no rank pushes before every shard is initialised.
            try:
                servers, clients = connect_ranks(group.comm, self.rank, self._remote, self._remote,
                                                 self.timeout, self.name)
            except BaseException:
                self._shards.close()
                raise
            self._endpoint = Endpoint(self.rank, self._shards, self.layout, self.dtype, self.peers,
                                      self.timeout, self.name, servers, clients)
            wire_thread().register(self._endpoint)
        elif group.comm is not None:
            self._wire = group.comm.Dup()
            self._wire.Barrier()  # every shard initialised before any rank pushes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="terrapipe-ps-client")
        self._seq = 0
        self._failed: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def numel(self) -> int:
        return self.layout.numel

    # -- client API ----------------------------------------------------------------------------
    def push(self, x=None, rule: str = "add", scale: float = 1.0) -> Handle:
        """Apply ``rule`` to every shard with ``x`` (same number of elements and dtype):
        ``"add"`` ``t += scale * x``, ``"copy"`` ``t = x``, ``"zero"`` ``t = 0`` (``x`` unused).
        Returns a Handle; ``wait()`` returns None once every shard applied it."""
        return self._submit("push", rule, scale, x, None, want=False)

    def pull(self, out=None) -> Handle:
        """Read the whole tensor, assembled from every shard, into ``out`` (numpy array or torch
        tensor of the tensor's shape and dtype; default: a new one). ``wait()`` returns ``out``."""
        return self._submit("pull", None, 1.0, None, out, want=True)

    def push_pull(self, x=None, rule: str = "add", scale: float = 1.0, out=None) -> Handle:
        """``push`` then ``pull`` in one pass: each chunk is updated and read under one lock
        (one round trip per remote shard). ``wait()`` returns ``out``."""
        return self._submit("push_pull", rule, scale, x, out, want=True)

    def close(self) -> None:
        """Collective: finish this rank's requests, wait for every rank's, stop the server and
        release the shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            if self._endpoint is not None:  # every client's CLOSE (NOTE [shard wire protocol] 4)
                if self._failed is None:
                    wire_thread().close(self._endpoint)
                else:  # unusable: no barrier with ranks that may have gone
                    wire_thread().drop(self._endpoint, CommError(f"{self.name}: closed"))
            elif self._wire is not None:
                if self._failed is None:
                    self._wire.Barrier()
                self._wire.Free()
        finally:
            self._wire = self._endpoint = None
            self._shards.close()

    def __enter__(self) -> ShardedTensor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _submit(self, what: str, rule: str | None, scale: float, x, out, want: bool) -> Handle:
        name = f"{self.name}: {what}"
        if self._closed:
            raise CommError(f"{name}: the tensor is closed")
        if self._failed:
            raise CommError(f"{name}: unusable after an earlier failure: {self._failed}")
        if self._endpoint is not None and self._endpoint.error:
            raise CommError(f"{name}: {self._endpoint.error}")
        code = kshard.NONE
        if rule is not None:
            if rule not in kshard.RULES:
                raise ValueError(f"{name}: rule must be one of {sorted(kshard.RULES)}, got {rule!r}")
            code = kshard.RULES[rule]
        if self.dtype.kind == "i" and float(scale) != int(scale):
            raise ValueError(f"{name}: scale must be an integer for a {self.dtype.name} tensor, "
                             f"got {scale}")
        scale = self.dtype.type(scale)
        src = None
        if code in (kshard.ADD, kshard.COPY):
            if x is None:
                raise ValueError(f"{name}: x is required for rule {rule!r}")
            src, _, _ = _host(x, name, "x")
            self._check(name, "x", src, x)
        result, dst, device_out = None, None, None
        if want:
            if out is None:
                out = self._new()
            dst, _, device_out = _host(out, name, "out")
            self._check(name, "out", dst, out)
            if device_out is None and not self._shares_memory(out, dst):
                raise ValueError(f"{name}: out must be contiguous")
            result = out
        fut = self._pool.submit(self._execute, name, code, scale, src, dst, out if device_out else None)
        if want:
            fut = _Then(fut, result)
        return Handle(fut)

    def _new(self):
        if self._torch:
            import torch

            return torch.empty(self.shape, dtype=self._torch_dtype)
        return np.empty(self.shape, self.dtype)

    @staticmethod
    def _shares_memory(out, flat: np.ndarray) -> bool:
        if isinstance(out, np.ndarray):
            return np.shares_memory(out, flat)
        return out.is_contiguous()

    def _check(self, name: str, arg: str, flat: np.ndarray, x) -> None:
        if flat.size != self.numel:
            raise ValueError(f"{name}: {arg} has {flat.size} elements (shape {tuple(x.shape)}); "
                             f"the tensor has {self.numel} (shape {self.shape})")
        if flat.dtype != self.dtype:
            raise TypeError(f"{name}: {arg} has dtype {flat.dtype.name}; the tensor's is "
                            f"{self.dtype.name}")

    def _execute(self, name: str, rule: int, scale, src, dst, device_out) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
        wire = wire_thread() if self._endpoint is not None else None
        pending = [wire.submit(Request(self._endpoint, r, rule, scale, src, dst, seq,
                                       f"{name} (shard of rank {r})"))
                   for r in self._remote if self.layout.shard_len(r)]
        try:
            for r in self._local:
                base = self.layout.shard(r)[0]
                for k, lo, hi in self.layout.chunks(r):
                    self._shards.apply(r, lo, hi, k, rule, scale,
                                       None if src is None else src[base + lo:base + hi],
                                       None if dst is None else dst[base + lo:base + hi], name)
        except CollectiveTimeoutError as e:
            self._failed = str(e)
            if pending:  # no reply may land in the caller's ``out`` after this raises
                wire.abandon(self._endpoint, e)
            raise
        try:
            for req in pending:
                req.wait()
        except CollectiveTimeoutError as e:
            self._failed = str(e)  # its siblings were failed with it (NOTE [one thread on the wire] 3)
            raise
        if device_out is not None:
            import torch

            device_out.copy_(torch.from_numpy(dst).view(device_out.shape))


class _Then:
    """A future that completes as ``fut`` does, with ``value`` as its result."""

    def __init__(self, fut, value) -> None:
        self._fut, self._value = fut, value

    def result(self, timeout=None):
        self._fut.result(timeout)
        return self._value

    def done(self) -> bool:
        return self._fut.done()
