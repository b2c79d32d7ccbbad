"""Decoding on the GPU: how far its pixels are from the CPU path's, and how fast each decode
feeds a GPU with nothing else running.

    python -m benchmarks.gpu_decode [--data DIR | --photos DIR] [--threads 4 16] [--batch 128]
                                    [--batches 12] [--rounds 3] [--size 224]

1. Tolerance: one pass over the images (RandomResizedCrop(size) + flip, uint8 out, same seed)
   with ``decode="cpu"`` and with ``decode="gpu"``: the same crops and flips, so the difference
   is the decoder's (nvJPEG against libjpeg-turbo, and no DCT-scaled decode on the GPU) and the
   resampling's rounding. Reported: mean absolute difference, its 99th and 99.9th percentiles,
   the largest one, the largest mean over one image, and the share of pixels more than 8 apart.
2. Where the GPU decode thread's time goes, per batch: reading the files, nvJPEG, the
   resampling (float16, as the loader runs it, and float32): the time to issue the phase (the
   calling thread's), the time until the GPU has finished it, both with the GPU otherwise idle;
   then the phase again beside a probe thread running tiny torch operations back to back (as
   the thread launching a model's kernels does): the phase's time there, and how long the
   probe waited more than 200 us for its next operation (the GIL held, or handed over late).
3. Throughput: ``FastLoader(device="cuda", workers="process")`` alone (its batches consumed on
   the GPU, no training), ``decode="cpu"`` / ``"gpu"`` / ``"auto"`` at each ``--threads``, the
   cases alternating round by round; img/s, the median over rounds, and the share of rows
   ``"auto"`` gave the GPU. Needs a CUDA device; without one it says so and exits.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, RandomHorizontalFlip, RandomResizedCrop
from terrapipe.pipeline.device_resample import resample_into
from terrapipe.pipeline.gpu_decode import nvjpeg_decoder
from terrapipe.pipeline.transforms import compile_plan

from .common import endless_epochs, format_table, save
from .data import make_image_folder
from .loader import DEFAULT_DATA, _photo_folder

DECODES = ("cpu", "gpu", "auto")


def tolerance(ds, size: int, batch: int) -> dict:
    tf = [RandomResizedCrop(size), RandomHorizontalFlip()]
    kw = dict(batch_size=batch, seed=7, device="cuda")
    diffs, per_image = [], []
    with FastLoader(ds, tf, **kw) as cpu, FastLoader(ds, tf, decode="gpu", **kw) as gpu:
        for (a, ya), (b, yb) in zip(cpu, gpu, strict=True):
            if not torch.equal(ya, yb):
                raise SystemExit("decode='gpu' yielded other labels than decode='cpu'")
            d = (a.int() - b.int()).abs()
            per_image.append(d.float().mean(dim=(1, 2, 3)).cpu())
            diffs.append(torch.bincount(d.flatten(), minlength=256).cpu())
    hist = torch.stack(diffs).sum(0).double()
    total = hist.sum()
    cdf = torch.cumsum(hist, 0) / total

    def pct(q):
        return int(torch.searchsorted(cdf, torch.tensor(q, dtype=torch.float64)))

    return {"images": len(ds), "pixels": int(total),
            "mean_abs": float((hist * torch.arange(256)).sum() / total),
            "p99": pct(0.99), "p999": pct(0.999), "max": int(torch.nonzero(hist)[-1]),
            "worst_image_mean": float(torch.cat(per_image).max()),
            "share_over_8": float(hist[9:].sum() / total)}


class _Probe:
    """A thread running tiny torch operations back to back while ``on``; ``held()`` is the
    time it spent waiting more than 200 us for its next one since the last call."""

    def __init__(self) -> None:
        self._stall = 0.0
        self._stop = False
        self.on = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.on.wait()
            last = time.perf_counter()
            while self.on.is_set() and not self._stop:
                torch.empty(1)
                now = time.perf_counter()
                if now - last > 200e-6:
                    self._stall += now - last
                last = now

    def held(self) -> float:
        s, self._stall = self._stall, 0.0
        return s

    def close(self) -> None:
        self._stop = True
        self.on.set()
        self._thread.join()


def profile(ds, size: int, batch: int, batches: int) -> dict:
    dev = torch.device("cuda")
    decode = nvjpeg_decoder(dev)
    plan = compile_plan([RandomResizedCrop(size), RandomHorizontalFlip()], 3)
    out = torch.empty((batch, 3, size, size), dtype=torch.uint8, device=dev)
    phases = ("read", "nvjpeg", "resample float16", "resample float32")
    keys = ("issue_ms", "done_ms", "beside_probe_ms", "probe_held_ms")
    got: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in phases}
    probe = _Probe()
    try:
        for b in range(batches + 1):  # the first batch warms up and is not counted
            idx = [(b * batch + k) % len(ds) for k in range(batch)]
            timings = {}

            def phase(name, fn, timings=timings):
                torch.cuda.synchronize()
                t = time.perf_counter()
                result = fn()
                issued = time.perf_counter() - t
                torch.cuda.synchronize()
                done = time.perf_counter() - t
                probe.on.set()  # again, beside the probe
                time.sleep(0.002)
                probe.held()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                beside = time.perf_counter() - t
                held = probe.held()
                probe.on.clear()
                timings[name] = (issued * 1e3, done * 1e3, beside * 1e3, held * 1e3)
                return result

            def read(idx=idx):  # as the GPU decode thread reads a batch
                payloads = [ds.read(i)[0] for i in idx]
                flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
                return list(torch.split(flat, [len(p) for p in payloads]))

            data = phase("read", read)
            images = phase("nvjpeg", lambda data=data: list(decode(data)))
            boxes = np.array([plan.box(im.shape[2], im.shape[1], 0, b, i)
                              for im, i in zip(images, idx, strict=True)])
            flips = np.array([plan.flip(0, b, i) for i in idx])
            for dtype, name in ((torch.float16, "resample float16"), (torch.float32, "resample float32")):
                phase(name, lambda dtype=dtype, images=images, boxes=boxes, flips=flips:
                      resample_into(images, boxes, flips, out, dtype=dtype))
            if b:
                for name, values in timings.items():
                    for k, v in zip(keys, values, strict=True):
                        got[name][k].append(v)
    finally:
        probe.close()
    return {p: {k: statistics.median(v) for k, v in got[p].items()} for p in phases}


def throughput(ds, size: int, batch: int, threads: int, batches: int, rounds: int) -> dict:
    tf = [RandomResizedCrop(size), RandomHorizontalFlip()]
    loaders = {d: FastLoader(ds, tf, batch_size=batch, shuffle=True, num_threads=threads, device="cuda",
                             decode=d, workers="process") for d in DECODES}
    rates: dict[str, list[float]] = {d: [] for d in DECODES}
    try:
        for r in range(rounds):
            for d, loader in loaders.items():
                it = endless_epochs(loader, 1000 * r)
                for x, _ in itertools.islice(it, 3):  # warm-up: threads, nvJPEG, the first epoch's start
                    x.float().mean()
                torch.cuda.synchronize()
                t = time.perf_counter()
                n = 0
                for x, _ in itertools.islice(it, batches):
                    x.float().mean()  # consumed on the device, as a training step would
                    n += x.shape[0]
                torch.cuda.synchronize()
                rates[d].append(n / (time.perf_counter() - t))
                print(f"threads {threads} round {r + 1}/{rounds} decode={d:4s} {rates[d][-1]:7.0f} img/s",
                      flush=True)
        share = loaders["auto"].gpu_share
    finally:
        for loader in loaders.values():
            loader.close()
    median = {d: statistics.median(v) for d, v in rates.items()}
    return {"threads": threads, "img_per_s": rates, "median": median, "auto_gpu_share": share}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--photos", type=Path, default=None, help="real photographs (see benchmarks.loader)")
    p.add_argument("--images", type=int, default=3000, help="images to generate if --data is empty")
    p.add_argument("--threads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu_decode: no CUDA device here (torch.cuda.is_available() is False); nothing "
              "measured", file=sys.stderr)
        return
    if args.photos is not None:
        data = _photo_folder(args.photos)
    else:
        make_image_folder(args.data, args.images)
        data = args.data
    ds = ImageFolder(data)
    tol = tolerance(ds, args.size, args.batch)
    print(f"\n{torch.cuda.get_device_name()}: decode='gpu' against decode='cpu' over {tol['images']} images "
          f"({'photographs' if args.photos else 'generated'}), RandomResizedCrop({args.size}) + flip, uint8")
    print(format_table(["mean |diff|", "p99", "p99.9", "max", "worst image (mean)", "pixels > 8 apart"],
                       [[f"{tol['mean_abs']:.2f}", tol["p99"], tol["p999"], tol["max"],
                         f"{tol['worst_image_mean']:.2f}", f"{100 * tol['share_over_8']:.2f}%"]]))
    prof = profile(ds, args.size, args.batch, args.batches)
    print(f"\nthe GPU decode thread's work per batch of {args.batch} (median of {args.batches} batches)")
    print(format_table(["phase", "issued, ms", "done, ms", "beside the probe, ms", "probe held up, ms"],
                       [[p, *(f"{v[k]:.2f}" for k in v)] for p, v in prof.items()]))
    runs = [throughput(ds, args.size, args.batch, t, args.batches, args.rounds) for t in args.threads]
    rows = [[r["threads"], *(f"{r['median'][d]:.0f}" for d in DECODES), f"{100 * r['auto_gpu_share']:.0f}%"]
            for r in runs]
    print(f"\nthe loader alone, img/s (median of {args.rounds} rounds of {args.batches} batches of "
          f"{args.batch})")
    print(format_table(["threads", *(f"decode={d}" for d in DECODES), "auto: GPU share"], rows))
    result = {"gpu": torch.cuda.get_device_name(), "data": str(args.photos or args.data),
              "real_photographs": args.photos is not None, "size": args.size, "batch": args.batch,
              "tolerance": tol, "profile": prof, "throughput": runs}

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(DECODES)
        for k, d in enumerate(DECODES):
            ax.bar(np.arange(len(runs)) + k * width, [r["median"][d] for r in runs], width,
                   label=f"decode={d}")
        ax.set_xticks(np.arange(len(runs)) + width, [f"{r['threads']} threads" for r in runs])
        ax.set_ylabel("images / s")
        ax.set_title(f"FastLoader alone on {result['gpu']}")
        ax.legend()
        return fig

    for f in save("gpu_decode", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
