"""``horovod.run`` (``horovod.runner.run``): run a function on the processes of a new Horovod
job and return what each returned.

    import horovod            # under terrapipe run --horovod; or: from terrapipe.horovod.runner import run

    def fn(a, b):
        import horovod.torch as hvd
        hvd.init()
        return hvd.allgather(torch.tensor([hvd.rank() + a + b])).tolist()

    results = horovod.run(fn, args=(1, 20), num_proc=3)   # one list per rank: [[21, 22, 23], ...]

NOTE [the run API]
    1. Horovod's interactive launcher, with its arguments and its errors, over a function job
       (NOTE [a function as a job] in engine/function_job.py: how the function gets to the ranks
       and the results back, pickled with cloudpickle over an authenticated socket, and how a
       failure ends the job at once).
    2. Failure raises RuntimeError in Horovod's words (``use_gloo``: "Horovod detected that one
       or more processes exited with non-zero status ...", else "mpirun failed with exit code
       N"), naming the first rank whose function raised and its exception; the traceback is a
       note on the error. ``start_timeout`` defaults to ``HOROVOD_START_TIMEOUT``, else 30 s.
    3. Static jobs only, as Horovod's ``run()`` (its elastic mode returns no results):
       ``min_num_proc``, ``max_num_proc``, ``host_discovery_script``, ``slots``, ``reset_limit``
       and ``cooldown_range`` raise ValueError pointing to ``terrapipe run --horovod --min-np``
       with ``hvd.elastic.run``; so do ``mpi_args`` and ``network_interfaces``, which the
       launcher has no equivalent for. ``ssh_port`` and ``ssh_identity_file`` reach mpiexec's
       ssh (``HYDRA_LAUNCHER_EXTRA_ARGS``); ``disable_cache`` is accepted (there is no cache of
       checks to disable).
    4. ``horovod.runner.launch._run(args)``, Horovod's own entry below ``run()`` and
       ``horovodrun``, takes a :class:`HorovodArgs` (Horovod's ``_HorovodArgs``; Horovod's tests
       build one by hand): with ``run_func`` set it is ``run()`` (the function takes no
       arguments: ``run()`` wraps them in), else it runs ``command`` under ``terrapipe run
       --horovod``, elastic where Horovod's would be (``min_num_proc`` or
       ``host_discovery_script``), and returns None, raising RuntimeError in Horovod's words
       when the job fails. The knobs terrapipe honours reach the ranks as Horovod passes them,
       in its environment variables (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_TIMELINE``, ...);
       those with no meaning here (cycle time, response cache, hierarchical and NCCL settings,
       thread affinity, log level) are accepted and have no effect, as the variables
       themselves have none.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence

from ..engine import FunctionJobError, run_function

__all__ = ["run", "HorovodArgs", "launch"]


def _hosts_from_file(path: str) -> str:
    """A hostfile (``<hostname> slots=<n>`` per line, ``#`` comments) as ``host:n,...``."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?", line)
            if m is None:
                raise ValueError(f"hostfile: {path} line {number}: expected '<hostname> slots=<n>', "
                                 f"got {line!r}")
            hosts.append(f"{m.group(1)}:{m.group(2) or 1}")
    if not hosts:
        raise ValueError(f"hostfile: {path} names no host")
    return ",".join(hosts)


def _refuse_both(hosts, hostfile, use_gloo, use_mpi) -> None:
    """Horovod's refusals of two settings that exclude each other, in its words."""
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")


def _ssh_env(ssh_port: int | None, ssh_identity_file: str | None) -> dict[str, str]:
    """mpiexec's ssh options (``HYDRA_LAUNCHER_EXTRA_ARGS``) for a port and an identity file."""
    if ssh_port is None and not ssh_identity_file:
        return {}
    return {"HYDRA_LAUNCHER_EXTRA_ARGS": " ".join(
        ([f"-p {int(ssh_port)}"] if ssh_port is not None else []) +
        ([f"-i {ssh_identity_file}"] if ssh_identity_file else []))}


def run(func: Callable, args: Sequence = (), kwargs: Mapping | None = None, num_proc: int = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[float, float] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: bool | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: Sequence[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list:
    """Run ``func(*args, **kwargs)`` on each of ``num_proc`` new processes of one Horovod job and
    return their return values, a list indexed by rank (NOTE [the run API]).

    func, args, kwargs: pickled with cloudpickle and sent to every process, as Horovod sends
    them; what ``func`` returns comes back the same way. hosts (``host:slots,...``) or hostfile
    (``<host> slots=<n>`` lines): where the processes run (default: here). use_gloo: on this
    machine without MPI; use_mpi (the default): through mpiexec. start_timeout: seconds for
    every process to start (``HOROVOD_START_TIMEOUT``, else 30). output_filename: a folder; rank
    r's stdout and stderr go to ``<folder>/rank.<r>/stdout`` and ``stderr``. verbose: print the
    launch command. executable: the processes' Python (default: this one). ``np``, ``min_np``,
    ``max_np`` and ``network_interface`` are Horovod's deprecated names, taken with its
    warnings. Raises RuntimeError naming the first rank that failed; ValueError for an argument
    this launcher does not take (clause 3).
    """
    if network_interface:
        network_interfaces = network_interface.split(",")
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning,
                      stacklevel=2)
    if np is not None:
        num_proc = np
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
    if min_np is not None:
        min_num_proc = min_np
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
    if max_np is not None:
        max_num_proc = max_np
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
    if not callable(func):
        raise TypeError(f"func: expected a callable, got {type(func).__name__}")
    _refuse_both(hosts, hostfile, use_gloo, use_mpi)
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"num_proc: expected a positive integer, got {num_proc!r}")
    elastic = {"min_num_proc": min_num_proc, "max_num_proc": max_num_proc, "slots": slots,
               "host_discovery_script": host_discovery_script, "reset_limit": reset_limit,
               "cooldown_range": cooldown_range}
    for name, value in elastic.items():
        if value is not None:
            raise ValueError(f"{name}: run() starts a static job; an elastic one runs its script under "
                             f"`terrapipe run --horovod --min-np N ...` with hvd.elastic.run")
    for name, value in (("mpi_args", mpi_args), ("network_interfaces", network_interfaces)):
        if value:
            raise ValueError(f"{name}: terrapipe's launcher has no equivalent (mpiexec picks the "
                             f"interface itself); leave it unset")
    if hostfile is not None:
        hosts = _hosts_from_file(hostfile)
    if start_timeout is None:
        start_timeout = float(os.environ.get("HOROVOD_START_TIMEOUT", "30"))
    env = _ssh_env(ssh_port, ssh_identity_file)
    try:
        return run_function(func, args, kwargs, num_proc=num_proc, hosts=hosts, gloo=bool(use_gloo),
                            start_timeout=start_timeout, output=output_filename, env=env,
                            executable=executable, verbose=bool(verbose))
    except FunctionJobError as exc:
        first = str(exc)
        if exc.rank is not None:  # the rank and its exception's last line, as Horovod names a rank
            first = f"rank {exc.rank}: {exc.text.strip().splitlines()[-1]}"
        if use_gloo:
            msg = ("Horovod detected that one or more processes exited with non-zero status, thus causing "
                   f"the job to be terminated. The first process to do so was: {first}")
        else:
            msg = f"mpirun failed with exit code {exc.exit_code}: {first}"
        error = RuntimeError(msg)
        for note in getattr(exc, "__notes__", ()):
            error.add_note(note)
        raise error from None


class HorovodArgs:
    """Horovod's ``_HorovodArgs``: every setting of a job, as ``horovodrun``'s parser leaves
    them (``num_proc`` 1, everything else None), for :func:`launch` (clause 4)."""

    def __init__(self) -> None:
        self.num_proc = 1
        self.command: list[str] | None = None
        self.run_func: Callable | None = None
        for name in _SETTINGS:
            setattr(self, name, None)


# Every other field of Horovod's _HorovodArgs.
_SETTINGS = (
    "check_build", "ssh_port", "ssh_identity_file", "disable_cache", "start_timeout", "nic",
    "output_filename", "verbose", "config_file", "nics", "executable",
    "fusion_threshold_mb", "cycle_time_ms", "cache_capacity",
    "hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
    "autotune", "autotune_log_file", "autotune_warmup_samples", "autotune_steps_per_sample",
    "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise",
    "min_num_proc", "max_num_proc", "slots", "elastic_timeout", "reset_limit", "cooldown_range",
    "timeline_filename", "timeline_mark_cycles",
    "no_stall_check", "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds",
    "mpi_threads_disable", "mpi_args", "tcp_flag", "binding_args", "num_nccl_streams",
    "thread_affinity", "gloo_timeout_seconds",
    "log_level", "log_with_timestamp", "prefix_output_with_timestamp",
    "hosts", "hostfile", "host_discovery_script",
    "use_gloo", "use_mpi", "use_jsrun",
)


def _given(value) -> bool:
    # Horovod's _HorovodArgs sets cycle_time_ms and cache_capacity to (None,) (a stray comma).
    return value is not None and value != (None,)


def launch(args: HorovodArgs) -> list | None:
    """Horovod's ``horovod.runner.launch._run``: run ``args.run_func`` (a function of no
    arguments) on ``args.num_proc`` processes and return their results by rank, or run
    ``args.command`` (a list of strings) under ``terrapipe run --horovod`` and return None
    (NOTE [the run API] 4). Raises RuntimeError in Horovod's words when the job fails;
    ValueError for a setting this launcher does not take, naming it."""
    if args.run_func is not None:
        if args.command:
            raise ValueError("args: run_func and command are both set; a job runs one of them")
        nics = args.nic if _given(args.nic) else args.nics
        nics = nics.split(",") if isinstance(nics, str) else nics
        return run(args.run_func, num_proc=args.num_proc, min_num_proc=args.min_num_proc,
                   max_num_proc=args.max_num_proc, slots=args.slots, reset_limit=args.reset_limit,
                   cooldown_range=args.cooldown_range, hosts=args.hosts, hostfile=args.hostfile,
                   host_discovery_script=args.host_discovery_script, start_timeout=args.start_timeout,
                   ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
                   disable_cache=args.disable_cache, output_filename=args.output_filename,
                   verbose=args.verbose, use_gloo=args.use_gloo, use_mpi=args.use_mpi,
                   mpi_args=args.mpi_args, network_interfaces=nics or None, executable=args.executable)
    if not args.command:
        raise ValueError("args: set run_func (a function) or command (a list of strings) to run")
    if isinstance(args.command, str) or not all(isinstance(c, str) for c in args.command):
        raise ValueError(f"args.command: expected a list of strings, got {args.command!r}")
    cli, env = _command_line(args)
    if args.verbose:
        print("horovod.runner: " + " ".join(cli), flush=True)
    code = subprocess.call(cli, env=env)
    if code != 0:
        if args.use_gloo or _elastic(args):
            raise RuntimeError("Horovod detected that one or more processes exited with non-zero status, "
                               f"thus causing the job to be terminated (exit code {code}; the launcher "
                               "named the first process to do so above)")
        raise RuntimeError(f"mpirun failed with exit code {code}")
    return None


def _elastic(args: HorovodArgs) -> bool:
    return args.min_num_proc is not None or args.host_discovery_script is not None


def _command_line(args: HorovodArgs) -> tuple[list[str], dict[str, str]]:
    """``terrapipe run --horovod`` for ``args.command``, and the environment its ranks get."""
    _refuse_both(args.hosts, args.hostfile, args.use_gloo, args.use_mpi)
    for name in ("mpi_args", "nics", "nic", "output_filename", "use_jsrun", "binding_args", "config_file"):
        if _given(getattr(args, name)):
            raise ValueError(f"args.{name}: terrapipe's launcher has no equivalent; leave it unset")
    cli = [sys.executable, "-m", "terrapipe.cli", "run", "--horovod", "-np", str(int(args.num_proc))]
    hosts = _hosts_from_file(args.hostfile) if args.hostfile is not None else args.hosts
    if hosts:
        cli += ["-H", hosts]
    cli += ["--gloo"] if args.use_gloo and not _elastic(args) else []
    flags = (("min_num_proc", "--min-np"), ("max_num_proc", "--max-np"),
             ("host_discovery_script", "--host-discovery-script"), ("slots", "--slots"),
             ("elastic_timeout", "--elastic-timeout"), ("reset_limit", "--reset-limit"),
             ("timeline_filename", "--timeline-filename"), ("autotune_log_file", "--autotune-log-file"))
    for name, flag in flags:
        if _given(getattr(args, name)):
            cli += [flag, str(getattr(args, name))]
    if _given(args.cooldown_range):
        cli += ["--blacklist-cooldown-range", *(str(v) for v in args.cooldown_range)]
    if args.autotune:
        cli += ["--autotune"]
    env = dict(os.environ)
    if _given(args.start_timeout):
        env["HOROVOD_START_TIMEOUT"] = str(int(args.start_timeout))
    if _given(args.fusion_threshold_mb):
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(float(args.fusion_threshold_mb) * 1024 * 1024))
    if _given(args.timeline_mark_cycles) and args.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if _given(args.stall_check_shutdown_time_seconds):
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(int(args.stall_check_shutdown_time_seconds))
    env.update(_ssh_env(args.ssh_port, args.ssh_identity_file))
    return cli + ["--", *args.command], env
