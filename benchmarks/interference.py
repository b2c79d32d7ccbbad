"""The loader beside the trainer: how much each loader slows the thread that runs a training step.

    python -m benchmarks.interference [--data DIR | --photos DIR] [--ops 600] [--steps 40]
                                      [--batch 64] [--threads N] [--rounds 3]

No GPU needed. The "step" stands for the thread that launches a model's CUDA kernels: ``--ops``
short torch operations on small tensors, each of which releases the GIL and takes it back, as
a kernel launch does. Every loader feeds RandomResizedCrop(224) + flip + normalize batches of
the JPEGs in DIR (generated as in benchmarks.loader when empty; ``--photos``: real photographs)
on ``--threads`` workers (default: every core) at a lower priority than the step, as when
feeding a GPU (``yield_cpu=True``; the DataLoader's workers lower theirs in ``worker_init_fn``).
The cases alternate in every round:

* alone: the step, with no loader;
* threaded: ``FastLoader(workers="threads")``, one batch taken before each step;
* per-sample: the same, with each sample read, decoded and resampled from Python, as before
  a chunk of files went through one compiled call (``TERRAPIPE_COMPILED_FILL=0`` while it is
  made; NOTE [one compiled call per chunk] in terrapipe/pipeline/compiled_fill.py);
* isolated: ``FastLoader(workers="process")``: the same pool in a worker process;
* dataloader: ``torch.utils.data.DataLoader(num_workers=N, persistent_workers=True)`` with the
  torchvision-equivalent transforms;
* and each loader again without the step (its own rate on this machine).

Reported: the median step time and its slowdown against alone; each loader's img/s beside the
step, and as a fraction of the threaded loader's. Targets (issue "the loader out of the
trainer's way"): isolated <= 1.25x at >= 0.85 of the threaded loader's img/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop

from .common import endless_epochs, format_table, save
from .data import make_image_folder
from .loader import DEFAULT_DATA, MEAN, STD, _photo_folder, _TorchDataset, _torchvision_transform

LOADERS = ("threaded", "per-sample", "isolated", "dataloader")


def _lower_priority(_worker_id: int) -> None:
    os.nice(10)  # the DataLoader's workers yield the CPU as FastLoader's do with yield_cpu=True


def make_step(ops: int):
    """A function running ``ops`` tiny torch operations (each releases and retakes the GIL)."""
    a, b, c = torch.ones(64), torch.ones(64), torch.empty(64)

    def step() -> None:
        for _ in range(ops // 2):
            torch.add(a, b, out=c)
            torch.mul(c, 0.5, out=a)

    return step


def make_probed_step(ops: int, delays: list):
    """The same step, timing each operation: appends (operations that took over ``SLOW`` s,
    seconds lost in them beyond the median operation) per call to ``delays``."""
    a, b, c = torch.ones(64), torch.ones(64), torch.empty(64)
    clock = time.perf_counter

    def step() -> None:
        times = []
        for _ in range(ops // 2):
            t = clock()
            torch.add(a, b, out=c)
            t1 = clock()
            torch.mul(c, 0.5, out=a)
            times += (t1 - t, clock() - t1)
        typical = statistics.median(times)
        slow = [t for t in times if t > SLOW]
        delays.append((len(slow), sum(t - typical for t in slow)))

    return step


SLOW = 200e-6  # an operation this slow waited (for the GIL or a core): alone they take ~2-3 us


def _sample(batches, step, steps: int, batch: int) -> tuple[float, float]:
    """(median step seconds, img/s) over ``steps`` iterations of: next batch, then the step
    (``batches`` None: the step alone; ``step`` None: the loader alone)."""
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        if batches is not None:
            next(batches)
        if step is not None:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return (statistics.median(times) if times else float("nan")), batch * steps / wall


@contextlib.contextmanager
def _setting(name: str, value: str):
    """``name=value`` in the environment while a case's loader is made (settings are read then)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def run(args) -> dict:
    torch.set_num_threads(1)  # the step's ops are tiny: no intra-op pool spinning on the loader's cores
    data = _photo_folder(args.photos) if args.photos else args.data
    if not args.photos:
        make_image_folder(data, args.images)
    ds = ImageFolder(data)
    transforms = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    kw = dict(batch_size=args.batch, shuffle=True, num_threads=args.threads, yield_cpu=True)
    transform, baseline_kind = _torchvision_transform()
    with _setting("TERRAPIPE_COMPILED_FILL", "0"):
        per_sample = FastLoader(ds, transforms, workers="threads", **kw)
    loaders = {
        "threaded": FastLoader(ds, transforms, workers="threads", **kw),
        "per-sample": per_sample,
        "isolated": FastLoader(ds, transforms, workers="process", **kw),
        "dataloader": torch.utils.data.DataLoader(
            _TorchDataset(ds.samples, transform), batch_size=args.batch, shuffle=True,
            num_workers=args.threads, persistent_workers=True, prefetch_factor=2,
            worker_init_fn=_lower_priority),
    }
    streams = {name: endless_epochs(loader) for name, loader in loaders.items()}
    step = make_step(args.ops)
    for name in LOADERS:  # warm-up: worker start-up, compilation, a full prefetch
        _sample(streams[name], step, args.warmup, args.batch)
    _sample(None, step, args.warmup, args.batch)
    cases = ["alone", *LOADERS, *(f"{n} (no step)" for n in LOADERS)]
    samples: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases:
            name = case.split(" ")[0]
            batches = None if case == "alone" else streams[name]
            got = _sample(batches, None if case.endswith("(no step)") else step, args.steps, args.batch)
            samples[case].append(got)
            print(f"round {r + 1}/{args.rounds} {case:22s} step {1e3 * got[0]:7.2f} ms  {got[1]:7.0f} img/s",
                  flush=True)
    # Where the step's time goes: each operation timed, over steps beside each loader.
    delays: dict[str, list] = {}
    for case in ("alone", *LOADERS):
        delays[case] = []
        probed = make_probed_step(args.ops, delays[case])
        _sample(None if case == "alone" else streams[case], probed, args.steps, args.batch)
    for loader in loaders.values():
        if isinstance(loader, FastLoader):
            loader.close()
    del streams, loaders
    # Means, not medians: the waits come in bursts, most steps have none and a few lose milliseconds.
    waits = {c: (statistics.fmean(d[0] for d in v), 1e3 * statistics.fmean(d[1] for d in v))
             for c, v in delays.items()}

    step_ms = {c: 1e3 * statistics.median(s[0] for s in samples[c]) for c in cases if "(no step)" not in c}
    rate = {c: statistics.median(s[1] for s in samples[c]) for c in cases if c != "alone"}
    rows = []
    for name in LOADERS:
        slowdown = step_ms[name] / step_ms["alone"]
        rows.append([name, f"{step_ms[name]:.2f}", f"{slowdown:.2f}x", f"{rate[name]:.0f}",
                     f"{rate[name] / rate['threaded']:.2f}", f"{rate[name + ' (no step)']:.0f}"])
    print(f"\nstep alone: {step_ms['alone']:.2f} ms ({args.ops} ops); {args.threads} workers, "
          f"batch {args.batch}; baseline transforms: {baseline_kind}")
    print(format_table(["loader", "step ms", "slowdown", "img/s beside the step", "of threaded",
                        "img/s alone"], rows))
    probe_rows = [[c, f"{w[0]:.2f}", f"{w[1]:.3f}", f"{sum(d[0] > 0 for d in delays[c])}/{len(delays[c])}"]
                  for c, w in waits.items()]
    print(format_table(["case", f"ops over {SLOW * 1e6:.0f} us, mean per step",
                        "ms lost in them, mean per step", "steps with any"], probe_rows))
    return {"ops": args.ops, "steps": args.steps, "batch": args.batch, "threads": args.threads,
            "data": str(data), "real_photographs": bool(args.photos), "baseline": baseline_kind,
            "step_alone_ms": step_ms["alone"],
            "slow_ops": {c: {"mean_per_step": w[0], "mean_ms_lost_per_step": w[1],
                             "per_step": [list(d) for d in delays[c]]} for c, w in waits.items()},
            "records": [{"case": c, "step_s": [s[0] for s in samples[c]],
                         "img_per_s": [s[1] for s in samples[c]]} for c in cases],
            "summary": {n: {"step_ms": step_ms[n], "slowdown": step_ms[n] / step_ms["alone"],
                            "img_per_s": rate[n], "of_threaded": rate[n] / rate["threaded"],
                            "img_per_s_alone": rate[n + " (no step)"]} for n in LOADERS}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--photos", type=Path, default=None, help="real photographs (see benchmarks.loader)")
    p.add_argument("--images", type=int, default=1000, help="images to generate if --data is empty")
    p.add_argument("--ops", type=int, default=600, help="torch operations per step")
    p.add_argument("--steps", type=int, default=40, help="steps per timed sample")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per case before the rounds")
    p.add_argument("--batch", type=int, default=64)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p.add_argument("--threads", type=int, default=cores)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result = run(args)

    def plot():
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(LOADERS)
        a1.bar(names, [result["summary"][n]["slowdown"] for n in names], color="tab:red")
        a1.axhline(1.25, ls="--", c="k", lw=0.8)
        a1.set_ylabel("step time / step alone")
        a2.bar(names, [result["summary"][n]["img_per_s"] for n in names], color="tab:blue")
        a2.set_ylabel("img/s beside the step")
        fig.tight_layout()
        return fig

    for f in save("interference", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
