"""An epoch's first batch: how long a training loop waits for it, against the batches inside.

    python -m benchmarks.epoch_start --photos DIR [--images 256] [--batch 128] [--threads N]
                                     [--step-ms 600] [--epochs 4] [--rounds 3]

No GPU needed. The "training step" sleeps ``--step-ms`` per batch (it releases the GIL, as a
GPU step does), longer than any loader here needs for a batch, so inside an epoch a loader that
keeps ahead is never waited for; what remains is the wait at each epoch's start. Epochs of
``--images`` real photographs (the first ones of DIR) in batches of ``--batch``, RandomResizedCrop
(224) + flip + normalize on ``--threads`` workers. The cases alternate in every round, each
``--epochs`` timed epochs per sample after one untimed epoch that starts the sample (each sample
starts from an empty pipeline: ``FastLoader.cancel_ahead()`` after the one before):

* fastloader: ``FastLoader``, ``set_epoch(e)`` for consecutive e, as a training loop calls it:
  the loader begins the next epoch's first batches while the consumer works through the last
  ones of this epoch (NOTE [the next epoch's first batches] in pipeline/loader.py);
* fastloader, epochs apart: the same loader type with ``set_epoch(2 e)``, a sequence it does not
  guess: every epoch starts with an empty pipeline (how FastLoader ran before);
* dataloader: ``torch.utils.data.DataLoader(num_workers=N, persistent_workers=True,
  prefetch_factor=2)`` with the torchvision-equivalent transforms.

Reported per case: the median wait for an epoch's first batch and for the others, the share of
the wall time spent waiting, and img/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop

from .common import format_table, save
from .loader import MEAN, STD, _TorchDataset, _torchvision_transform

CASES = ("fastloader", "fastloader, epochs apart", "dataloader")


def _first_photos(photos: Path, n: int) -> Path:
    """The first ``n`` JPEGs of ``photos`` (searched recursively), as one class folder of links."""
    files = sorted(p for p in photos.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:n]
    if len(files) < n:
        raise SystemExit(f"--photos {photos} holds {len(files)} JPEGs, fewer than --images {n}")
    out = Path(__file__).resolve().parent / "data_cache" / f"epoch-start-{photos.name}-{n}" / "photos"
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    return out.parent


def _sample(loader, epochs: list[int], step_s: float) -> dict:
    """``epochs`` of ``loader`` with a step of ``step_s`` after each batch: the waits, from the
    second epoch on (the first starts the sample, from an empty pipeline)."""
    first, rest = [], []
    images = 0
    start = None
    for k, e in enumerate(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        t = time.perf_counter()
        for i, (x, _) in enumerate(loader):
            if k:
                (first if i == 0 else rest).append(time.perf_counter() - t)
                images += x.shape[0]
            time.sleep(step_s)
            t = time.perf_counter()
        if k == 0:
            start = time.perf_counter()
    wall = time.perf_counter() - start
    if isinstance(loader, FastLoader):
        loader.cancel_ahead()  # nothing decoded while another case is timed
    return {"first_s": first, "rest_s": rest, "waiting": (sum(first) + sum(rest)) / wall,
            "img_per_s": images / wall}


def run(args) -> dict:
    torch.set_num_threads(1)
    data = _first_photos(args.photos, args.images)
    ds = ImageFolder(data)
    transforms = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    kw = dict(batch_size=args.batch, shuffle=True, num_threads=args.threads)
    transform, baseline_kind = _torchvision_transform()
    loaders = {
        "fastloader": FastLoader(ds, transforms, **kw),
        "fastloader, epochs apart": FastLoader(ds, transforms, **kw),
        "dataloader": torch.utils.data.DataLoader(
            _TorchDataset(ds.samples, transform), batch_size=args.batch, shuffle=True,
            num_workers=args.threads, persistent_workers=True, prefetch_factor=2),
    }
    stride = {"fastloader": 1, "fastloader, epochs apart": 2, "dataloader": 1}
    next_epoch = dict.fromkeys(CASES, 0)
    step_s = args.step_ms / 1e3

    def epochs(case: str, n: int) -> list[int]:
        got = [next_epoch[case] + stride[case] * k for k in range(n)]
        next_epoch[case] = got[-1] + stride[case]
        return got

    for case in CASES:  # warm-up: compilation, worker start-up
        _sample(loaders[case], epochs(case, 2), step_s)
    samples: dict[str, list[dict]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for case in CASES:
            got = _sample(loaders[case], epochs(case, args.epochs + 1), step_s)
            samples[case].append(got)
            first_ms = 1e3 * statistics.median(got["first_s"])
            rest_ms = 1e3 * statistics.median(got["rest_s"])
            print(f"round {r + 1}/{args.rounds} {case:26s} first batch {first_ms:7.1f} ms  "
                  f"others {rest_ms:6.1f} ms  waiting {got['waiting']:5.1%}", flush=True)
    for loader in loaders.values():
        if isinstance(loader, FastLoader):
            loader.close()
    summary = {}
    rows = []
    for case in CASES:
        first = [w for s in samples[case] for w in s["first_s"]]
        rest = [w for s in samples[case] for w in s["rest_s"]]
        summary[case] = {"first_batch_ms": 1e3 * statistics.median(first),
                         "other_batches_ms": 1e3 * statistics.median(rest),
                         "waiting": statistics.median(s["waiting"] for s in samples[case]),
                         "img_per_s": statistics.median(s["img_per_s"] for s in samples[case])}
        v = summary[case]
        rows.append([case, f"{v['first_batch_ms']:.1f}", f"{v['other_batches_ms']:.1f}",
                     f"{v['waiting']:.1%}", f"{v['img_per_s']:.0f}"])
    per_epoch = -(-args.images // args.batch)
    print(f"\n{args.images} photographs per epoch ({per_epoch} batches of {args.batch}), a step of "
          f"{args.step_ms:.0f} ms per batch, {args.threads} workers, {args.epochs} epochs x "
          f"{args.rounds} rounds; baseline transforms: {baseline_kind}")
    print(format_table(["case", "wait, epoch's first batch ms", "wait, other batches ms",
                        "of the time waiting", "img/s"], rows))
    return {"images": args.images, "batch": args.batch, "threads": args.threads, "step_ms": args.step_ms,
            "epochs": args.epochs, "data": str(args.photos), "real_photographs": True,
            "baseline": baseline_kind, "records": [{"case": c, "samples": samples[c]} for c in CASES],
            "summary": summary}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=Path, required=True, help="a folder of real photographs (JPEG)")
    p.add_argument("--images", type=int, default=256, help="photographs per epoch")
    p.add_argument("--batch", type=int, default=128)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--threads", type=int, default=cores)
    p.add_argument("--step-ms", type=float, default=600.0, help="the training step, per batch")
    p.add_argument("--epochs", type=int, default=4, help="epochs per timed sample")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result = run(args)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(CASES, [result["summary"][c]["first_batch_ms"] for c in CASES], color="tab:red")
        ax.set_ylabel("wait for an epoch's first batch, ms")
        ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        return fig

    for f in save("epoch_start", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
