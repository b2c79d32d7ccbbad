"""``terrapipe run``: launch N ranks of a command with the mpiexec that ships with the MPI wheel.

    terrapipe run -n 4 [-H host1:2,host2:2] [--] python train.py --epochs 3

Prints the mpiexec command it runs, forwards SIGINT/SIGTERM to the job, and exits with the exit
code of the first rank that failed, naming it. Each rank runs under a small wrapper
(``python -m terrapipe.engine.rank_status``) that records its exit status in a temporary
directory, which is how the failing rank is known even when the launcher then kills the rest.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import launch_env

__all__ = ["main", "mpiexec_path", "build_command"]


def mpiexec_path() -> str:
    found = launch_env.mpiexec_path()
    if not found:
        raise SystemExit("terrapipe run: no mpiexec found (pip install 'terrapipe[mpi]')")
    return found


def build_command(n: int, hosts: str | None, command: list[str]) -> list[str]:
    if n <= 0:
        raise SystemExit(f"terrapipe run: -n must be positive, got {n}")
    if not command:
        raise SystemExit("terrapipe run: no command given")
    cmd = [mpiexec_path(), "-n", str(n)]
    if hosts:
        cmd += ["-hosts", hosts]
    return cmd + [sys.executable, "-m", "terrapipe.engine.rank_status", *command]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="terrapipe run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--np", type=int, required=True, dest="n", help="number of ranks")
    p.add_argument("-H", "--hosts", default=None, help="host1:slots,host2:slots")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    cmd = build_command(args.n, args.hosts, command)
    status_dir = tempfile.mkdtemp(prefix="terrapipe-run-")
    env = dict(os.environ, TERRAPIPE_RUN_STATUS=status_dir)
    print("terrapipe run:", shlex.join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    failures = []
    for f in Path(status_dir).glob("rank*.status"):
        rank = int(f.stem[4:])
        when, rc = f.read_text().split()
        if int(rc) != 0:
            failures.append((float(when), rank, int(rc)))
    if failures:
        when, rank, rc = min(failures)
        error = Path(status_dir) / f"rank{rank}.error"  # an uncaught exception, recorded by the rank
        what = f": {error.read_text().strip().splitlines()[-1]}" if error.exists() else ""
        shutil.rmtree(status_dir, ignore_errors=True)
        print(f"terrapipe run: rank {rank} failed first, with exit code {rc}{what}", file=sys.stderr)
        return rc if rc > 0 else 128 - rc
    shutil.rmtree(status_dir, ignore_errors=True)
    if code != 0:
        print(f"terrapipe run: mpiexec exited with {code}", file=sys.stderr)
    return code if code >= 0 else 128 - code
