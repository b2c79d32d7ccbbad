"""Host memory pinned for CUDA copies that torch did not allocate: ``cudaHostRegister`` through
torch, for memory shared between processes (the loader's batch slots, comm's segment rows),
which the pinned allocator cannot hand out. A leaf (DESIGN.md, "Import direction"): the loader
and comm both pin that way, and neither may import the other. Imports torch when called.
"""

from __future__ import annotations

__all__ = ["register_host_memory", "unregister_host_memory"]


def register_host_memory(address: int, nbytes: int, portable: bool = False) -> None:
    """Pin ``nbytes`` of host memory at ``address`` (page-aligned, e.g. a shared mapping) for
    asynchronous copies: ``cudaHostRegister`` through torch, for the current device's context,
    or for every device's with ``portable`` (``cudaHostRegisterPortable``). Raises RuntimeError
    with CUDA's error code when the driver refuses."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 1 if portable else 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: "
                           f"CUDA error {int(err)}")


def unregister_host_memory(address: int) -> None:
    """Undo :func:`register_host_memory` (after every copy from or to that memory has
    completed, and before the memory is unmapped)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)
