"""The ``terrapipe`` command.

    terrapipe info                       versions, CPUs, CUDA and MPI as terrapipe sees them
    terrapipe run -n N [-H hosts] CMD... launch N ranks of CMD (see terrapipe.engine.launcher)
    terrapipe timeline summary PATH      per rank: waiting for data, computing, exposed communication
    terrapipe timeline merge PATH        join the ranks' parts PATH.rank<r> into PATH
"""

from __future__ import annotations

import argparse
import os
import sys


def _info() -> int:
    import numba
    import numpy

    import terrapipe

    lines = [
        f"terrapipe {terrapipe.__version__}",
        f"python    {sys.version.split()[0]}",
        f"numpy     {numpy.__version__}",
        f"numba     {numba.__version__} (cache dir: {os.environ.get('NUMBA_CACHE_DIR', 'next to sources')})",
    ]
    try:
        import PIL

        simd = "pillow-simd" if ".post" in PIL.__version__ else "Pillow"
        lines.append(f"pillow    {PIL.__version__} ({simd})")
    except ImportError:
        lines.append("pillow    not installed")
    try:
        import torch

        cuda = torch.cuda.is_available()
        devices = f", {torch.cuda.device_count()} devices" if cuda else ""
        lines.append(f"torch     {torch.__version__} (cuda: {cuda}{devices})")
    except ImportError:
        lines.append("torch     not installed")
    try:
        from mpi4py import MPI

        lines.append(f"mpi4py    {MPI.Get_library_version().splitlines()[0].strip()}")
    except ImportError:
        lines.append("mpi4py    not installed (pip install 'terrapipe[mpi]')")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append(f"cpus      {cpus} available to this process")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from .engine.launcher import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["timeline"]:
        from .timeline_summary import main as timeline_main

        return timeline_main(argv[1:])
    parser = argparse.ArgumentParser(prog="terrapipe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, CPUs, CUDA and MPI as terrapipe sees them")
    sub.add_parser("run", help="launch ranks: terrapipe run -n N [-H hosts] [--] COMMAND...")
    sub.add_parser("timeline", help="terrapipe timeline summary|merge PATH")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
