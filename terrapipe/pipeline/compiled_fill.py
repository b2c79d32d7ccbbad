"""A chunk of a batch's rows filled in one compiled call: each sample's file read, its JPEG
region decoded (the libjpeg-turbo shim of :mod:`.roi_jpeg`), its crop box and flip drawn, and
the crop resampled into its row, without the GIL and without Python between samples.

NOTE [one compiled call per chunk]
    1. Why: the per-sample path of :class:`~terrapipe.pipeline.samples.SampleWriter` crosses the
       GIL about eight times a sample (open, fstat, read and close of the file, the shim's header
       and decode, the box and flip draws, the kernel) and runs some 60 us of Python between
       them. Each retake can queue a thread that launches a training step's kernels behind the
       loader's threads (NOTE [scalar draws keep the GIL] in kernels/rng.py); here a chunk of
       ``CHUNK`` samples takes it once.
    2. What it takes: samples whose bytes are a file, or a range of one, that the loader can
       name (a source's ``file_table()``: :meth:`~terrapipe.pipeline.sources.ImageFolder.file_table`,
       :meth:`~terrapipe.pipeline.shards.TarShards.file_table`, for sources that read them as
       they are), a geometry whose box rule is one of :data:`BOX_KINDS` (the plan's
       ``box_kind``), and the shim. Everything else, and every sample this call declines, runs
       the per-sample path, which raises or skips as it always did: a file that cannot be
       opened or read whole into the thread's buffer, a payload the shim declines (not a JPEG,
       CMYK, any libjpeg warning), a region larger than the thread's buffers. ``status[k]`` says
       which (``OK`` or the reason), so the caller sends only those samples the slow way.
    3. Same bytes as the per-sample path: the same file bytes, the same shim calls, the box and
       flip from the same compiled draws (kernels.geometry, kernels.rng), the region from
       :func:`~terrapipe.pipeline.roi_jpeg.region_of` (the one rule both use) and the same
       kernel through :func:`terrapipe.kernels.image.resize_region_at`. Tests compare the two
       bit for bit.
    4. Ownership: the caller's arrays only; ``filebuf``, ``region`` and the resize scratch are
       the calling thread's (SampleWriter's per-thread scratch: the region buffer is its
       RoiDecoder's, grown by the per-sample path as before), overwritten sample after sample.
       The shim's handle is the thread's too (one thread at a time, as libjpeg wants).
    5. Timeline: with ``times`` of shape (n, 4) the call records each sample's clock
       (CLOCK_MONOTONIC, the timeline's) at its start and after its read, decode and kernel;
       the caller turns them into the per-sample ``read``, ``decode region`` and ``kernel``
       events afterwards.
"""

from __future__ import annotations

import os

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import settings
from ..kernels import geometry, image, rng
from . import roi_jpeg
from .transforms import _OP_CROP, _OP_FLIP, BOX_RANDOM_RESIZED_CROP, BOX_RESIZE_CENTER_CROP, BOX_WHOLE

__all__ = ["OK", "UNREAD", "BIG_FILE", "DECLINED", "BIG_REGION", "BOX_KINDS", "FileTable", "available",
           "fill_rows"]

# status[k] of a sample (NOTE [one compiled call per chunk] 2): written, or why it was left
# to the per-sample path: the file could not be opened or read, it is larger than the thread's
# file buffer, the shim declined it, or its region is larger than the thread's resize scratch.
OK, UNREAD, BIG_FILE, DECLINED, BIG_REGION = 0, 1, 2, 3, 4

# The plan's box rules (Plan.box_kind) this call draws; the op ids of its draws are
# transforms.py's own (_OP_CROP, _OP_FLIP).
BOX_KINDS = (BOX_WHOLE, BOX_RANDOM_RESIZED_CROP, BOX_RESIZE_CENTER_CROP)

_O_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

_pread = types.ExternalFunction("pread", types.intp(types.intc, types.uintp, types.uintp, types.intp))
_close = types.ExternalFunction("close", types.intc(types.intc))
_clock = types.ExternalFunction("clock_gettime", types.intc(types.intc, types.uintp))
_CLOCK_MONOTONIC = 1  # Linux's; time.monotonic_ns reads the same clock
# The shim's entry points, by symbol (roi_jpeg.register_symbols puts them in the process's table)
_header = types.ExternalFunction("tp_jpeg_header", types.intc(types.uintp, types.uintp, types.uintp,
                                                               types.uintp, types.uintp))
