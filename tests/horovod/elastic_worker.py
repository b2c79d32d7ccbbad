"""A worker of the elastic tests (tests/horovod/test_elastic_job.py), run under
``terrapipe run --horovod --min-np ...``: a linear model trained with hvd.elastic on 256
samples, an ElasticSampler and a commit after every batch.

Before each commit every rank prints one JSON line: generation, epoch, step, rank, size, the
batch's sample indices and the loss. ``--kill-rank R --kill-step S``: rank R SIGKILLs itself
right after printing step S, in the first generation only. ``--sleep T``: seconds per step
(time for the test to change the hosts mid-run). ``--hang-step S``: every rank sleeps for
ten minutes after printing step S, touching neither its peers nor the launcher. Ends with a
line ``{"final": loss}``: the model's loss on every sample. Each step's line also names the
addresses this process holds TCP connections to (``peers``), so a test sees connections of a
lost generation that were never closed.
"""

import argparse
import json
import os
import signal
import socket
import struct
import time

import horovod.torch as hvd
import torch

import terrapipe.comm as comm
from terrapipe.comm import rendezvous

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--hang-step", type=int, default=-1)
args = p.parse_args()


def emit(record: dict) -> None:
    """One line in one write: the workers share the launcher's stdout (a pipe, where a write of
    less than PIPE_BUF bytes is never interleaved with another)."""
    os.write(1, (json.dumps(record) + "\n").encode())


def tcp_peers() -> list[str]:
    """The remote addresses of this process's TCP sockets (from /proc: its fds' socket inodes
    in its network namespace's table)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    peers = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ip = socket.inet_ntoa(struct.pack("<I", int(fields[2].split(":")[0], 16)))
                if ip != "0.0.0.0":
                    peers.add(ip)
    return sorted(peers)


BATCH = 8
hvd.init()
torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X @ torch.randn(8, 1)
data = torch.utils.data.TensorDataset(torch.arange(256), X, Y)
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02 * hvd.size()),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)


def scale_lr() -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.02 * hvd.size()


state.register_reset_callbacks([scale_lr])


@hvd.elastic.run
def train(state):
    for epoch in range(state.epoch, args.epochs):
        state.epoch = epoch
        for i, (idx, x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            state.step += 1
            sampler.record_batch(i, BATCH)
            emit({"generation": rendezvous.last_generation(), "epoch": state.epoch, "step": state.step,
                  "rank": hvd.rank(), "size": hvd.size(), "indices": idx.tolist(), "loss": loss.item(),
                  "t": time.time(), "local_size": hvd.local_size(),
                  "tiered": comm.world().cross is not None,  # NOTE [machines over Gloo]
                  "peers": tcp_peers()})
            if (state.step == args.kill_step and hvd.rank() == args.kill_rank
                    and rendezvous.last_generation() == 1):
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == args.hang_step:
                time.sleep(600)
            time.sleep(args.sleep)
            state.commit()
        sampler.set_epoch(state.epoch + 1)


train(state)
with torch.no_grad():
    emit({"final": torch.nn.functional.mse_loss(model(X), Y).item(), "rank": hvd.rank()})
