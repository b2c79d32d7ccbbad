"""Where each rank's step time goes, read from a timeline (``terrapipe timeline summary path.json``).

NOTE [step accounting]
    1. A step of a rank is the time on its training thread (the thread that records the engine's
       ``optimizer step`` spans) from the end of one ``optimizer step`` to the end of the next;
       the first step runs from the thread's first event. ``skip`` first steps (default 1: the
       warm-up, with its compilation and first allocations) are left out of the fractions.
    2. Within a step, *data* is the time that thread spent in loader events (waiting for a
       batch), *exposed communication* the time it spent in communication events (a synchronous
       collective, waiting for gradient buckets): the union of such spans, so nested ones count
       once. Everything else is *compute* (forward, backward, the optimizer's own work). A
       reduction that runs on the comm thread while backward computes is overlapped, and costs
       the step nothing here.
    3. The slowest rank of a step is the one with the most data + compute time in it: the rank the
       others waited for in their exposed communication.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

__all__ = ["RankSteps", "summarize", "format_summary", "plot_summary", "STEP_EVENT"]

STEP_EVENT = "optimizer step"  # cat "engine": its end closes a step (NOTE [step accounting] 1)


@dataclass
class RankSteps:
    """One rank's steps: durations and their parts in microseconds (lists of equal length)."""

    rank: int
    thread: str
    total: list[float] = field(default_factory=list)
    data: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)

    @property
    def compute(self) -> list[float]:
        return [max(t - d - c, 0.0) for t, d, c in zip(self.total, self.data, self.comm, strict=True)]

    def fractions(self, skip: int) -> dict[str, float]:
        total = sum(self.total[skip:])
        if total <= 0:
            return {"data": 0.0, "compute": 0.0, "comm": 0.0}
        return {"data": sum(self.data[skip:]) / total, "compute": sum(self.compute[skip:]) / total,
                "comm": sum(self.comm[skip:]) / total}


