"""A DDP worker of tests/distributed/test_torchrun_restarts.py, run by ``torchrun --max-restarts``
on the "terrapipe" backend: 24 steps of an MLP on per-rank synthetic batches, a checkpoint every
6 steps (rank 0 writes it, tensors only; every worker resumes from it at start), and, in
torchrun's first attempt only, rank ``--kill-rank`` SIGKILLs itself after step ``--kill-step``.

Each worker prints one JSON line per start (restart count, the step it resumed from, the
backend's shared-memory group: a new one per attempt) and rank 0 writes the final weights to
``--out``.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--checkpoint", required=True)
p.add_argument("--out", required=True)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
args = p.parse_args()

STEPS, EVERY = 24, 6
dist.init_process_group("terrapipe")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
start = 0
if os.path.exists(args.checkpoint):
    saved = torch.load(args.checkpoint, weights_only=True)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    start = int(saved["step"])
group = dist.group.WORLD
served = getattr(group, "group", None)
record = {"attempt": attempt, "rank": rank, "world": world, "resumed_at": start,
          "segment": served.shm.segment.name if served is not None and served.shm else None}
os.write(1, (json.dumps(record) + "\n").encode())  # one write: the workers share torchrun's stdout
for step in range(start, STEPS):
    g = torch.Generator().manual_seed(1000 * step + rank)  # the same batch for a step, any attempt
    x = torch.randn(32, 16, generator=g)
    y = x.sum(1, keepdim=True)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if attempt == 0 and rank == args.kill_rank and step + 1 == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if (step + 1) % EVERY == 0:
        if rank == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, args.checkpoint)
        dist.barrier()
if rank == 0:
    torch.save(model.module.state_dict(), args.out)
dist.destroy_process_group()
