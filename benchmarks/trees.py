"""One benchmark on two source trees, alternated in one run: did a change make anything slower?

    python -m benchmarks.trees --before REV [--after REV] [--runs 3] -- allreduce -n 2 --rounds 3

Checks both revisions out into temporary git worktrees and runs ``python -m benchmarks.<name>
<args>`` in each, alternating (before, after, before, after, ...), so both see the same machine
state; each run writes its JSON into its own tree, which is read back here. For every figure the
two benchmarks report (allreduce: seconds per case and size; train: median step seconds per case)
it reports each tree's median over runs and the median over runs of the per-run ratio after /
before (a ratio is valid within one run: neighbouring runs of the two trees are paired).

``--baseline CASE`` divides every figure by that case's figure of the same size in the same run
first (``"mpi Allreduce"`` for allreduce, ``none`` for train: code neither tree changes), so a
run that met a busier machine, which slows the baseline as much as the rest, does not read as a
change. Saved as ``trees_<benchmark>_<date>.json`` with both revisions, the machine and the
command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import format_table, save

REPO = Path(__file__).resolve().parent.parent


def _figures(name: str, payload: dict) -> dict[str, float]:
    """The figures of one run's JSON to compare, by label (seconds: lower is better)."""
    if name == "allreduce":
        return {f"{r['case']} @ {r['bytes']} B": r["seconds"] for r in payload["records"]}
    if name == "train":
        return {f"{case} step": s for case, s in payload["median_s"].items()}
    raise SystemExit(f"benchmarks.trees: no figures known for {name!r} (allreduce, train)")


def _relative(run: dict[str, float], label: str, baseline: str | None) -> float | None:
    """``label``'s figure in ``run``, divided by ``baseline``'s of the same size when given."""
    value = run.get(label)
    if value is None or baseline is None:
        return value
    size = label.partition(" @ ")[2]
    ref = run.get(f"{baseline} @ {size}" if size else f"{baseline} step")
    return value / ref if ref else None


def compare(runs: dict[str, list[dict[str, float]]], baseline: str | None = None) -> dict:
    """Per figure: each tree's runs, and the median over paired runs of after / before (each
    relative to ``baseline`` first when given)."""
    figures = {}
    for label in runs["before"][0]:
        b = [r[label] for r in runs["before"] if label in r]
        a = [r[label] for r in runs["after"] if label in r]
        pairs = [(_relative(x, label, baseline), _relative(y, label, baseline))
                 for x, y in zip(runs["after"], runs["before"], strict=False)]
        ratios = [x / y for x, y in pairs if x is not None and y]
        if a and b and ratios:
            ratio = statistics.median(ratios)
            figures[label] = {"before_s": b, "after_s": a, "ratio_after_over_before": ratio}
    return figures


def _worktree(rev: str, where: Path) -> str:
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(where), sha], check=True,
                   capture_output=True)
    return sha


def _run(tree: Path, name: str, args: list[str]) -> dict:
    results = tree / "benchmarks" / "results"
    before = set(results.glob(f"{name}_*.json")) if results.exists() else set()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=tree, env=env, check=True)
    made = sorted(set(results.glob(f"{name}_*.json")) - before, key=lambda p: p.stat().st_mtime)
    if not made:
        raise SystemExit(f"benchmarks.trees: {name} wrote no result in {results}")
    return json.loads(made[-1].read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.trees --before REV [--after REV] [--runs K] "
                         "-- NAME ARGS")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the revision to compare against")
    p.add_argument("--after", default="HEAD", help="the revision to measure (default HEAD: commit first)")
    p.add_argument("--runs", type=int, default=3, help="runs of each tree, alternated")
    p.add_argument("--baseline", help="a case neither tree changes: figures are taken relative to it")
    args = p.parse_args(argv[:cut])
    name, bench_args = argv[cut + 1], argv[cut + 2:]
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="terrapipe-trees-") as tmp:
        trees = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        revs = {k: _worktree(getattr(args, k), t) for k, t in trees.items()}
        try:
            runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            machine = None
            for i in range(args.runs):
                for k in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    print(f"--- run {i + 1}/{args.runs}: {k} ({revs[k][:10]})", flush=True)
                    payload = _run(trees[k], name, bench_args)
                    machine = payload["machine"]
                    runs[k].append(_figures(name, payload))
        finally:
            for t in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(t)],
                               capture_output=True)
    figures = compare(runs, args.baseline)
    rows = [[label, f"{1e3 * statistics.median(f['before_s']):.3f}",
             f"{1e3 * statistics.median(f['after_s']):.3f}", f"{f['ratio_after_over_before']:.2f}"]
            for label, f in figures.items()]
    what = "after/before" + (f" (each relative to {args.baseline})" if args.baseline else "")
    print(format_table(["figure", "before ms", "after ms", f"{what}, median of runs"], rows))
    result = {"compared": name, "args": bench_args, "before": revs["before"], "after": revs["after"],
              "runs": args.runs, "baseline": args.baseline, "inner_machine": machine, "figures": figures}
    for f in save(f"trees_{name}_{'_'.join(a.lstrip('-') for a in bench_args[:2])}", result):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
