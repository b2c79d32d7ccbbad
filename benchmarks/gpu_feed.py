"""Feeding a GPU: FastLoader(device="cuda") vs data already on the GPU vs torch DataLoader.

    python -m benchmarks.gpu_feed [--data DIR | --photos DIR] [--model 50] [--batch 128] [--steps 30]
                                  [--threads N] [--rounds 3] [--amp] [--channels-last]

Every case runs the same ResNet training step (SGD, momentum 0.9; bf16 autocast with --amp) on
batches of RandomResizedCrop(224) + flip + normalize of the JPEGs in DIR (generated as in
benchmarks.loader when empty); the cases alternate in every round:

* resident: one batch produced beforehand and kept on the GPU (the ceiling: no input cost);
* fastloader: ``FastLoader(device="cuda")``: pinned uint8 batches, side-stream copies, normalize
  on the GPU; its pool of threads runs in the training process;
* fastloader-process: the same with ``workers="process"``: the pool in a worker process writing
  shared slots that the trainer pins, out of the training process's GIL;
* fastloader-gpu: ``decode="gpu"``: nvJPEG decodes every image and the crop/resize/flip run on
  the GPU; the threads take only what nvJPEG declines;
* fastloader-auto: ``decode="auto"`` with ``workers="process"``: the worker process decodes,
  and the GPU takes the share of each batch by which it falls behind (the share it took is
  reported);
* dataloader: ``torch.utils.data.DataLoader(num_workers=N, pin_memory=True)`` with the
  torchvision-equivalent transforms, then ``.cuda(non_blocking=True)``, as its docs advise.

Reported: img/s (wall clock, after warm-up steps) and the fraction of GPU time spent waiting for
input, from CUDA events: for each step, the gap between the end of the previous step's work and
the point where this step's work could start (its batch copied and its kernels enqueued), over
the span of all steps. Each sample starts with ``--warmup`` untimed steps (default 2 x threads
+ 3: past the DataLoader's prefetch depth, so no case is timed on a stock of batches it built
while another case ran); the loaders run epoch after epoch as a training loop would. Needs a CUDA
device; without one it says so and exits.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop

from .common import endless_epochs, format_table, save
from .data import make_image_folder
from .loader import DEFAULT_DATA, MEAN, STD, _photo_folder, _TorchDataset, _torchvision_transform
from .models import resnet

CASES = ("resident", "fastloader", "fastloader-process", "fastloader-gpu", "fastloader-auto", "dataloader")
COLORS = dict(zip(CASES, ["grey", "tab:blue", "tab:green", "tab:purple", "tab:red", "tab:orange"],
                  strict=True))


def _timed_steps(batches, prepare, step, n_steps: int, warmup: int) -> tuple[float, float]:
    """(img/s, fraction of GPU time waiting for input) over ``n_steps`` after ``warmup``."""
    it = iter(batches)
    for x, y in itertools.islice(it, warmup):
        step(*prepare(x, y))
    torch.cuda.synchronize()  # the benchmark's own boundary; the loader never does this
    ready, done = [], []
    t = time.perf_counter()
    n = 0
    prev = torch.cuda.Event(enable_timing=True)
    prev.record()
    done.append(prev)
    for x, y in itertools.islice(it, n_steps):
        x, y = prepare(x, y)
        r = torch.cuda.Event(enable_timing=True)
        r.record()  # reached once the batch is on the device and the step's kernels follow
        step(x, y)
        d = torch.cuda.Event(enable_timing=True)
        d.record()
        ready.append(r)
        done.append(d)
        n += x.shape[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    waited = sum(done[k].elapsed_time(ready[k]) for k in range(len(ready)))
    span = done[0].elapsed_time(done[-1])
    return n / seconds, waited / span if span > 0 else 0.0


def run(args) -> dict:
    device = torch.device("cuda")
    if args.photos is not None:
        args.data = _photo_folder(args.photos)
    else:
        make_image_folder(args.data, args.images)
    ds = ImageFolder(args.data)
    if len(ds) < args.batch:
        raise SystemExit(f"--data has {len(ds)} images, fewer than one batch of {args.batch}")
    model, model_src = resnet(args.model)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def prepare(x, y):
        # The DataLoader's host->device copy (a no-op for the other cases) counts as input time.
        return x.to(device, non_blocking=True, memory_format=fmt), y.to(device, non_blocking=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    transforms = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    cases = [c for c in CASES if c in args.cases]
    kw = dict(batch_size=args.batch, shuffle=True, num_threads=args.threads, device=device,
              channels_last=args.channels_last)
    fast = FastLoader(ds, transforms, **kw)
    isolated = FastLoader(ds, transforms, workers="process", **kw) if "fastloader-process" in cases else None
    on_gpu = FastLoader(ds, transforms, decode="gpu", **kw) if "fastloader-gpu" in cases else None
    auto = (FastLoader(ds, transforms, decode="auto", workers="process", **kw) if "fastloader-auto" in cases
            else None)
    transform, baseline_kind = _torchvision_transform()
    dl = torch.utils.data.DataLoader(_TorchDataset(ds.samples, transform), batch_size=args.batch,
                                     shuffle=True, num_workers=args.threads, pin_memory=True,
                                     persistent_workers=True, prefetch_factor=2)
    x0, y0 = next(iter(fast))
    resident = (x0.clone(), y0.clone())

    def make(case, r):
        if case == "resident":
            return itertools.repeat(resident)
        loader = {"fastloader": fast, "fastloader-process": isolated, "fastloader-gpu": on_gpu,
                  "fastloader-auto": auto, "dataloader": dl}[case]
        return endless_epochs(loader, 1000 * r)

    samples: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases:
            rate, wait = _timed_steps(make(case, r), prepare, step, args.steps, args.warmup)
            samples[case].append((rate, wait))
            print(f"round {r + 1}/{args.rounds} {case:10s} {rate:7.0f} img/s  GPU waiting {100 * wait:5.1f}%",
                  flush=True)
    share = auto.gpu_share if auto is not None else None
    for loader in (fast, isolated, on_gpu, auto):
        if loader is not None:
            loader.close()

    med = {c: statistics.median(s[0] for s in samples[c]) for c in cases}
    wait = {c: statistics.median(s[1] for s in samples[c]) for c in cases}
    rows = [[c, med[c], f"{100 * wait[c]:.1f}%", f"{med[c] / med['resident']:.3f}",
             f"{med['fastloader'] / med[c]:.2f}x"] for c in cases]
    print()
    print(f"{torch.cuda.get_device_name(device)}; ResNet-{args.model} ({model_src}), batch {args.batch}, "
          f"{args.steps} timed steps x {args.rounds} rounds, {args.threads} threads/workers, "
          f"amp={args.amp}, channels_last={args.channels_last}; baseline transforms: {baseline_kind}")
    if share is not None:
        print(f"decode='auto': the GPU decoded {100 * share:.1f}% of the rows")
    print(format_table(["case", "img/s median", "GPU waiting", "of resident", "fast/this"], rows))
    return {"gpu": torch.cuda.get_device_name(device), "model": f"resnet{args.model}", "batch": args.batch,
            "threads": args.threads, "amp": args.amp, "channels_last": args.channels_last,
            "baseline": baseline_kind, "auto_gpu_share": share,
            "records": [{"case": c, "img_per_s": [s[0] for s in samples[c]],
                         "gpu_wait_fraction": [s[1] for s in samples[c]], "median": med[c]} for c in cases]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--photos", type=Path, default=None, help="real photographs (see benchmarks.loader)")
    p.add_argument("--images", type=int, default=3000, help="images to generate if --data is empty")
    p.add_argument("--model", type=int, default=50, choices=(18, 50), help="ResNet depth")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per sample (default: 2 x threads + 3, the DataLoader's "
                        "prefetch depth and then some, so no case is timed on a stock of batches "
                        "it built while another case ran)")
    p.add_argument("--rounds", type=int, default=3)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--threads", type=int, default=cores)
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES,
                   help="cases to run (resident and fastloader always run: the ratios need them)")
    args = p.parse_args(argv)
    args.cases = sorted({*args.cases, "resident", "fastloader"}, key=CASES.index)
    if args.warmup is None:
        args.warmup = 2 * args.threads + 3
    if not torch.cuda.is_available():
        print("benchmarks.gpu_feed: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing measured", file=sys.stderr)
        return
    result = run(args)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        cases = [r["case"] for r in result["records"]]
        ax.bar(cases, [r["median"] for r in result["records"]],
               color=[COLORS[c] for c in cases])
        ax.set_ylabel("images / s")
        ax.set_title(f"{result['model']} on {result['gpu']}")
        return fig

    for f in save("gpu_feed", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
