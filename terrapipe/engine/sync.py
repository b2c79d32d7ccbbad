"""Start every rank from the same state: parameters, buffers and optimizer state from a root."""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, root: int = 0) -> None:
    """Copy ``root``'s parameters and buffers into every rank's ``model`` (in place).

    Tensors are fused per dtype into one message each (as TorchMPI's synchronizeParameters and
    Horovod's broadcast_parameters do, without one collective per tensor).
    """
    tensors = list(model.state_dict(keep_vars=True).values())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            by_dtype.setdefault(t.dtype, []).append(t.data if isinstance(t, torch.nn.Parameter) else t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
        comm.broadcast(flat, root)
        offset = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root``'s."""
    state = comm.broadcast_object(optimizer.state_dict(), root)
    if comm.rank() != root:
        optimizer.load_state_dict(state)
