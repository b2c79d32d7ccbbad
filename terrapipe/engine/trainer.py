"""Engine: torchnet-style train and test loops with hooks, for one or many ranks.

    engine = Engine(model, criterion, optimizer, train_loader, val_loader, checkpoint_dir="ckpt")
    engine.hooks["on_forward"] = lambda state: ...
    engine.train(epochs=10)

Hooks receive the mutable ``state`` dict (model, optimizer, epoch, step, sample, output, loss,
metrics, ...) and run in this order: on_start; per epoch: per batch on_batch (after loading),
on_forward (after the loss), on_backward, on_update (after the optimizer step); on_epoch_end
(after metrics are averaged across ranks and validation ran); on_end.

Metrics (loss, accuracy, img/s) are summed locally and averaged across ranks once per epoch.
Rank 0 shows a tqdm bar and writes checkpoints atomically (temp file + rename): model,
optimizer, epoch and the train loader's state. ``train`` resumes from the newest checkpoint on
every rank, loaded with ``weights_only=True``: tensors and plain containers only, so a file
someone else could write cannot run code when training resumes (CheckpointError names it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import comm, timeline

__all__ = ["Engine", "HOOKS", "CheckpointError"]

_CHECKPOINT_KEYS = ("epoch", "model", "optimizer", "loader", "history")

HOOKS = ("on_start", "on_batch", "on_forward", "on_backward", "on_update", "on_epoch_end", "on_end")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be resumed from (refused, truncated, or not the engine's)."""


