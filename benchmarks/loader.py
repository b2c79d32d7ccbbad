"""FastLoader vs torch DataLoader (+ Pillow transforms) vs decode alone, on the same JPEGs.

    python -m benchmarks.loader [--data DIR] [--images N] [--batch 256] [--batches B] [--rounds 3]

If DIR has no images, an ImageNet-like set is generated there first (benchmarks/data.py). Every
case is warmed up once (compilation, worker start-up). Then each round runs every case at every
thread count, interleaved: a sample is ``--batches`` batches from a fresh iterator, timed from
an empty pipeline, so no case is credited with batches it prefetched while another case ran.
A DataLoader builds each batch in one worker, so it needs several batches per worker to reach
its steady rate: the default ``--batches`` is 4 x the largest thread count (at least 6). The
report gives the median img/s per case and the ratios FastLoader / DataLoader and FastLoader /
decode-only at the same thread count.

Cases, all producing float32 NCHW 224x224 normalized batches from the same files:
* fastloader: RandomResizedCrop(224) + RandomHorizontalFlip + Normalize, ``num_threads=N``;
* dataloader: ``torch.utils.data.DataLoader(num_workers=N)`` with the torchvision-equivalent
  chain (torchvision's transforms if importable, else the same steps on Pillow + torch);
* decode: Pillow decoding each file at full resolution on N threads, nothing else (the ceiling:
  no crop, resize, copy or collation).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop

from .common import format_table, save
from .data import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEFAULT_DATA = Path(__file__).resolve().parent / "data_cache" / "imagenet_like"


def _torchvision_transform():
    try:
        from torchvision import transforms as T

        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(MEAN, STD)]), "torchvision"
    except Exception:
        return _PillowChain(), "pillow+torch"


class _PillowChain:
    """torchvision's RandomResizedCrop + flip + ToTensor + Normalize, step for step."""

    def __init__(self) -> None:
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __call__(self, im: Image.Image) -> torch.Tensor:
        w, h = im.size
        area = w * h
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                i, j = random.randint(0, h - ch), random.randint(0, w - cw)
                break
        else:
            cw, ch, i, j = w, h, 0, 0
        im = im.resize((224, 224), Image.BILINEAR, box=(j, i, j + cw, i + ch))
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std


class _TorchDataset(torch.utils.data.Dataset):
    def __init__(self, samples, transform) -> None:
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as im:
            return self.transform(im.convert("RGB")), label


def _rate(batches, n_batches: int) -> float:
    it = iter(batches)
    # Timed from after iter(): a persistent DataLoader's iter() first drains the batches its
    # workers still had queued from the previous pass, which is not this pass's work.
    t = time.perf_counter()
    n = 0
    for x, _ in itertools.islice(it, n_batches):
        n += x.shape[0]
    return n / (time.perf_counter() - t)


def run(data: Path, images: int, batch: int, n_batches: int, rounds: int, threads: list[int]) -> dict:
    make_image_folder(data, images)
    ds = ImageFolder(data)
    files = [p for p, _ in ds.samples]
    transform, baseline_kind = _torchvision_transform()
    tds = _TorchDataset(ds.samples, transform)
    need = n_batches * batch
    if len(ds) < need:
        raise SystemExit(f"--data has {len(ds)} images; {need} needed for --batches {n_batches}")

    loaders, dls, pools = {}, {}, {}
    for n in threads:
        loaders[n] = FastLoader(ds, [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)],
                                batch_size=batch, shuffle=True, num_threads=n, prefetch=3)
        dls[n] = torch.utils.data.DataLoader(tds, batch_size=batch, shuffle=True, num_workers=n,
                                             persistent_workers=True, prefetch_factor=2)
        pools[n] = ThreadPoolExecutor(n)

    def decode_batches(n):
        def one(path):
            # Decode only: full-resolution pixels into Pillow's memory, no copy, no transform.
            with Image.open(path) as im:
                im.load()
                return im.size

        order = list(range(len(files)))
        random.shuffle(order)
        for b in range(len(order) // batch):
            arrs = list(pools[n].map(one, [files[i] for i in order[b * batch:(b + 1) * batch]]))
            yield torch.empty(len(arrs)), None

    def cases(n):
        return (("fastloader", lambda: loaders[n]), ("dataloader", lambda: dls[n]),
                ("decode", lambda: decode_batches(n)))

    for n in threads:
        for _, make in cases(n):
            _rate(make(), 1)  # warm-up, untimed
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for n in threads:
            for case, make in cases(n):
                if case == "fastloader":
                    loaders[n].set_epoch(r)
                rate = _rate(make(), n_batches)
                samples.setdefault((case, n), []).append(rate)
                print(f"round {r + 1}/{rounds} threads={n} {case:10s} {rate:7.0f} img/s", flush=True)
    for n in threads:
        loaders[n].close()
        pools[n].shutdown()
        del dls[n]

    rows, records = [], []
    for n in threads:
        med = {c: statistics.median(samples[(c, n)]) for c in ("fastloader", "dataloader", "decode")}
        for c in ("fastloader", "dataloader", "decode"):
            s = samples[(c, n)]
            rows.append([c, n, med[c], min(s), max(s),
                         f"{med['fastloader'] / med['dataloader']:.2f}x" if c == "dataloader" else "",
                         f"{100 * med['fastloader'] / med['decode']:.0f}%" if c == "decode" else ""])
            records.append({"case": c, "threads": n, "img_per_s": s, "median": med[c]})
    print()
    print(f"{len(ds)} JPEGs in {data}, batch {batch}, {n_batches} timed batches per sample, "
          f"{rounds} interleaved rounds; baseline transforms: {baseline_kind}")
    print(format_table(["case", "threads", "img/s median", "min", "max", "fast/this", "fast/decode"], rows))
    return {"data": str(data), "images": len(ds), "batch": batch, "batches": n_batches,
            "baseline": baseline_kind, "records": records, "threads": threads}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--images", type=int, default=None,
                   help="images to generate if --data is empty (default: enough for --batches, >= 3000)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=None, help="timed batches per sample")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help="thread counts (default: 1 .. cores available)")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or sorted({1, cores})
    batches = args.batches or max(6, 4 * max(threads))
    images = args.images or max(3000, batches * args.batch)
    result = run(args.data, images, args.batch, batches, args.rounds, threads)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for case in ("decode", "fastloader", "dataloader"):
            ys = [next(r["median"] for r in result["records"] if r["case"] == case and r["threads"] == n)
                  for n in threads]
            ax.plot(threads, ys, marker="o", label=case)
        ax.set_xlabel("threads / workers")
        ax.set_ylabel("images / s")
        ax.set_xticks(threads)
        ax.legend()
        ax.grid(alpha=0.3)
        return fig

    for f in save("loader", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
