"""Shared benchmark machinery: alternate our code and the baseline in one run, report medians.

The machine is shared and noisy, so no absolute number is trusted on its own: every case is
timed in rounds, the cases interleaved within each round (A B C, A B C, ...), and the report
gives the median, min and max per case and the ratio of medians against the baseline.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def interleave(
    cases: dict[str, Callable[[], object]], rounds: int = 7, min_seconds: float = 0.05
) -> dict[str, list[float]]:
    """Seconds per call of each case, ``rounds`` samples each, cases alternating every round.

    Each sample repeats its call until ``min_seconds`` have passed (calibrated once per case on a
    warm-up call, which also triggers any compilation) and divides by the count.
    """
    reps = {}
    for name, fn in cases.items():
        fn()
        t = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t, 1e-9)
        reps[name] = max(1, int(min_seconds / one))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            n = reps[name]
            t = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t) / n)
    return samples


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def save(name: str, payload: dict, plot: Callable[[], object] | None = None) -> list[Path]:
    """Write ``results/<name>.json``, and ``<name>.png`` from the matplotlib figure ``plot()``
    returns (skipped if matplotlib is missing)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = [RESULTS / f"{name}.json"]
    payload = {"benchmark": name, "machine": machine(), **payload}
    out[0].write_text(json.dumps(payload, indent=2))
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            return out
        import matplotlib.pyplot as plt

        png = RESULTS / f"{name}.png"
        fig = plot()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)
        out.append(png)
    return out
