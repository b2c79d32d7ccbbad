"""terrapipe: fast input pipelines and gradient averaging for PyTorch training.

Subpackages (imports flow engine -> pipeline, comm -> kernels; launch_env is a leaf):
  terrapipe.kernels   Numba-compiled image, reduction and RNG kernels
  terrapipe.pipeline  FastLoader: decode + augmentation on a thread pool, fed to the device
  terrapipe.comm      collectives over shared memory, MPI and torch.distributed
  terrapipe.ps        parameter server: sharded tensors, async push/pull, Downpour/EASGD/averaging
  terrapipe.engine    data-parallel training on top of them
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "FastLoader", "jit_allreduce"]


def __getattr__(name: str):
    # Lazy: ``import terrapipe`` stays cheap (no torch) until the loader or comm is asked for.
    if name == "FastLoader":
        from .pipeline import FastLoader

        return FastLoader
    if name == "jit_allreduce":
        from .comm import jit_allreduce

        return jit_allreduce
    raise AttributeError(f"module 'terrapipe' has no attribute {name!r}")
