"""Shared benchmark machinery: alternate our code and the baseline in one run, report medians.

The machine is shared and noisy, so no absolute number is trusted on its own: every case is
timed in rounds, the cases interleaved within each round (A B C, A B C, ...), and the report
gives the median, min and max per case and the ratio of medians against the baseline.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Committed results: one file per run, named <benchmark>_<date>.json, each naming its date, CPU
# model, core count and command (a ratio holds only within one run on one CPU). Runs that are not
# results (make demo, quick checks) set BENCH_RESULTS_DIR to a folder git ignores.
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


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


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, LC_ALL="C")).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines()) if v}


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it, with its family and model numbers (``AMD
    EPYC`` alone names several generations); ``/proc/cpuinfo`` where lscpu is missing."""
    info = _lscpu()
    name = info.get("Model name")
    if name is None:
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        except OSError:
            name = None
    name = name or platform.processor() or "unknown"
    if "CPU family" in info and "Model" in info:
        name += f" (family {info['CPU family']}, model {info['Model']})"
    return name


def vector_isa() -> str:
    """The widest x86 vector extension the CPU reports (what Numba's LLVM may use)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "unknown"
    for isa in ("avx512f", "avx2", "avx", "sse4_2"):
        if isa in flags:
            return isa
    return "none"


def machine() -> dict[str, object]:
    return {
        "cpu": cpu_model(),
        "vector_isa": vector_isa(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def gpu() -> dict[str, object] | None:
    """The CUDA device this process sees, its driver and the torch build; None without one, or
    when the benchmark never imported torch."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    driver = None
    try:  # nvidia-ml-py, where installed: the driver's own version string
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        pass
    return {"name": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda}


# Variables that change what a run measures, named in its command when set: Numba's target CPU
# (which the generated kernels follow too, kernels/resample_ir.target) and the loader's paths.
_MEASURED_ENV = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "TERRAPIPE_JPEG", "TERRAPIPE_COMPILED_FILL")


def command() -> str:
    """The command line that reproduces this run (``python -m benchmarks.<name> ...``), led by
    the variables of ``_MEASURED_ENV`` that are set."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    env = [f"{k}={os.environ[k]}" for k in _MEASURED_ENV if k in os.environ]
    return " ".join(env + [shlex.join(head + sys.argv[1:])])


def save(name: str, payload: dict, plot: Callable[[], object] | None = None) -> list[Path]:
    """Write ``<RESULTS>/<name>_<date>.json`` (the run's date, CPU model, core count and
    command beside the figures), and ``.png`` from the matplotlib figure ``plot()`` returns
    (skipped if matplotlib is missing). A second run of the same benchmark on the same day
    gets ``_2``, ``_3``, ... rather than overwriting the first."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    today = datetime.date.today().isoformat()
    stem, k = f"{name}_{today}", 1
    while (RESULTS / f"{stem}.json").exists():
        k += 1
        stem = f"{name}_{today}_{k}"
    name = stem
    out = [RESULTS / f"{name}.json"]
    payload = {"benchmark": name, "date": today, "command": command(), "machine": machine(), **payload}
    info = gpu()
    if info is not None:
        payload["gpu_device"] = info
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


_RESULTS_TAG = "RESULTS "


def endless_epochs(loader, first: int = 0):
    """Batches of ``loader`` epoch after epoch, as a training loop takes them: each epoch a fresh
    pass (with its start-up cost), numbered from ``first`` for loaders that have ``set_epoch``."""
    for e in itertools.count(first):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        yield from loader


