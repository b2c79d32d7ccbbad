"""Machine code that llvmlite compiled, kept on disk for the next process, as Numba keeps its own.

Used by :mod:`terrapipe.kernels.resample_ir`: an MCJIT engine asks :meth:`ObjectCache.load` for
the object before compiling and hands :meth:`ObjectCache.store` what it compiled.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading

import llvmlite.binding as llvm
from numba.core import config

__all__ = ["ObjectCache"]


class ObjectCache:
    """Machine code of one LLVM module on disk, beside Numba's cache (``NUMBA_CACHE_DIR``, else this
    package's ``__pycache__``), keyed by the IR, the CPU and its features, and LLVM's version:
    a second process loads it instead of spending ~0.4 s compiling. Only a file this user owns
    and nobody else can write is loaded; an unwritable directory just means no cache."""

    def __init__(self, text: str, cpu: str, features: str) -> None:
        """text: the module's IR; cpu, features: the target machine's."""
        ident = "\0".join([text, cpu, features, ".".join(map(str, llvm.llvm_version_info))])
        digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
        root = config.CACHE_DIR or os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
        self.path = os.path.join(root, f"terrapipe-llvm-{digest}.o")

    def hit(self) -> bool:
        return self._trusted_bytes() is not None

    def _trusted_bytes(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    return None
                return f.read()
        except OSError:
            return None

    def load(self, module) -> bytes | None:
        return self._trusted_bytes()

    def store(self, module, buffer: bytes) -> None:
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(buffer)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the whole new one
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
