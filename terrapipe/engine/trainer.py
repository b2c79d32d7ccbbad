"""Engine: torchnet-style train and test loops with hooks, for one or many ranks.

    engine = Engine(model, criterion, optimizer, train_loader, val_loader, checkpoint_dir="ckpt")
    engine.hooks["on_forward"] = lambda state: ...
    engine.train(epochs=10)

Hooks receive the mutable ``state`` dict (model, optimizer, epoch, step, sample, output, loss,
metrics, ...) and run in this order: on_start; per epoch: per batch on_batch (after loading),
on_forward (after the loss), on_backward, on_update (after the optimizer step); on_epoch_end
(after metrics are averaged across ranks and validation ran); on_end. on_rejoin: after an
elastic engine restored its last commit in a new world (``state["world_size"]``).

``elastic=True`` (under ``terrapipe run --min-np ...``, docs/elastic.md): the model, optimizer,
loader position, metric sums and RNG are committed in memory every ``commit_every`` steps and
at each epoch's end; when a collective fails (a rank died), every survivor restores the last
commit, joins the job's next generation, deals the rest of the epoch over the smaller world
(FastLoader's resume at any world size) and goes on, without a restart.

Metrics (loss, accuracy, img/s) are summed locally and averaged across ranks once per epoch.
Rank 0 shows a tqdm bar and writes checkpoints atomically (temp file + rename): model,
optimizer, epoch and the train loader's state. ``train`` resumes from the newest checkpoint on
every rank, loaded with ``weights_only=True``: tensors and plain containers only, so a file
someone else could write cannot run code when training resumes (CheckpointError names it).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import comm, timeline
from .commit import Commit

__all__ = ["Engine", "HOOKS", "CheckpointError"]

_CHECKPOINT_KEYS = ("epoch", "model", "optimizer", "loader", "history")

HOOKS = ("on_start", "on_batch", "on_forward", "on_backward", "on_update", "on_epoch_end", "on_end",
         "on_rejoin")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be resumed from (refused, truncated, or not the engine's)."""