_decode = types.ExternalFunction("tp_jpeg_decode", types.intc(
    types.uintp, types.intc, types.intc, types.intc, types.intc, types.intc, types.uintp, types.uintp,
    types.uintp, types.uintp))


@intrinsic
def _open(typingctx, path, flags):
    """``open(path, flags)`` (a NUL-terminated path at the integer address ``path``), called as
    the variadic function it is: declared non-variadic, the call would leave x86-64's
    vector-register count unset."""
    if not isinstance(path, types.Integer) or not isinstance(flags, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        char_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [char_p, ir.IntType(32)], var_arg=True)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "open")
        mode = context.cast(builder, args[1], signature.args[1], types.int32)
        return builder.call(fn, [builder.inttoptr(args[0], char_p), mode])

    return types.int32(path, flags), codegen


def available() -> bool:
    """Whether a loader constructed now fills chunks in compiled calls: the shim is built and
    enabled (roi_jpeg.enabled), on a POSIX system (its file and clock calls), and
    ``TERRAPIPE_COMPILED_FILL`` is not 0."""
    return (settings.get("TERRAPIPE_COMPILED_FILL") and roi_jpeg.enabled() and os.name == "posix"
            and roi_jpeg.register_symbols())


class FileTable:
    """Where a source's samples lie, for compiled reads: sample i is ``sizes[i]`` bytes at
    ``offsets[i]`` of file ``file_of[i]`` (a size of -1: the whole file), labelled
    ``labels[i]``. ``names`` (uint8) holds each file's path as the OS spells it, NUL-terminated,
    back to back, file f's from ``starts[f]``; ``paths`` the same as str. Without ``file_of``,
    sample i is the whole file ``paths[i]``. Built once per loader; read-only after."""

    def __init__(self, paths: list[str], labels, file_of=None, offsets=None, sizes=None) -> None:
        encoded = [os.fsencode(p) + b"\0" for p in paths]
        self.paths = list(paths)
        self.starts = np.zeros(len(encoded), np.int64)
        if encoded:
            np.cumsum([len(e) for e in encoded[:-1]], out=self.starts[1:])
        self.names = np.frombuffer(b"".join(encoded), np.uint8)
        self.labels = np.asarray(labels, np.int64)
        n = len(self.labels)
        self.file_of = np.arange(n, dtype=np.int64) if file_of is None else np.asarray(file_of, np.int64)
        self.offsets = np.zeros(n, np.int64) if offsets is None else np.asarray(offsets, np.int64)
        self.sizes = np.full(n, -1, np.int64) if sizes is None else np.asarray(sizes, np.int64)
        if not (len(self.file_of) == len(self.offsets) == len(self.sizes) == n):
            raise ValueError(f"FileTable: {n} labels but {len(self.file_of)} files, {len(self.offsets)} "
                             f"offsets and {len(self.sizes)} sizes")

    def take(self, order) -> FileTable:
        """The samples at ``order``, in that order (a subset or a permutation of the source)."""
        order = np.asarray(order, np.int64)
        table = FileTable.__new__(FileTable)
        table.paths, table.starts, table.names = self.paths, self.starts, self.names
        for name in ("labels", "file_of", "offsets", "sizes"):
            setattr(table, name, getattr(self, name)[order])
        return table

    def size_of(self, i: int) -> int:
        """Sample i's bytes: its member's size, or its file's as the file system has it now."""
        if self.sizes[i] >= 0:
            return int(self.sizes[i])
        return os.stat(self.paths[self.file_of[i]]).st_size


@njit(nogil=True, cache=True)
def _now(clock):
    _clock(_CLOCK_MONOTONIC, clock.ctypes.data)
    return clock[0] * 1_000_000_000 + clock[1]


@njit(nogil=True, cache=True)
def _read_file(names, start, offset, size, buf, probe):
    """Sample bytes into ``buf``: ``size`` bytes at ``offset`` of the file whose path is at
    ``names[start:]``, or the whole file for a size of -1. Returns the bytes read; -1 when the
    file cannot be opened or read, or holds fewer than ``size`` bytes there; -2 when they do not
    fit in ``buf``. probe: uint8 scratch of one byte."""
    cap = buf.shape[0]
    if size > cap:
        return -2
    fd = _open(names.ctypes.data + start, _O_RDONLY)
    if fd < 0:
        return -1
    want = cap if size < 0 else size
    got = 0
    while got < want:
        n = _pread(fd, buf.ctypes.data + got, want - got, offset + got)
        if n <= 0:
            _close(fd)
            return got if n == 0 and size < 0 else -1
        got += n
    if size < 0:  # the buffer is full: one byte more tells a file that fits it from a larger one
        more = _pread(fd, probe.ctypes.data, 1, offset + got)
        _close(fd)
        return got if more == 0 else (-1 if more < 0 else -2)
    _close(fd)
    return got


