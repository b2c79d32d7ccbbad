"""A plain torch DDP training script; the one change for terrapipe is the backend's name. It does
not import terrapipe: once terrapipe is installed, ``import torch`` registers the backend.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py            # backend="terrapipe"
    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --backend gloo

Synthetic data: an MLP learns a fixed linear map, each rank on its DistributedSampler shard;
rank 0 prints each epoch's mean loss over all ranks. ``--out FILE``: rank 0 saves the trained
weights (tensors only: ``torch.load(FILE, weights_only=True)`` reads them back).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="terrapipe")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out", default=None, help="rank 0 saves the trained state_dict here")
args = parser.parse_args()

dist.init_process_group(args.backend)  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1234)
torch.set_num_threads(1)

x = torch.randn(2048, 32)
y = x @ torch.randn(32, 4)
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    total = torch.zeros(2)
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        total += torch.tensor([loss.item() * len(xb), len(xb)])
    dist.all_reduce(total)
    if rank == 0:
        print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.6f} ({args.backend}, {world} ranks)")

if rank == 0 and args.out:
    torch.save(model.module.state_dict(), args.out)
dist.destroy_process_group()
