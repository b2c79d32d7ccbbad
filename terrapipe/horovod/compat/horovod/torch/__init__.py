"""``import horovod.torch as hvd`` under ``terrapipe run --horovod``: terrapipe.horovod."""

import importlib as _importlib
import sys as _sys

from terrapipe.horovod import *  # noqa: F403
from terrapipe.horovod import __all__  # noqa: F401

# horovod.torch.mpi_ops, .compression, .optimizer, .sync_batch_norm and .elastic are terrapipe's modules
for _name in ("mpi_ops", "compression", "optimizer", "sync_batch_norm", "elastic", "elastic.state",
              "elastic.sampler"):
    _sys.modules[f"{__name__}.{_name}"] = _importlib.import_module(f"terrapipe.horovod.{_name}")