@njit(nogil=True, cache=True)
def _box(kind, args, w, h, seed, epoch, index):
    if kind == BOX_RANDOM_RESIZED_CROP:
        return geometry.random_resized_crop_box(w, h, args[0], args[1], args[2], args[3], seed, epoch, index,
                                                _OP_CROP)
    if kind == BOX_RESIZE_CENTER_CROP:
        return geometry.resize_center_crop_box(w, h, int(args[0]), int(args[1]), int(args[2]))
    return 0.0, 0.0, float(w), float(h)


@njit(nogil=True, cache=True)
def fill_rows(handle, names, starts, file_of, offsets, sizes, labels_of, indices, images, labels, row0,
              box_kind, box_args, flip_p, seed, epoch, address, lut, filebuf, region, cap_h, cap_w, block,
              xbounds, xweights, ybounds, yweights, params, ints, clock, status, times):
    """Rows ``row0 + k`` of ``images`` (N, C, H, W) and ``labels`` (N,) int64 from samples
    ``indices[k]`` (NOTE [one compiled call per chunk]); ``status[k]`` (int32) says whether row
    k was written (OK) or why it is left to the per-sample path.

    handle: the thread's shim handle (RoiDecoder.handle); names, starts, file_of, offsets, sizes,
    labels_of: a :class:`FileTable`'s; box_kind, box_args (float64 (4,)), flip_p: the plan's; address: the
    resample kernel (``kernels.image.resize_kernel``); lut: (C, 256) of ``images``' dtype; filebuf: uint8,
    a file's bytes; region: uint8, the decoded region (RoiDecoder.pixel_buffer); block ..
    params: the resize scratch, covering regions up to ``cap_h x cap_w`` pixels; ints: int32
    (4,); clock: int64 (2,); times: int64 (n, 4), or (0, 4) to record nothing."""
    out_h, out_w = images.shape[2], images.shape[3]
    record = times.shape[0] > 0
    probe = np.empty(1, np.uint8)
    for k in range(indices.shape[0]):
        index = indices[k]
        if record:
            times[k, 0] = _now(clock)
        got = _read_file(names, starts[file_of[index]], offsets[index], sizes[index], filebuf, probe)
        if got < 0:
            status[k] = BIG_FILE if got == -2 else UNREAD
            continue
        if record:
            times[k, 1] = _now(clock)
        if _header(handle, filebuf.ctypes.data, got, ints.ctypes.data, ints.ctypes.data + 4) != 0:
            status[k] = DECLINED
            continue
        w, h = np.int64(ints[0]), np.int64(ints[1])
        bx0, by0, bx1, by1 = _box(box_kind, box_args, w, h, seed, epoch, index)
        denom, sw, sh, bx0, by0, bx1, by1, x0, y0, x1, y1 = roi_jpeg.region_of(
            w, h, bx0, by0, bx1, by1, out_h, out_w)
        rows = y1 - y0
        # The per-sample path sizes its region buffer so (RoiDecoder.decode); the shim writes
        # whole iMCU columns, never past the scaled width.
        if sw * 4 * rows > region.shape[0]:
            status[k] = BIG_REGION  # the shim's parsed header is dropped by its next header call
            continue
        if _decode(handle, denom, x0, y0, x1, y1, region.ctypes.data, region.shape[0], ints.ctypes.data + 8,
                   ints.ctypes.data + 12) != 0:
            status[k] = DECLINED
            continue
        ox, rw = np.int64(ints[2]), np.int64(ints[3])
        if rows > cap_h or rw > cap_w:
            status[k] = BIG_REGION
            continue
        pixels = region[:rw * 4 * rows].reshape((rows, rw, 4))
        if record:
            times[k, 2] = _now(clock)
        flip = flip_p > 0 and rng.uniform(seed, epoch, index, _OP_FLIP, 0) < flip_p
        image.resize_region_at(address, pixels, ox, y0, sw, sh, bx0, by0, bx1, by1, images[row0 + k], lut,
                               flip, block, xbounds, xweights, ybounds, yweights, params)
        labels[row0 + k] = labels_of[index]
        status[k] = OK
        if record:
            times[k, 3] = _now(clock)
