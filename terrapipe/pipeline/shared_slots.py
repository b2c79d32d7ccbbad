"""The loader's batch slots in shared memory, mapped by the loader and by its worker process.

One file in ``/dev/shm`` holds every host slot of the ring (images and labels). The loader
creates it, reserves its pages (``posix_fallocate``: a full ``/dev/shm`` is refused at once,
naming the bytes needed, never a SIGBUS in a worker later), carves the slots out of it, and
unlinks the name as soon as the worker process has mapped it: after that the memory lives only
as long as the two mappings, so no crash of either process leaves anything in ``/dev/shm``.
A crash inside the create-to-unlink window can: :func:`remove_stale` deletes files whose
creating process is gone, at every mapping's creation.

A slot whose batch the consumer still holds when it is to be refilled moves to a mapping of its
own (NOTE [batch buffer ownership] 3 in loader.py): the loader creates it the same way, hands
the worker an open descriptor of it over their pipe (:meth:`SharedSlots.from_fd`) and unlinks
the name at once.

NOTE [a mapping holds no descriptor]
    Python's ``mmap.mmap`` (before 3.13's ``trackfd=False``) keeps a duplicate of the file's
    descriptor for as long as the mapping lives. A kept batch keeps its mapping, so
    ``list(loader)`` kept one descriptor per batch and failed with "Too many open files" at the
    process's limit (often 1024). The memory is therefore mapped with libc's ``mmap`` directly,
    the descriptor closed at once, and unmapped when the last array over it is gone (a finalizer
    on the buffer object every array keeps alive).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import weakref

import numpy as np

from ..launch_env import create_shm_file, remove_orphaned_files

__all__ = ["SharedSlots", "remove_stale", "PREFIX"]

PREFIX = "terrapipe_loader_"
_SHM_DIR = "/dev/shm"
_ALIGN = 4096  # each array page-aligned: a kernel's rows never share a page with another slot's

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, nbytes: int) -> ctypes.Array:
    """``nbytes`` of the file ``fd`` mapped shared and read-write, as a ctypes byte array that
    owns the mapping: it is unmapped when the array object is garbage, and holds no descriptor
    (NOTE [a mapping holds no descriptor]; the caller keeps owning ``fd``)."""
    address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes of shared memory: {os.strerror(err)}")
    buf = (ctypes.c_uint8 * nbytes).from_address(address)
    unmap = weakref.finalize(buf, _libc.munmap, address, nbytes)
    unmap.atexit = False  # the process's end unmaps it; an array may still be read until then
    return buf


def remove_stale() -> list[str]:
    """Unlink slot files whose creating process no longer exists; returns their paths."""
    return remove_orphaned_files(_SHM_DIR, PREFIX)


class SharedSlots:
    """A shared mapping of ``nbytes`` that arrays are carved out of (:meth:`empty`).

    The creating process calls :meth:`empty` for each slot array and sends :attr:`path` and
    each array's :meth:`describe` to the worker, which calls :meth:`attach` and :meth:`view`;
    the creator then calls :meth:`unlink`. Arrays (and tensors made from them) keep the mapping
    alive. ``purpose`` names what the memory is for in the error a full ``/dev/shm`` raises.
    """

    def __init__(self, nbytes: int, *, path: str | None = None, fd: int | None = None,
                 purpose: str = "the loader's batch slots") -> None:
        self.nbytes = int(nbytes)
        self.path = path  # None for a mapping made from a descriptor (from_fd)
        own = None
        if fd is None:
            if path is None:
                self.path = self._create(purpose)
            fd = own = os.open(self.path, os.O_RDWR)
        try:
            self._buffer = _map_shared(fd, self.nbytes)
        finally:
            if own is not None:
                os.close(own)
        self._base = np.frombuffer(self._buffer, np.uint8)
        self._offset = 0

    def _create(self, purpose: str) -> str:
        if not os.path.isdir(_SHM_DIR):
            raise RuntimeError(f"workers='process': {_SHM_DIR} does not exist on this system")
        remove_stale()
        try:
            return create_shm_file(_SHM_DIR, PREFIX, self.nbytes, reserve=True)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                free = shutil.disk_usage(_SHM_DIR).free
                raise RuntimeError(
                    f"workers='process': {purpose} need {self.nbytes / 2**20:.1f} MiB of "
                    f"{_SHM_DIR}, which has {free / 2**20:.1f} MiB free (a container's --shm-size); "
                    f"use a smaller batch_size or prefetch, or workers='threads'") from None
            raise

    @classmethod
    def attach(cls, path: str, nbytes: int) -> SharedSlots:
        """The worker's mapping of the creator's file."""
        return cls(nbytes, path=path)

    @classmethod
    def from_fd(cls, fd: int, nbytes: int) -> SharedSlots:
        """A mapping of the open descriptor ``fd`` (which the caller still owns and closes)."""
        return cls(nbytes, fd=fd)

    def open_fd(self) -> int:
        """A new read-write descriptor of the creator's file, for sending to the worker before
        :meth:`unlink` (the caller closes it)."""
        if self.path is None:
            raise ValueError("SharedSlots.open_fd: this mapping was made from a descriptor, it has no name")
        return os.open(self.path, os.O_RDWR)

    @property
    def address(self) -> int:
        """The mapping's first byte in this process (what ``cudaHostRegister`` takes)."""
        return int(self._base.ctypes.data)

    @staticmethod
    def size_of(arrays: list[tuple[tuple[int, ...], np.dtype]]) -> int:
        """Bytes a mapping needs for arrays of these (shape, dtype), each page-aligned."""
        return sum(-(-int(np.prod(s)) * np.dtype(d).itemsize // _ALIGN) * _ALIGN for s, d in arrays) or _ALIGN

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` in the mapping (uninitialised)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        start = self._offset
        if start + n > self.nbytes:
            raise ValueError(f"SharedSlots: {n} more bytes do not fit ({start} of {self.nbytes} used)")
        self._offset = start + -(-n // _ALIGN) * _ALIGN
        return self._base[start:start + n].view(dtype).reshape(shape)

    def describe(self, arr: np.ndarray) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
        """(byte offset, shape, strides, dtype) of ``arr``, a view into this mapping: what the
        worker's :meth:`view` rebuilds it from."""
        offset = int(arr.ctypes.data) - self.address
        if not 0 <= offset < self.nbytes:
            raise ValueError("SharedSlots.describe: the array is not in this mapping")
        return offset, tuple(arr.shape), tuple(arr.strides), arr.dtype.str

    def view(self, offset: int, shape, strides, dtype: str) -> np.ndarray:
        """The array :meth:`describe` described, in this process's mapping."""
        return np.ndarray(tuple(shape), np.dtype(dtype), buffer=self._buffer, offset=offset,
                          strides=tuple(strides))

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay); idempotent."""
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
