"""A Horovod PyTorch training script, unmodified: run it on terrapipe with

    terrapipe run --horovod -np 2 python examples/horovod_train.py

(``--gloo`` to run without MPI). Synthetic data: a small MLP learns a fixed linear map.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

# Each rank reads its own shard of the dataset.
x = torch.randn(2048, 32)
y = x @ torch.randn(32, 4)
shard = torch.utils.data.TensorDataset(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()])
loader = torch.utils.data.DataLoader(shard, batch_size=args.batch_size, shuffle=True)

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
# Horovod's recipe: scale the learning rate by the number of workers.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


for epoch in range(args.epochs):
    total = 0.0
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()
    avg = metric_average(total / len(loader), "avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch} loss {avg:.4f}", flush=True)
