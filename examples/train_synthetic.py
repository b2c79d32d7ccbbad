"""Train a small convnet on a generated, learnable image folder with FastLoader + Engine.

    python examples/train_synthetic.py [--data DIR] [--epochs 3] [--per-class 300]
    terrapipe run -n 2 python examples/train_synthetic.py

Each of the 4 classes is a kind of picture (a colour and a shape on a textured background), so
accuracy should climb far above chance (25%) within a few epochs. Rank 0 generates the data;
every rank reads its own shard of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn

import terrapipe.comm as comm
from terrapipe import FastLoader
from terrapipe.engine import DistributedOptimizer, Engine, broadcast_parameters
from terrapipe.pipeline import CenterCrop, ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop

COLOURS = [(220, 40, 40), (40, 200, 60), (40, 80, 230), (230, 200, 30)]


def make_folder(root: Path, per_class: int, seed: int) -> None:
    g = np.random.default_rng(seed)
    for c, colour in enumerate(COLOURS):
        d = root / f"class_{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = d / f"{i:04d}.jpg"
            if path.exists():
                continue
            bg = g.integers(60, 190, 3)
            img = np.clip(bg + g.normal(0, 25, (64, 64, 3)), 0, 255).astype(np.uint8)
            pil = Image.fromarray(img)
            draw = ImageDraw.Draw(pil)
            x, y, r = g.integers(16, 48), g.integers(16, 48), g.integers(10, 16)
            shade = tuple(int(v) for v in np.clip(np.array(colour) + g.integers(-25, 25, 3), 0, 255))
            (draw.ellipse if c % 2 == 0 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=shade)
            pil.save(path, quality=90)


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, len(COLOURS)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("examples/data/synthetic"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--per-class", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoints", type=Path, default=None)
    args = p.parse_args(argv)

    comm.init()
    if comm.rank() == 0:
        make_folder(args.data / "train", args.per_class, seed=0)
        make_folder(args.data / "val", max(args.per_class // 4, 8), seed=1)
    comm.barrier()
    torch.manual_seed(0)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    augment = [RandomResizedCrop(32, scale=(0.5, 1.0)), RandomHorizontalFlip(), Normalize(mean, std)]
    train = FastLoader(ImageFolder(args.data / "train"), augment, batch_size=args.batch_size,
                       shuffle=True, seed=0)
    val = FastLoader(ImageFolder(args.data / "val"), [CenterCrop(64), Normalize(mean, std)],
                     batch_size=64)
    model = net()
    broadcast_parameters(model, root=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    engine = Engine(model, nn.functional.cross_entropy, opt, train, val, checkpoint_dir=args.checkpoints)
    history = engine.train(args.epochs)
    if comm.rank() == 0:
        for m in history:
            print(f"epoch {m['epoch']}: train loss {m['train_loss']:.3f} acc {m['train_accuracy']:.3f} "
                  f"({m['train_img_per_s']:.0f} img/s over {comm.size()} ranks) | "
                  f"val loss {m['val_loss']:.3f} acc {m['val_accuracy']:.3f}", flush=True)
    train.close()
    val.close()
    return history[-1] if history else {}


if __name__ == "__main__":
    main()