class Engine:
    """Train ``model`` with ``criterion`` and ``optimizer`` (a DistributedOptimizer under several
    ranks) on ``train_loader`` batches ``(inputs, targets)``; ``val_loader`` is evaluated after
    each epoch. ``amp``: autocast in ``amp_dtype`` (default bfloat16 on CPU, float16 on CUDA);
    float16 steps through a GradScaler, after the gradients are averaged (see
    DistributedOptimizer)."""

    def __init__(self, model: torch.nn.Module, criterion: Callable, optimizer, train_loader,
                 val_loader=None, *, checkpoint_dir: str | os.PathLike | None = None,
                 amp: bool = False, progress: bool = True, device: str | torch.device = "cpu",
                 amp_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.criterion = criterion
        self.optimizer = optimizer
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.device = torch.device(device)
        self.amp = amp
        self.progress = progress
        self.hooks: dict[str, Callable[[dict], None]] = {}
        self.history: list[dict] = []
        cuda = self.device.type == "cuda"
        self._amp_dtype = amp_dtype or (torch.float16 if cuda else torch.bfloat16)
        if self._amp_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"amp_dtype: expected torch.float16 or torch.bfloat16, got {amp_dtype}")
        use_scaler = amp and self._amp_dtype == torch.float16
        self._scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None

    # -- hooks -----------------------------------------------------------------------------------
    def _hook(self, name: str, state: dict) -> None:
        if name not in HOOKS:
            raise ValueError(f"unknown hook {name!r}; hooks are {HOOKS}")
        fn = self.hooks.get(name)
        if fn is not None:
            fn(state)

    # -- checkpoints -------------------------------------------------------------------------------
    def _checkpoint_path(self, epoch: int) -> Path:
        return self.checkpoint_dir / f"epoch{epoch:04d}.pt"

    def save_checkpoint(self, epoch: int) -> Path | None:
        """Rank 0 writes ``epoch{N}.pt`` atomically; every rank waits until it exists."""
        if self.checkpoint_dir is None:
            return None
        path = self._checkpoint_path(epoch)
        if comm.rank() == 0:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            loader = self.train_loader
            loader_state = loader.state_dict() if hasattr(loader, "state_dict") else None
            payload = {"epoch": epoch, "model": self.model.state_dict(),
                       "optimizer": self.optimizer.state_dict(), "loader": loader_state,
                       "history": self.history}
            tmp = path.with_suffix(".tmp")
            torch.save(payload, tmp)
            os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint
        comm.barrier()
        return path

    def _resume(self) -> int:
        if self.checkpoint_dir is None or not self.checkpoint_dir.is_dir():
            return 0
        found = sorted(self.checkpoint_dir.glob("epoch*.pt"))
        if not found:
            return 0
        state = load_checkpoint(found[-1], self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.history = list(state.get("history", []))
        return int(state["epoch"]) + 1

    # -- loops -------------------------------------------------------------------------------------
    def _forward(self, inputs, targets):
        with torch.autocast(self.device.type, dtype=self._amp_dtype, enabled=self.amp):
            output = self.model(inputs)
            loss = self.criterion(output, targets)
        return output, loss

    @staticmethod
    def _accumulate(sums: np.ndarray, loss, output, targets) -> None:
        n = targets.shape[0]
        sums[0] += float(loss.detach()) * n
        if output.dim() == 2 and targets.dim() == 1:
            sums[1] += float((output.detach().argmax(1) == targets).sum())
        sums[2] += n

    def _averaged(self, sums: np.ndarray, seconds: float) -> dict:
        total = comm.allreduce(sums.copy(), "sum")
        n = max(total[2], 1.0)
        rate = comm.allreduce(np.array([sums[2] / max(seconds, 1e-9)]), "sum")[0]
        # Python numbers: the history goes into checkpoints, which hold no NumPy objects.
        return {"loss": float(total[0] / n), "accuracy": float(total[1] / n), "samples": int(total[2]),
                "img_per_s": float(rate)}

    def train(self, epochs: int) -> list[dict]:
        """Run epochs ``[resumed, epochs)``; returns the per-epoch metrics history."""
        start_epoch = self._resume()
        state = {"model": self.model, "optimizer": self.optimizer, "epoch": start_epoch, "step": 0,
                 "engine": self, "train": True}
        self._hook("on_start", state)
        for epoch in range(start_epoch, epochs):
            state["epoch"] = epoch
            if hasattr(self.train_loader, "set_epoch"):
                self.train_loader.set_epoch(epoch)
            self.model.train()
            sums = np.zeros(3)
            bar = self._bar(len(self.train_loader), f"epoch {epoch}")
            timeline.instant("engine", f"epoch {epoch}")
            began = time.perf_counter()
            batches = iter(self.train_loader)
            while True:
                with timeline.span("loader", "next batch"):
                    batch = next(batches, None)
                    if batch is None:
                        break
                    inputs, targets = batch[0].to(self.device), batch[1].to(self.device)
                state.update(sample=(inputs, targets))
                self._hook("on_batch", state)
                self.optimizer.zero_grad()
                with timeline.span("engine", "forward"):
                    output, loss = self._forward(inputs, targets)
                state.update(output=output, loss=loss)
                self._hook("on_forward", state)
                if self._scaler is not None:
                    with timeline.span("engine", "backward"):
                        self._scaler.scale(loss).backward()
                    self._hook("on_backward", state)
                    self._step(self._scaled_step)
                else:
                    with timeline.span("engine", "backward"):
                        loss.backward()
                    self._hook("on_backward", state)
                    self._step(self.optimizer.step)
                state["step"] += 1
                self._hook("on_update", state)
                self._accumulate(sums, loss, output, targets)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            metrics = {"epoch": epoch, **{f"train_{k}": v for k, v in
                                          self._averaged(sums, time.perf_counter() - began).items()}}
            if bar is not None:
                bar.close()
            consolidate = getattr(self.optimizer, "consolidate", None)
            if consolidate is not None:  # a terrapipe.ps mode: validate and save the consensus model
                consolidate()
            if self.val_loader is not None:
                with timeline.span("engine", "validation"):
                    metrics.update({f"val_{k}": v for k, v in self.test(self.val_loader).items()})
            self.history.append(metrics)
            state["metrics"] = metrics
            self._hook("on_epoch_end", state)
            with timeline.span("engine", "checkpoint"):
                self.save_checkpoint(epoch)
        self._hook("on_end", state)
        return self.history

    def _step(self, step: Callable[[], object]) -> None:
        """One optimizer step, an "optimizer step" span on the timeline (where steps end for
        ``terrapipe timeline summary``) unless the optimizer records its own."""
        if getattr(self.optimizer, "records_step", False) and self._scaler is None:
            step()
            return
        with timeline.span("engine", "optimizer step"):
            step()

    def _scaled_step(self) -> None:
        """Average, then unscale, then step (Horovod's order): the scaler reads gradients no
        reduction owns any more, every rank sees the same inf (an inf anywhere is in the
        average), so all skip together, and a skipped step leaves nothing pending."""
        opt, scaler = self.optimizer, self._scaler
        if hasattr(opt, "skip_synchronize"):
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()

    @torch.no_grad()
    def test(self, loader) -> dict:
        """Loss and accuracy over ``loader``, averaged across ranks."""
        self.model.eval()
        sums = np.zeros(3)
        began = time.perf_counter()
        for inputs, targets in loader:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            output, loss = self._forward(inputs, targets)
            self._accumulate(sums, loss, output, targets)
        return self._averaged(sums, time.perf_counter() - began)

    def _bar(self, total: int, desc: str):
        if not self.progress or comm.rank() != 0:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def load_checkpoint(path: str | os.PathLike, map_location=None) -> dict:
    """A checkpoint :meth:`Engine.save_checkpoint` wrote, loaded with ``weights_only=True``
    (tensors, numbers, strings and containers; nothing that imports or calls code). Raises
    CheckpointError naming ``path`` for anything else, a tampered file included."""
    import pickle

    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: refused to load it ({first}); only tensors and "
                              "plain containers are accepted, as Engine.save_checkpoint writes them") from e
    if not isinstance(state, dict) or any(k not in state for k in _CHECKPOINT_KEYS[:3]):
        raise CheckpointError(f"checkpoint {path}: not an Engine checkpoint (expected a dict with "
                              f"{', '.join(_CHECKPOINT_KEYS)})")
    return state
