"""``terrapipe run``: launch N ranks of a command with the mpiexec that ships with the MPI wheel.

    terrapipe run -n 4 [-H host1:2,host2:2] [--] python train.py --epochs 3
    terrapipe run --horovod -np 4 [-H ...] [--gloo] [--timeline t.json] [--autotune] python train.py
    terrapipe run --horovod -np 2 --min-np 1 [--max-np 4] (-H ... | --host-discovery-script S) python train.py

``--horovod`` puts a ``horovod`` package first on the ranks' PYTHONPATH whose ``horovod.torch``
is terrapipe.horovod, so an unmodified ``import horovod.torch as hvd`` script runs on terrapipe
(horovodrun's flags are accepted; any other option is an error). ``--gloo`` starts the ranks on
this machine without MPI, as torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ...): their world is
Gloo's. ``--timeline`` (``--timeline-filename``) records one Chrome trace of every rank's loader,
collectives and engine (terrapipe.timeline); ``--autotune`` searches the communication knobs
during the first steps (terrapipe.engine.autotune), ``--autotune-log-file`` logs its trials.
``--min-np``, ``--max-np`` or ``--host-discovery-script`` make the job elastic, as with horovodrun
(terrapipe.engine.elastic: workers come and go, ``hvd.elastic`` carries the training on).

Prints the mpiexec command it runs, forwards SIGINT/SIGTERM to the job, and exits with the exit
code of the first rank that failed, naming it. Each rank runs under a small wrapper
(``python -m terrapipe.engine.rank_status``) that records its exit status in a temporary
directory, which is how the failing rank is known even when the launcher then kills the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import launch_env, settings

__all__ = ["main", "mpiexec_path", "build_command"]


def mpiexec_path() -> str:
    found = launch_env.mpiexec_path()
    if not found:
        raise SystemExit("terrapipe run: no mpiexec found (pip install 'terrapipe[mpi]')")
    return found


def _check(n: int, command: list[str]) -> None:
    if n <= 0:
        raise SystemExit(f"terrapipe run: -n must be positive, got {n}")
    if not command:
        raise SystemExit("terrapipe run: no command given")


def build_command(n: int, hosts: str | None, command: list[str]) -> list[str]:
    _check(n, command)
    cmd = [mpiexec_path(), "-n", str(n)]
    if hosts:
        cmd += ["-hosts", hosts]
    return cmd + [sys.executable, "-m", "terrapipe.engine.rank_status", *command]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="terrapipe run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "-np", "--np", type=int, required=True, dest="n", help="number of ranks")
    p.add_argument("-H", "--hosts", default=None, help="host1:slots,host2:slots")
    p.add_argument("--horovod", action="store_true",
                   help="make `import horovod.torch` resolve to terrapipe.horovod in every rank")
    p.add_argument("--gloo", action="store_true", help="start the ranks on this machine without MPI (Gloo)")
    p.add_argument("--mpi", action="store_true", help="launch with mpiexec (the default)")
    p.add_argument("--timeline-filename", "--timeline", dest="timeline", default=None,
                   help="write a Chrome trace of the job's collectives to this file")
    p.add_argument("--autotune", action="store_true",
                   help="search bucket sizes and the ring's knobs during the first steps "
                        "(TERRAPIPE_AUTOTUNE)")
    p.add_argument("--autotune-log-file", default=None, help="a CSV row per autotune trial (rank 0)")
    e = p.add_argument_group("elastic (terrapipe.engine.elastic)")
    e.add_argument("--min-np", "--min-num-proc", type=int, default=None, dest="min_np",
                   help="fewest workers the job goes on with (makes the job elastic)")
    e.add_argument("--max-np", "--max-num-proc", type=int, default=None, dest="max_np",
                   help="most workers at any time (default: every slot)")
    e.add_argument("--host-discovery-script", default=None,
                   help="prints the available hosts, host:slots per line; run every second")
    e.add_argument("--slots-per-host", "--slots", type=int, default=None, dest="slots_per_host",
                   help="slots of a host the discovery script names without them")
    e.add_argument("--elastic-timeout", type=float, default=600.0,
                   help="seconds to wait for slots and for a generation's workers (600)")
    e.add_argument("--reset-limit", type=int, default=None,
                   help="most generations formed after the first before the job fails")
    e.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="seconds a failed host stays blacklisted: LOW doubling with each failure, at "
                        "most HIGH (default: for good)")
    e.add_argument("--launcher-exec", default="ssh -o BatchMode=yes",
                   help="runs `CMD host command` for workers on other hosts (as ssh)")
    e.add_argument("--rendezvous-address", default=None,
                   help="where workers on other hosts reach this launcher (default: its FQDN)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.gloo and args.mpi:
        p.error("--gloo and --mpi exclude each other")
    env = dict(os.environ)
    if args.horovod:
        compat = str(Path(__file__).resolve().parent.parent / "horovod" / "compat")
        env["PYTHONPATH"] = os.pathsep.join(x for x in (compat, env.get("PYTHONPATH", "")) if x)
    if args.timeline:
        env["TERRAPIPE_TIMELINE"] = args.timeline
    if env.get("TERRAPIPE_TIMELINE"):  # the flag, or the variable set by the user
        env["TERRAPIPE_TIMELINE"] = os.path.abspath(env["TERRAPIPE_TIMELINE"])
    if args.autotune or args.autotune_log_file:
        env["TERRAPIPE_AUTOTUNE"] = "1"
    if args.autotune_log_file:
        env["TERRAPIPE_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        if args.gloo or args.mpi:
            p.error("an elastic job (--min-np, --max-np, --host-discovery-script) takes neither "
                    "--gloo nor --mpi")
        from .elastic import ElasticSettings, run_elastic

        settings = ElasticSettings(args.n, args.min_np or args.n, args.max_np, args.hosts,
                                   args.host_discovery_script, args.slots_per_host, args.elastic_timeout,
                                   args.reset_limit, args.launcher_exec, args.rendezvous_address,
                                   tuple(args.blacklist_cooldown_range or ()) or None)
        return run_elastic(settings, command, env)
    status_dir = tempfile.mkdtemp(prefix="terrapipe-run-")
    env["TERRAPIPE_RUN_STATUS"] = status_dir
    if args.gloo:
        code = _run_local(args.n, args.hosts, command, env)
    else:
        code = _run_mpiexec(build_command(args.n, args.hosts, command), env)
    if env.get("TERRAPIPE_TIMELINE"):
        _report_timeline(env["TERRAPIPE_TIMELINE"])
    return _summarize(status_dir, code)


def _report_timeline(trace: str) -> None:
    """The job's one trace (NOTE [one trace per job] in terrapipe/timeline.py): the ranks merged
    it at exit, or, when a rank died before it could, the launcher merges what they left."""
    from .. import timeline

    try:
        n = timeline.merge(trace) if timeline.has_parts(trace) else len(timeline.load(trace))
    except (OSError, ValueError) as e:  # no rank recorded anything
        print(f"terrapipe run: timeline: {e}", file=sys.stderr)
        return
    print(f"terrapipe run: timeline of {n} events in {trace} (terrapipe timeline summary {trace})",
          file=sys.stderr)


def _forwarding(pgids: list[int]):
    def forward(signum, _frame):
        for pgid in pgids:
            try:
                os.killpg(pgid, signum)
            except ProcessLookupError:
                pass

    return {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}


def _run_mpiexec(cmd: list[str], env: dict) -> int:
    print("terrapipe run:", shlex.join(cmd), file=sys.stderr, flush=True)
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    old = _forwarding([proc.pid])
    try:
        code = proc.wait()
        if code != 0:  # ranks killed before MPI_Finalize leave MPICH's node file behind
            launch_env.end_job("TERRAPIPE_RUN_STATUS", env["TERRAPIPE_RUN_STATUS"])
            launch_env.remove_orphaned_mpi_files(started)
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _local_hosts() -> set[str]:
    import socket

    return {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def _run_local(n: int, hosts: str | None, command: list[str], env: dict) -> int:
    """``--gloo``: N ranks on this machine, each told its place as torchrun tells it (and as
    horovodrun's Gloo mode does, HOROVOD_RANK / HOROVOD_SIZE / ...); when one fails, the others
    are stopped."""

    _check(n, command)
    if hosts:
        away = [h.split(":")[0] for h in hosts.split(",") if h.split(":")[0] not in _local_hosts()]
        if away:
            raise SystemExit(f"terrapipe run: --gloo starts ranks on this machine only; {away} are other "
                             "hosts (launch across hosts with MPI: drop --gloo)")
    # The job's store is hosted here for as long as the job runs, as torchrun's agent hosts it:
    # every rank's env:// rendezvous connects to it as a client (TORCHELASTIC_USE_AGENT_STORE).
    # A port picked free and then left for rank 0 to bind can be taken in between (EADDRINUSE).
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=300))
    procs = []
    for r in range(n):
        renv = dict(env, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                    TORCHELASTIC_USE_AGENT_STORE="True", HOROVOD_RANK=str(r), HOROVOD_SIZE=str(n),
                    HOROVOD_LOCAL_RANK=str(r), HOROVOD_LOCAL_SIZE=str(n), HOROVOD_CROSS_RANK="0",
                    HOROVOD_CROSS_SIZE="1")
        cmd = [sys.executable, "-m", "terrapipe.engine.rank_status", *command]
        procs.append(subprocess.Popen(cmd, env=renv, start_new_session=True))
    print(f"terrapipe run: {n} ranks over Gloo on this machine: {shlex.join(command)}", file=sys.stderr,
          flush=True)
    old = _forwarding([p.pid for p in procs])
    try:
        code = 0
        # Every rank polled on every pass: any() over a generator stopped at the first rank still
        # running, so a later rank's failure went unseen until the ranks before it had ended.
        while [p.poll() for p in procs].count(None):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        return code or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        del store
        for s, h in old.items():
            signal.signal(s, h)


def _summarize(status_dir: str, code: int) -> int:
    failed = launch_env.first_failure(status_dir)  # NOTE [rank status] in launch_env.py
    shutil.rmtree(status_dir, ignore_errors=True)
    if failed is not None:
        rank, rc, error = failed
        what = f": {error.strip().splitlines()[-1]}" if error else ""
        print(f"terrapipe run: rank {rank} failed first, with exit code {rc}{what}", file=sys.stderr)
        exit_code = rc if rc > 0 else 128 - rc
    else:
        if code != 0:
            print(f"terrapipe run: the job exited with {code}", file=sys.stderr)
        exit_code = code if code >= 0 else 128 - code
    report = settings.get("TERRAPIPE_RUN_REPORT")
    if report:  # for a program that launched this job (engine/function_job.py)
        rank, rc, error = failed if failed is not None else (None, None, None)
        with open(report, "w") as f:
            json.dump({"exit_code": exit_code, "rank": rank, "rank_exit_code": rc, "error": error}, f)
    return exit_code