class Engine:
    """Train ``model`` with ``criterion`` and ``optimizer`` (a DistributedOptimizer under several
    ranks) on ``train_loader`` batches ``(inputs, targets)``; ``val_loader`` is evaluated after
    each epoch. ``amp``: autocast in ``amp_dtype`` (default bfloat16 on CPU, float16 on CUDA);
    float16 steps through a GradScaler, after the gradients are averaged (see
    DistributedOptimizer). ``elastic``: survive a rank's death (see the module's docstring),
    committing every ``commit_every`` steps; needs a train loader that resumes at any world size
    (a FastLoader: ``state_dict``, ``load_state_dict``, ``set_world``) and an optimizer that can
    rejoin a new world (terrapipe.engine's DistributedOptimizer) or a job of one rank."""

    def __init__(self, model: torch.nn.Module, criterion: Callable, optimizer, train_loader,
                 val_loader=None, *, checkpoint_dir: str | os.PathLike | None = None,
                 amp: bool = False, progress: bool = True, device: str | torch.device = "cpu",
                 amp_dtype: torch.dtype | None = None, elastic: bool = False,
                 commit_every: int = 10) -> None:
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
        if elastic:
            missing = [a for a in ("state_dict", "load_state_dict", "set_world")
                       if not hasattr(train_loader, a)]
            if missing:
                raise ValueError(f"train_loader: elastic=True resumes the epoch at another world size, "
                                 f"which needs {', '.join(missing)} (a terrapipe FastLoader has them)")
            if not isinstance(commit_every, int) or commit_every < 1:
                raise ValueError(f"commit_every must be a positive int, got {commit_every!r}")
        self.elastic = bool(elastic)
        self.commit_every = commit_every
        self._commit = Commit() if elastic else None

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
        epoch, sums = start_epoch, None
        if self.elastic:
            self._take(self._epoch_start_state(start_epoch), start_epoch, state["step"], np.zeros(3))
        while epoch < epochs:
            try:
                self._train_epoch(epoch, state, sums)
                epoch, sums = epoch + 1, None
            except comm.CommError as e:
                if not self.elastic:
                    raise
                epoch, sums = self._rejoin(e, state)
        self._hook("on_end", state)
        return self.history

    def _train_epoch(self, epoch: int, state: dict, sums: np.ndarray | None) -> None:
        """One epoch, from its start (``sums`` None) or from a commit in it (the loader already
        positioned there, ``sums`` its metric sums so far)."""
        state["epoch"] = epoch
        if hasattr(self.train_loader, "set_epoch"):
            self.train_loader.set_epoch(epoch)  # keeps a position load_state_dict set in this epoch
        self.model.train()
        sums = np.zeros(3) if sums is None else sums
        bar = self._bar(len(self.train_loader), f"epoch {epoch}")
        timeline.instant("engine", f"epoch {epoch}")
        began = time.perf_counter()
        batches = iter(self.train_loader)
        try:
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
                if self.elastic and state["step"] % self.commit_every == 0:
                    with timeline.span("engine", "commit"):
                        self._take(self.train_loader.state_dict(), epoch, state["step"], sums)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        finally:
            if bar is not None:
                bar.close()
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        metrics = {"epoch": epoch, **{f"train_{k}": v for k, v in
                                      self._averaged(sums, time.perf_counter() - began).items()}}
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
        if self.elastic:
            self._take(self._epoch_start_state(epoch + 1), epoch + 1, state["step"], np.zeros(3))

    # -- elastic -------------------------------------------------------------------------------
    def _epoch_start_state(self, epoch: int) -> dict:
        """The train loader's state at the start of ``epoch``."""
        loader_state = self.train_loader.state_dict()
        loader_state.update(epoch=epoch, consumed=0, batch=0)
        return loader_state

    def _take(self, loader_state: dict, epoch: int, step: int, sums: np.ndarray) -> None:
        self._commit.take(self.model, self.optimizer, loader_state, epoch, step, sums, self.history)

    def _rejoin(self, error: comm.CommError, state: dict) -> tuple[int, np.ndarray | None]:
        """A collective failed: restore the last commit, join the job's next generation, deal
        the rest of the epoch over it. Returns where to go on: (epoch, its metric sums, or None
        at an epoch's start). Re-raises ``error`` outside an elastic job (nothing to rejoin)."""
        if not comm.is_elastic():
            raise error
        c = self._commit
        print(f"terrapipe.engine: rank {comm.rank()}: {error}; restoring step {c.step} (epoch {c.epoch}) "
              f"and rejoining the job", file=sys.stderr, flush=True)
        c.put_back(self.model, self.optimizer, self.train_loader)
        comm.finalize()
        world = comm.init()
        self.train_loader.set_world(world.rank, world.size)
        rejoin = getattr(self.optimizer, "rejoin", None)
        if rejoin is not None:
            rejoin()
        elif world.size > 1:
            raise RuntimeError("Engine(elastic=True): the optimizer cannot average over the new world "
                               "(use terrapipe.engine.DistributedOptimizer, which can rejoin)")
        # Every survivor restored the same commit (each took it after the same step's reduction
        # completed everywhere); a rank that did not would train on another step from here.
        where = np.array([c.epoch, c.step], np.int64)
        if not (np.array_equal(comm.allreduce(where, "min"), where)
                and np.array_equal(comm.allreduce(where, "max"), where)):
            raise RuntimeError(f"Engine(elastic=True): rank {world.rank} restored epoch {c.epoch} step "
                               f"{c.step}, another rank a different commit")
        self.history = copy.deepcopy(c.history)
        state.update(step=c.step, world_size=world.size)
        self._hook("on_rejoin", state)
        mid_epoch = int(c.loader.get("consumed", 0)) > 0
        return c.epoch, (c.sums.copy() if mid_epoch else None)

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
