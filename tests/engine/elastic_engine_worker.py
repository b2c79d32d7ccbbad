"""A worker of tests/engine/test_engine_elastic.py, run by ``terrapipe run -np N --min-np ...``:
Engine(elastic=True, commit_every=3) trains a linear classifier on 480 generated 8x8 images
(class c: rows 2c and 2c + 1 bright) read by a FastLoader, whose labels are the sample indices
(the criterion maps them to the class), so every batch says which samples it trained on.

After each step every rank prints one JSON line (generation, epoch, step, rank, world size, the
batch's sample indices, the loss); ``--kill-rank R --kill-step S``: rank R SIGKILLs itself after
step S in the first generation. Rank 0 ends with ``{"final": loss over every sample}``.
"""

import argparse
import json
import os
import signal
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import terrapipe.comm as comm
from terrapipe import FastLoader
from terrapipe.comm import rendezvous
from terrapipe.engine import DistributedOptimizer, Engine, broadcast_parameters
from terrapipe.pipeline import ArrayDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
args = p.parse_args()

N = 480
world = comm.init()
rng = np.random.default_rng(0)
classes = np.arange(N) % 4
images = rng.integers(0, 60, (N, 8, 8, 3)).astype(np.uint8)
for c in range(4):  # class c: rows 2c and 2c + 1 bright
    images[classes == c, 2 * c:2 * c + 2] += 150
loader = FastLoader(ArrayDataset(images, np.arange(N)), batch_size=8, shuffle=True, seed=5, num_threads=1,
                    rank=world.rank, world_size=world.size)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
broadcast_parameters(model)
labels = torch.from_numpy(classes)


class Floats(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.float() / 255)


def emit(record: dict) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())  # one write: the ranks share stdout


def on_update(state):
    emit({"generation": rendezvous.last_generation(), "epoch": state["epoch"], "step": state["step"],
          "rank": comm.rank(), "size": comm.size(), "indices": state["sample"][1].tolist(),
          "loss": float(state["loss"].detach()), "t": time.time()})
    first = rendezvous.last_generation() == 1
    if state["step"] == args.kill_step and comm.rank() == args.kill_rank and first:
        os.kill(os.getpid(), signal.SIGKILL)


engine = Engine(Floats(model), lambda out, idx: F.cross_entropy(out, labels[idx]), optimizer, loader,
                progress=False, elastic=True, commit_every=3)
engine.hooks["on_update"] = on_update
engine.train(args.epochs)
if comm.rank() == 0:
    with torch.no_grad():
        x = torch.from_numpy(images).permute(0, 3, 1, 2)
        emit({"final": F.cross_entropy(Floats(model)(x), labels).item()})
loader.close()