def run_ranks(module: str, n: int, worker_args: list[str], env: dict[str, str] | None = None,
              launcher: list[str] | None = None) -> dict:
    """Run ``python -m <module> --worker <worker_args>`` on ``n`` ranks under the mpiexec beside
    this interpreter (the MPI wheel's), print the command, and return the JSON that rank 0
    printed with :func:`report_from_rank0`. Exits with both output streams if the run fails.
    ``launcher``: mpiexec and its arguments to use instead (an emulated cluster's)."""
    import subprocess
    import sys

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = launcher or [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(n)]
    cmd = [*launcher, sys.executable, "-m", module, "--worker", *worker_args]
    print(" ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    # Searched for, not matched at the line's start: some mpiexecs prefix forwarded lines
    # (Open MPI's tags, terminal escapes).
    line = next((ln for ln in out.stdout.splitlines() if _RESULTS_TAG in ln), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"benchmark failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(line[line.index(_RESULTS_TAG) + len(_RESULTS_TAG):])


def run_under_torchrun(module: str, nodes: int, per_node: int, link: str, worker_args: list[str],
                       timeout: float) -> dict:
    """Run ``python -m <module> --worker OUT <worker_args>`` as one torchrun per node of an
    emulated cluster (``nodes`` x ``per_node``, each link shaped to ``link``; as root) and return
    the JSON its rank 0 wrote to OUT. Exits naming the exit code if the run fails."""
    import tempfile

    from terrapipe.testing.cluster import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with Cluster(nodes, link) as c:
            code = c.run([sys.executable, "-m", module, "--worker", str(out), *worker_args],
                         ranks_per_node=per_node, launcher="torchrun", timeout=timeout)
        if code != 0 or not out.exists():
            sys.exit(f"benchmark failed (exit code {code})")
        return json.loads(out.read_text())


def run_torchrun_here(module: str, per_node: int, worker_args: list[str], timeout: float) -> dict:
    """Run ``python -m <module> --worker OUT <worker_args>`` as ``torchrun --standalone`` of
    ``per_node`` ranks on this machine and return the JSON its rank 0 wrote to OUT (what
    :func:`run_under_torchrun` does across an emulated cluster). Exits naming the exit code if
    the run fails."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI"))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={per_node}",
               f"--log-dir={Path(tmp) / 'torchrun'}", "-m", module, "--worker", str(out), *worker_args]
        print(" ".join(cmd), flush=True)
        code = subprocess.run(cmd, env=env, timeout=timeout).returncode
        if code != 0 or not out.exists():
            sys.exit(f"benchmark failed (exit code {code})")
        return json.loads(out.read_text())


def round_order(cases, k: int) -> list:
    """The order of round ``k`` of interleaved ``cases``: a permutation drawn from ``k`` alone, so
    the same on every rank and every run. A rotation (round k starting with case k) left every
    case behind the same neighbour in every round but the one it started: with a dozen cases,
    ``jit_allreduce`` of benchmarks.allreduce always ran right after Gloo's groups, whose
    threads were still winding down (1 MiB at 4 nodes x 1: 3.8 ms, a private bucket 2.8, and
    equal in a probe without Gloo). Here each case follows each other one about as often, and
    goes first about once in len(cases) rounds."""
    order = list(cases)
    random.Random(k).shuffle(order)
    return order


def interleave_ranks(step: Callable[[str], None], cases: tuple[str, ...], rounds: int, steps: int,
                     mpi, around: Callable[[str], object] | None = None) -> dict[str, list[float]]:
    """Seconds per ``step(case)`` across the ranks of ``mpi``: each round runs ``steps`` of every
    case in turn (in :func:`round_order`), all ranks starting together; a sample is the slowest
    rank's mean.
    ``around(case)``: a context manager entered before each case's steps and left after them,
    outside the timed region (set-up and tear-down of a case)."""
    import contextlib

    from mpi4py import MPI

    samples: dict[str, list[float]] = {c: [] for c in cases}
    for k in range(rounds):
        # No case always follows the same neighbour (another case's threads winding down, DDP's
        # Gloo among them) or always goes first.
        for c in round_order(cases, k):
            with around(c) if around is not None else contextlib.nullcontext():
                mpi.Barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step(c)
                took = (time.perf_counter() - start) / steps
            samples[c].append(mpi.allreduce(took, op=MPI.MAX))
    return samples


def report_from_rank0(payload: dict) -> None:
    """What a worker started by :func:`run_ranks` hands back (call it on rank 0 only)."""
    print(_RESULTS_TAG + json.dumps(payload), flush=True)


def rank_sweep_args(doc: str | None, argv: list[str] | None, algorithms: bool = False,
                    cluster: bool = False, written: bool = False):
    """The command line of a benchmark that sweeps message sizes over ranks: ``-n`` ranks,
    ``--max-mib``, ``--rounds`` and the hidden ``--worker`` that :func:`run_ranks` passes
    (``algorithms``: also ``--algorithms``; ``cluster``: also ``--cluster NxK`` and ``--link``,
    an emulated cluster's shape and link rate; ``written``: also ``--written-input``, which
    :func:`sweep_over_ranks` hands its workers as ``written_input``)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    if algorithms:
        p.add_argument("--algorithms", action="store_true", help="time each path, forced")
    if written:
        p.add_argument("--written-input", action="store_true",
                       help="each rank writes its input before every call, as a training step does")
    if cluster:
        def shape(text: str):
            if text == "x":  # what the launcher passes its workers: "inside a cluster"
                return (0, 0)
            try:
                nodes, per_node = (int(v) for v in text.lower().split("x"))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected NODESxRANKS such as 2x2, got {text!r}") from None
            return nodes, per_node
        p.add_argument("--cluster", type=shape, default=None,
                       help="NODESxRANKS: run across an emulated cluster (needs root)")
        p.add_argument("--link", default="1gbit", help="the emulated links' rate (tc syntax)")
    args = p.parse_args(argv)
    if args.max_mib < 1:  # a sweep keeps the sizes up to --max-mib MiB: at 0 none is left
        p.error(f"--max-mib must be at least 1, got {args.max_mib}")
    return args


def sweep_over_ranks(module: str, args, worker: Callable[[int, int], None]) -> dict | None:
    """Both sides of a size sweep's ``main`` over :func:`rank_sweep_args`' ``args``: as a rank
    (``--worker``), ``worker(max_mib, rounds)`` (and ``written_input=True`` where
    ``--written-input`` was given) and None; as the launcher, ``args.n`` ranks of
    ``python -m <module>`` (one OpenMP thread each) and what their rank 0 reported."""
    written = getattr(args, "written_input", False)
    if args.worker:
        worker(args.max_mib, args.rounds, **({"written_input": True} if written else {}))
        return None
    return run_ranks(module, args.n, ["--max-mib", str(args.max_mib), "--rounds", str(args.rounds)]
                     + (["--written-input"] if written else []), env={"OMP_NUM_THREADS": "1"})


def link_bits_per_second(rate: str) -> float:
    """tc's rate syntax (``"1gbit"``, ``"100mbit"``, ``"2.5gbit"``) in bits per second."""
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"link: not a rate: {rate!r}")


def sweep_plot(sizes: list[int], series: dict[str, list[float]], ylabel: str, title: str,
               ceiling: tuple[float, str] | None = None):
    """One line per case over message sizes (bytes, log2 axis), with an optional horizontal
    ``(value, label)`` ceiling: the figure of the benchmarks that sweep message sizes."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in series.items():
        ax.plot(sizes, ys, marker="o", label=label)
    if ceiling is not None:
        ax.axhline(ceiling[0], color="k", linestyle="--", label=ceiling[1])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message bytes")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig
