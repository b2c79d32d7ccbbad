"""terrapipe.kernels: the compiled core.

Pure functions over NumPy arrays, compiled with ``numba.njit(nogil=True, cache=True)``: they
release the GIL (so a thread pool runs them in parallel), are cached on disk (a second process
does not recompile), and never allocate in the hot path (callers pass ``out`` and scratch).
This package imports only NumPy and Numba; torch never.

Modules:
  image   crop + bilinear resize (antialiased) fused with flip, normalize and HWC->CHW
  resample_ir the resize's two passes as LLVM IR at the CPU's vector width (llvmlite, Numba's
          own backend), called from image's Numba code through a function pointer
  object_cache llvmlite's machine code kept on disk beside Numba's cache
  cache_stamp Numba's cache judged by the files of the modules a compiled function imports too
  llvm_ir small LLVM IR building blocks (loops, splats, transposes) for resample_ir
  reduce  ``dst op= src`` and multi-source reductions over chunks, for collectives
  adasum  Adasum's dot products and norms, and its scaled sum, over a piece of fused tensors
  rng     counter-based Philox keyed by (seed, epoch, sample index, op id)
  floats  float16 / bfloat16 held as uint16
  sync    step counters shared between processes: acquire loads, release stores, bounded spins
  entry   a kernel's compiled entry point for given argument types (no dispatch per call)
  oneshot a small allreduce, allgather, gather or broadcast through shared rows (publish, wait,
          check, reduce or copy) in one call
  shard   the parameter server's update rules applied to a shard under its lock
  geometry the crop boxes of random-resized-crop and center crop (pure arithmetic)
  taps    the resize's filter taps for a batch of crops, for resampling by matrix products
"""

# ruff: noqa: E402 (the imports below come after the cache's stamp is installed)

from . import cache_stamp, entry

# Before any compiled function below is made: NOTE [a cached caller of a changed callee] 3.
cache_stamp.install()
entry.install()  # NOTE [one compiler per kernel] 2: before any is compiled

from . import (
    adasum,
    entry,
    floats,
    geometry,
    image,
    llvm_ir,
    object_cache,
    oneshot,
    reduce,
    resample_ir,
    rng,
    shard,
    sync,
    taps,
)
from .entry import entry_point
from .floats import BF16, F16, compress, decompress
from .image import (
    alloc_resize_scratch,
    build_normalize_lut,
    hflip,
    hwc_to_chw,
    identity_lut,
    normalize_lut,
    resize_crop,
    resize_crop_bilinear,
    resize_crop_bilinear_region,
)
from .reduce import divide, reduce_into, reduce_many_into
from .rng import fill_uniform, philox4x64, randint, random_u64, uniform

__all__ = [
    "adasum",
    "entry",
    "floats",
    "geometry",
    "image",
    "llvm_ir",
    "object_cache",
    "oneshot",
    "reduce",
    "resample_ir",
    "rng",
    "shard",
    "sync",
    "taps",
    "entry_point",
    "BF16",
    "F16",
    "compress",
    "decompress",
    "alloc_resize_scratch",
    "build_normalize_lut",
    "hflip",
    "hwc_to_chw",
    "identity_lut",
    "normalize_lut",
    "resize_crop",
    "resize_crop_bilinear",
    "resize_crop_bilinear_region",
    "divide",
    "reduce_into",
    "reduce_many_into",
    "fill_uniform",
    "philox4x64",
    "randint",
    "random_u64",
    "uniform",
]