def _union_within(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to [lo, hi] (``spans`` sorted by start)."""
    total, end = 0.0, lo
    for a, b in spans:
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
        if a >= hi:
            break
    return total


def summarize(events: list[dict]) -> dict[int, RankSteps]:
    """Per rank, its steps (NOTE [step accounting]) from a trace's ``events``. A rank without
    ``optimizer step`` events has no steps and is left out; ValueError if no rank has any."""
    names: dict[tuple[int, int], str] = {}
    by_thread: dict[tuple[int, int], list[dict]] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e.get("tid", 0))] = e["args"]["name"]
        elif e.get("ph") == "X":
            by_thread.setdefault((e["pid"], e.get("tid", 0)), []).append(e)
    train: dict[int, tuple[int, int, list[dict]]] = {}  # pid -> (steps, tid, events)
    for (pid, tid), evs in by_thread.items():
        n = sum(1 for e in evs if e["cat"] == "engine" and e["name"] == STEP_EVENT)
        if n and n > train.get(pid, (0,))[0]:
            train[pid] = (n, tid, evs)
    if not train:
        raise ValueError(f"no {STEP_EVENT!r} events in the trace: record a training run "
                         "(Engine or DistributedOptimizer) with the timeline on")
    out = {}
    for pid, (_, tid, evs) in sorted(train.items()):
        evs.sort(key=lambda e: e["ts"])
        ends = sorted(e["ts"] + e["dur"] for e in evs if e["cat"] == "engine" and e["name"] == STEP_EVENT)
        data = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["cat"] == "loader")
        comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["cat"] == "comm")
        steps = RankSteps(pid, names.get((pid, tid), str(tid)))
        lo = evs[0]["ts"]
        for hi in ends:
            d = _union_within(data, lo, hi)
            c = _union_within(comm, lo, hi)
            steps.total.append(hi - lo)
            steps.data.append(d)
            steps.comm.append(min(c, hi - lo - d))
            lo = hi
        out[pid] = steps
    return out


def slowest_per_step(ranks: dict[int, RankSteps]) -> list[int]:
    """For each step all ranks have, the rank with the most data + compute time (NOTE [step
    accounting] 3)."""
    n = min(len(s.total) for s in ranks.values())
    return [max(ranks, key=lambda r: ranks[r].total[i] - ranks[r].comm[i]) for i in range(n)]


def as_dict(ranks: dict[int, RankSteps], skip: int = 1) -> dict:
    slow = slowest_per_step(ranks)
    return {"skip": skip,
            "ranks": {r: {"thread": s.thread, "steps": len(s.total),
                          "median_step_ms": statistics.median(s.total[skip:] or s.total) / 1000,
                          **s.fractions(skip),
                          "slowest_steps": sum(1 for x in slow[skip:] if x == r)}
                      for r, s in ranks.items()},
            "slowest_per_step": slow}


def format_summary(ranks: dict[int, RankSteps], skip: int = 1) -> str:
    """A table: per rank, steps, median step time and the fractions of step time waiting for
    data, computing and in exposed communication, and how often it was the slowest rank."""
    d = as_dict(ranks, skip)
    lines = [f"steps after the first {skip} (NOTE [step accounting] in terrapipe/timeline_summary.py)",
             f"{'rank':>4}  {'steps':>5}  {'step ms':>8}  {'data':>6}  {'compute':>7}  {'exposed comm':>12}  "
             f"{'slowest':>7}"]
    for r, x in d["ranks"].items():
        lines.append(f"{r:>4}  {x['steps']:>5}  {x['median_step_ms']:>8.2f}  {x['data']:>6.1%}  "
                     f"{x['compute']:>7.1%}  {x['comm']:>12.1%}  {x['slowest_steps']:>7}")
    slow = d["slowest_per_step"][skip:]
    if slow:
        shown = " ".join(str(r) for r in slow[:40]) + (" ..." if len(slow) > 40 else "")
        lines.append(f"slowest rank per step: {shown}")
    return "\n".join(lines)


def plot_summary(ranks: dict[int, RankSteps], png: str, skip: int = 1) -> None:
    """Two panels: each rank's step time split into data / compute / exposed communication,
    and every rank's step times over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
    order = sorted(ranks)
    left = [0.0] * len(order)
    for part, color in (("data", "tab:orange"), ("compute", "tab:blue"), ("comm", "tab:red")):
        widths = [ranks[r].fractions(skip)[part] for r in order]
        label = "exposed comm" if part == "comm" else part
        ax0.barh([f"rank {r}" for r in order], widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax0.set_xlim(0, 1)
    ax0.set_xlabel("fraction of step time")
    ax0.legend(loc="lower right", fontsize=8)
    for r in order:
        ax1.plot([t / 1000 for t in ranks[r].total], label=f"rank {r}", lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("step time (ms)")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """``terrapipe timeline summary PATH [--skip K] [--png OUT] [--json]`` and
    ``terrapipe timeline merge PATH``."""
    import argparse

    from . import timeline

    p = argparse.ArgumentParser(prog="terrapipe timeline")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="per rank: data wait, compute, exposed communication")
    s.add_argument("path")
    s.add_argument("--skip", type=int, default=1, help="first steps left out (warm-up)")
    s.add_argument("--png", default=None, help="also plot to this PNG")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    m = sub.add_parser("merge", help="join the ranks' parts PATH.rank<r> into PATH")
    m.add_argument("path")
    args = p.parse_args(argv)
    if args.command == "merge":
        print(f"{timeline.merge(args.path)} events in {args.path}")
        return 0
    if args.skip < 0:
        p.error(f"--skip must be >= 0, got {args.skip}")
    ranks = summarize(timeline.load(args.path))
    print(json.dumps(as_dict(ranks, args.skip)) if args.json else format_summary(ranks, args.skip))
    if args.png:
        plot_summary(ranks, args.png, args.skip)
    return 0
