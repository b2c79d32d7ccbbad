"""What keeping batches costs: a loop that lets go of each batch against ``list(loader)``.

    python -m benchmarks.kept_batches [--images 2048] [--batch 64] [--size 224] [--workers N]
                                      [--rounds 5]

No GPU needed. Decoded uint8 images (``--size`` square, 3 channels) with a horizontal flip, so
the figures are the batches' memory and the loaders' hand-off, not decoding. Each loader runs
whole epochs in two ways, alternating in every round: a loop that lets go of each batch as the
next arrives (a training loop), and ``list(loader)``, which keeps every batch of the epoch (a
validation loop collecting its inputs):

* fastloader, threads: ``FastLoader(workers="threads")``: a kept batch's slot gets new private
  memory when it comes round again (NOTE [batch buffer ownership] 3 in pipeline/loader.py);
* fastloader, process: ``FastLoader(workers="process")``: the slot moves to a new shared mapping,
  handed to the worker process over its pipe;
* dataloader: ``torch.utils.data.DataLoader(num_workers=N, persistent_workers=True)``, whose
  workers put every batch in new shared memory, kept or not.

Reported per loader and way: the median milliseconds per batch, and kept / let go. The limit a
kept batch meets is the kernel's cost of fresh pages (allocating, zeroing and mapping them), which
the report measures too, per MiB, for private memory and for a mapping in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np
import torch

from terrapipe import FastLoader
from terrapipe.pipeline import ArrayDataset, RandomHorizontalFlip
from terrapipe.pipeline.shared_slots import SharedSlots

from .common import format_table, save

LOADERS = ("fastloader, threads", "fastloader, process", "dataloader")
WAYS = ("let go", "kept")


class _Flipped(torch.utils.data.Dataset):
    """DataLoader's side: the same arrays, flipped with probability 1/2 per sample, as tensors."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        img = self.images[i]
        if torch.rand(()) < 0.5:
            img = img[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), int(self.labels[i])


def _epoch(loader, keep: bool) -> float:
    """Seconds per batch of one epoch of ``loader``, every batch kept (``keep``) or let go."""
    t = time.perf_counter()
    if keep:
        batches = list(loader)
        n = len(batches)
    else:
        n = 0
        for _ in loader:
            n += 1
    seconds = (time.perf_counter() - t) / n
    batches = None  # noqa: F841 (the kept memory goes before the next sample)
    return seconds


def _fresh_pages_ms_per_mib(nbytes: int, shared: bool, repeats: int = 5) -> float:
    """Milliseconds per MiB to get ``nbytes`` of new memory and write it once (the kernel's page
    allocation, zeroing and mapping; the write itself is in it too)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        if shared:
            slots = SharedSlots(nbytes, purpose="the benchmark's mapping")
            slots.unlink()
            a = slots.empty((nbytes,), np.uint8)
        else:
            a = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)  # anonymous: a large np.empty's
        a[:] = 1
        times.append(time.perf_counter() - t)
        del a
    return 1e3 * statistics.median(times) / (nbytes / 2**20)


def run(args) -> dict:
    torch.set_num_threads(1)
    g = np.random.default_rng(0)
    images = g.integers(0, 256, (args.images, args.size, args.size, 3), dtype=np.uint8)
    labels = np.arange(args.images) % 1000
    ds = ArrayDataset(images, labels)
    kw = dict(batch_size=args.batch, shuffle=True, num_threads=args.workers)
    loaders = {
        "fastloader, threads": FastLoader(ds, [RandomHorizontalFlip()], workers="threads", **kw),
        "fastloader, process": FastLoader(ds, [RandomHorizontalFlip()], workers="process", **kw),
        "dataloader": torch.utils.data.DataLoader(
            _Flipped(images, labels), batch_size=args.batch, shuffle=True, num_workers=args.workers,
            persistent_workers=True, prefetch_factor=2),
    }
    for loader in loaders.values():  # warm-up: compilation, worker start-up, both ways
        _epoch(loader, False)
        _epoch(loader, True)
    samples = {(name, way): [] for name in LOADERS for way in WAYS}
    for r in range(args.rounds):
        for name in LOADERS:
            for way in WAYS:
                samples[name, way].append(_epoch(loaders[name], way == "kept"))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{n} {w} {1e3 * samples[n, w][-1]:.1f}" for n in LOADERS for w in WAYS), flush=True)
    for loader in loaders.values():
        if isinstance(loader, FastLoader):
            loader.close()
    batch_bytes = args.batch * args.size * args.size * 3
    pages = {"private": _fresh_pages_ms_per_mib(batch_bytes, False),
             "shared": _fresh_pages_ms_per_mib(batch_bytes, True)}
    summary, rows = {}, []
    for name in LOADERS:
        let_go = 1e3 * statistics.median(samples[name, "let go"])
        kept = 1e3 * statistics.median(samples[name, "kept"])
        ratios = [k / g for k, g in zip(samples[name, "kept"], samples[name, "let go"], strict=True)]
        summary[name] = {"let_go_ms_per_batch": let_go, "kept_ms_per_batch": kept,
                         "kept_over_let_go": statistics.median(ratios)}
        rows.append([name, f"{let_go:.2f}", f"{kept:.2f}", f"{statistics.median(ratios):.2f}"])
    mib = batch_bytes / 2**20
    print(f"\n{args.images} images of {args.size}x{args.size}x3 uint8 per epoch, batches of {args.batch} "
          f"({mib:.1f} MiB), a flip, {args.workers} workers, {args.rounds} rounds")
    print(format_table(["loader", "let go, ms/batch", "kept, ms/batch", "kept / let go (median of rounds)"],
                       rows))
    private, shared = pages["private"], pages["shared"]
    print(f"fresh pages, written once: private {private:.2f} ms/MiB, /dev/shm mapping {shared:.2f} ms/MiB "
          f"(a batch: {private * mib:.1f} / {shared * mib:.1f} ms)")
    return {"images": args.images, "batch": args.batch, "size": args.size, "workers": args.workers,
            "rounds": args.rounds, "batch_mib": mib, "fresh_pages_ms_per_mib": pages,
            "records": [{"loader": n, "way": w, "s_per_batch": samples[n, w]} for n in LOADERS for w in WAYS],
            "summary": summary}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2048, help="images per epoch")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="image side, pixels")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--workers", type=int, default=cores, help="FastLoader threads, DataLoader workers")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    result = run(args)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        x = np.arange(len(LOADERS))
        for k, way in enumerate(WAYS):
            key = "let_go_ms_per_batch" if way == "let go" else "kept_ms_per_batch"
            ax.bar(x + (k - 0.5) * 0.38, [result["summary"][n][key] for n in LOADERS], 0.38, label=way)
        ax.set_xticks(x, LOADERS, fontsize=8)
        ax.set_ylabel("ms per batch")
        ax.legend()
        return fig

    for f in save("kept_batches", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
