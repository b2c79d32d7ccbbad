"""How long ``FastLoader(workers="process")`` takes to start: construction, then the first batch.

    python -m benchmarks.worker_start [--rounds 7] [--images 256] [--size 64]

No GPU needed. Each sample is a fresh Python process running a small script that builds an
``ArrayDataset`` of ``--images`` uint8 images (``--size`` square), constructs the loader (a flip,
batches of 32, 2 threads) and takes one batch, timing both steps. The worker process is Python's
spawn, which imports the script's top level again, so two scripts alternate in every round:

* top level without torch: every import inside the guarded ``main()``; the worker then loads no
  torch at all (NOTE [the loader's worker process] 2 in pipeline/worker_process.py);
* ``import torch`` at the top, as most training scripts have it: the worker imports torch too.

Reported per script: the median seconds to construct and to the first batch, and the ratio of
the construction times per round (median). The kernels come from Numba's cache, warmed first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from .common import format_table, save

BODY = """
def main():
    import json, sys, time
    import numpy as np
    from terrapipe import FastLoader
    from terrapipe.pipeline import ArrayDataset, RandomHorizontalFlip

    n, size = int(sys.argv[1]), int(sys.argv[2])
    ds = ArrayDataset(np.zeros((n, size, size, 3), np.uint8), np.arange(n))
    t0 = time.perf_counter()
    loader = FastLoader(ds, [RandomHorizontalFlip()], batch_size=32, num_threads=2, workers="process")
    t1 = time.perf_counter()
    next(iter(loader))
    t2 = time.perf_counter()
    loader.close()
    print(json.dumps({"construct_s": t1 - t0, "first_batch_s": t2 - t1}))


if __name__ == "__main__":
    main()
"""
SCRIPTS = {"top level without torch": BODY, "import torch at the top": "import torch  # noqa: F401\n" + BODY}


def _sample(script: Path, args) -> dict:
    out = subprocess.run([sys.executable, str(script), str(args.images), str(args.size)], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for k, (name, text) in enumerate(SCRIPTS.items()):
            scripts[name] = Path(tmp) / f"start_{k}.py"
            scripts[name].write_text(textwrap.dedent(text))
        for script in scripts.values():  # warm-up: the kernels into Numba's cache
            _sample(script, args)
        samples = {name: [] for name in scripts}
        for r in range(args.rounds):
            for name, script in scripts.items():
                samples[name].append(_sample(script, args))
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(
                f"{n} {s[-1]['construct_s']:.2f}+{s[-1]['first_batch_s']:.2f} s" for n, s in samples.items()),
                flush=True)
    names = list(SCRIPTS)
    pairs = zip(samples[names[0]], samples[names[1]], strict=True)
    ratios = [b["construct_s"] / a["construct_s"] for a, b in pairs]
    summary, rows = {}, []
    for name in names:
        construct = statistics.median(s["construct_s"] for s in samples[name])
        first = statistics.median(s["first_batch_s"] for s in samples[name])
        summary[name] = {"construct_s": construct, "first_batch_s": first}
        rows.append([name, f"{construct:.2f}", f"{first:.2f}"])
    print(format_table(["script", "construct, s (median)", "first batch, s (median)"], rows))
    print(f"construction, {names[1]} / {names[0]}: {statistics.median(ratios):.2f}x (median of rounds)")
    result = {"rounds": args.rounds, "images": args.images, "size": args.size, "samples": samples,
              "summary": summary, "construct_ratio_median": statistics.median(ratios)}
    for f in save("worker_start", result):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
