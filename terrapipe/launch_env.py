"""How this process was launched, read from the environment (standard library only).

A leaf module: every layer may import it (pipeline for its sharding defaults and GPU choice,
comm for the world it joins, engine for ``terrapipe run``), and it imports no terrapipe layer.
Launchers covered: an MPI launcher (MPICH's hydra, Open MPI, MVAPICH, Intel MPI), torchrun and
other torch.distributed launchers (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), and SLURM's
``srun`` with a MASTER_ADDR (its variables mapped onto torch's names).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

__all__ = ["mpi_launched", "torch_launched", "world", "local_rank", "local_size", "mpiexec_path",
           "MPI_RANK_VARS", "record_exit", "first_failure", "how_it_ended", "alive", "kill_until_gone",
           "end_job", "remove_orphaned_mpi_files", "unlink_own_mpi_segments"]

# Set by MPI launchers in every rank they start (any one suffices).
_MPI_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
# (rank, size) pairs, the MPI launchers' own first: RANK / WORLD_SIZE may be inherited from a
# parent process, where an MPI launcher's variables are always this process's.
MPI_RANK_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Local-rank variables, most specific first: comm.init() and torchrun export LOCAL_RANK;
# MPICH's hydra, Open MPI, MVAPICH and SLURM their own.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "MV2_COMM_WORLD_LOCAL_SIZE")


def _int(value: str | None) -> int | None:
    if value is None or not value.strip().lstrip("-").isdigit():
        return None
    return int(value)


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    """The first of ``names`` set to an integer in ``env``, else None."""
    for name in names:
        value = _int(env.get(name))
        if value is not None:
            return value
    return None


def mpi_launched(env: Mapping[str, str] = os.environ) -> bool:
    """True when an MPI launcher (mpiexec, ``terrapipe run``) started this process."""
    return any(k in env for k in _MPI_VARS)


def torch_launched(env: MutableMapping[str, str] = os.environ) -> bool:
    """True when the environment describes a multi-process torch.distributed job (torchrun, or
    SLURM with a MASTER_ADDR, whose SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID are then copied
    to RANK / WORLD_SIZE / LOCAL_RANK, and MASTER_PORT defaults to 29500)."""
    if "SLURM_PROCID" in env and "MASTER_ADDR" in env and "RANK" not in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_PORT", "29500")
    return all(k in env for k in _TORCH_VARS) and (_int(env["WORLD_SIZE"]) or 1) > 1


def world(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rank, world size) of this process as its launcher describes it; (0, 1) if not launched."""
    for r, w in (*MPI_RANK_VARS, ("RANK", "WORLD_SIZE")):
        rank, size = _int(env.get(r)), _int(env.get(w))
        if rank is not None and size is not None:
            return rank, size
    return 0, 1


def local_rank(env: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank on its node; None if no launcher said."""
    return _first_int(env, _LOCAL_RANK_VARS)


def local_size(env: Mapping[str, str] = os.environ) -> int | None:
    """How many ranks run on this node; None if no launcher said."""
    return _first_int(env, _LOCAL_SIZE_VARS)


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """Which of torchrun's attempts this process belongs to (``TORCHELASTIC_RESTART_COUNT``; 0
    for the first, and outside torchrun)."""
    return _first_int(env, ("TORCHELASTIC_RESTART_COUNT",)) or 0


def mpiexec_path() -> str | None:
    """The mpiexec beside this interpreter (the MPI wheel's), else the one on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec")


# NOTE [rank status]
#
#   How `terrapipe run` learns which rank failed first. The launcher gives every rank a folder
#   (TERRAPIPE_RUN_STATUS); a rank's last word goes there, the launcher reads it after the job:
#
#   1. ``rank<r>.status`` holds "<unix time> <exit code>" (negative: killed by that signal). It
#      is written once, by whoever sees the end first: the rank itself on an uncaught exception
#      (comm's excepthook, right before it aborts the job), else the wrapper that started it
#      (engine/rank_status.py) when the command exits. A later writer keeps the first.
#   2. ``rank<r>.error`` holds the uncaught exception's last line(s), written before the status:
#      the abort may cut the traceback short on its way through mpiexec.
#   3. The rank that failed first is the one with the earliest nonzero status.

def record_exit(status_dir: str, rank: int, code: int, error: str | None = None) -> None:
    """Write rank ``rank``'s exit ``code`` (and its ``error`` text) into ``status_dir`` unless
    that rank already has one (NOTE [rank status] clauses 1-2). Atomic: a reader sees a whole
    file or none."""
    status = os.path.join(status_dir, f"rank{rank}.status")
    if os.path.exists(status):
        return
    files = ([(f"rank{rank}.error", error)] if error is not None else []) + \
        [(f"rank{rank}.status", f"{time.time()} {code}")]
    for name, text in files:
        tmp = os.path.join(status_dir, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(status_dir, name))


def first_failure(status_dir: str) -> tuple[int, int, str | None] | None:
    """``(rank, exit code, error text or None)`` of the rank whose nonzero status is earliest in
    ``status_dir`` (clause 3), or None when every rank that recorded one exited with 0."""
    failures = []
    for f in Path(status_dir).glob("rank*.status"):
        when, code = f.read_text().split()
        if int(code) != 0:
            failures.append((float(when), int(f.name[4:-len(".status")]), int(code)))
    if not failures:
        return None
    _, rank, code = min(failures)
    error = Path(status_dir) / f"rank{rank}.error"
    return rank, code, (error.read_text() if error.exists() else None)


def how_it_ended(code: int | None) -> str:
    """A process's exit status in words: ``exit code N``, ``killed by SIGNAME`` (a negative
    ``code``, as subprocess reports a signal), or ``still running`` (None)."""
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine; one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_shm_files = itertools.count(1)


def create_shm_file(directory: str, prefix: str, nbytes: int, reserve: bool) -> str:
    """A new file ``<directory>/<prefix><uid>_<pid>_<n>`` of ``nbytes`` (the name
    :func:`remove_orphaned_files` reads back), with ``reserve`` its pages allocated now
    (``posix_fallocate``: a full tmpfs refuses here, never with a SIGBUS on first touch).
    Returns its path; on OSError nothing is left and the error propagates."""
    path = os.path.join(directory, f"{prefix}{os.getuid()}_{os.getpid()}_{next(_shm_files)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if reserve:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def remove_orphaned_files(directory: str, prefix: str) -> list[str]:
    """Unlink this user's files ``<directory>/<prefix><uid>_<pid>_*`` whose creating process
    ``pid`` no longer exists (shared memory left by a crash); returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{prefix}{os.getuid()}_*")):
        try:
            pid = int(os.path.basename(path)[len(prefix):].split("_")[1])
        except (IndexError, ValueError):
            continue
        if not alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def kill_until_gone(find: Callable[[], list[int]], timeout: float, interval: float = 0.01) -> None:
    """SIGKILL the processes ``find()`` lists, again and again every ``interval`` s, until it
    lists none or ``timeout`` s have passed (a process can start another while being killed)."""
    import signal

    deadline = time.monotonic() + timeout
    while True:
        pids = find()
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(interval)


def end_job(variable: str, value: str, timeout: float = 10.0) -> None:
    """SIGKILL every process whose environment holds ``variable=value`` (a job's mark, such as
    the status folder ``terrapipe run`` gives each rank) and wait, up to ``timeout`` s, until
    none is left alive (zombies count as gone: their memory is released). MPI launchers start
    each rank in a session of its own, and a killed rank dies after its launcher returned."""
    mark = f"{variable}={value}".encode()

    def marked() -> list[int]:
        pids = []
        for proc in glob.glob("/proc/[0-9]*"):
            try:
                with open(f"{proc}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"{proc}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:  # gone, or not ours to read
                continue
            pids.append(int(proc[6:]))
        return pids

    kill_until_gone(marked, timeout)


# The files an MPICH job leaves when its processes are killed, as (glob, what marks a path as
# one of them in /proc/<pid>/maps and fd links): its ranks' node file in /dev/shm (unlinked in
# MPI_Finalize only), and the topology file each of hydra's proxies writes (its path is fixed
# in hydra, whatever TMPDIR says) and holds open while it runs, removed on the proxy's way out,
# even on SIGTERM, but not on SIGKILL (a test harness's or a cluster's timeout).
_MPI_FILES = (("/dev/shm/mpich_shm_*", "mpich_shm_"), ("/tmp/hydra_hwloc_xmlfile_*", "hydra_hwloc_xmlfile_"))


def remove_orphaned_mpi_files(since: float, settle: float = 1.0) -> list[str]:
    """Remove the files an MPICH job's killed processes leave behind, last written at or after
    ``since`` (a ``time.time()`` value) and held by no process (mapped or open); returns their
    paths. Those are MPICH's node files (``/dev/shm/mpich_shm_*``), unlinked in MPI_Finalize
    only, so a job whose ranks were killed (a launcher ending the others after one failed, a
    timeout) leaves them behind, and hydra's topology files (``/tmp/hydra_hwloc_xmlfile_*``), which a
    proxy killed with SIGKILL leaves; a live job's ranks map theirs
    and its proxies hold theirs open. End the job's processes first (:func:`end_job`). A file
    still held is looked at again for up to ``settle`` seconds: right after a killed job, a file
    was sometimes still held when looked at once (1 to 3 runs in 8 here) and never after a
    second look (14 runs)."""
    removed: list[str] = []
    deadline = time.monotonic() + settle
    while True:
        swept, held = _sweep_mpi_files(since)
        removed += swept
        if not held or time.monotonic() > deadline:
            return removed
        time.sleep(0.05)


def _sweep_mpi_files(since: float) -> tuple[list[str], int]:
    """(files removed, files left because some process maps or holds them)."""
    candidates = set()
    for pattern, _ in _MPI_FILES:
        for path in glob.glob(pattern):
            try:
                if os.stat(path).st_mtime >= since:
                    candidates.add(path)
            except FileNotFoundError:
                pass
    marks = tuple(mark for _, mark in _MPI_FILES)
    held = set()
    for proc in glob.glob("/proc/[0-9]*"):
        if not candidates - held:
            break
        try:
            with open(f"{proc}/maps") as f:
                held |= {line.split(None, 5)[-1].strip() for line in f if any(m in line for m in marks)}
            for fd in glob.glob(f"{proc}/fd/*"):
                target = os.readlink(fd)
                if any(m in target for m in marks):
                    held.add(target)
        except OSError:  # the process ended, or is not ours to read
            continue
    removed = []
    for path in sorted(candidates - held):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed, len(candidates & held)


def unlink_own_mpi_segments() -> list[str]:
    """Unlink the names of the MPICH node files this process maps; returns them. For a rank
    about to end its job with MPI_Abort: the launcher kills the node's other ranks, none reaches
    MPI_Finalize (which alone unlinks the file), and nothing else would remove it on a node
    the launcher does not sweep. The mappings stay valid; MPICH opens the file by name at
    MPI_Init only."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "/mpich_shm_" in line}
    except OSError:
        return []
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path.removesuffix(" (deleted)"))
            removed.append(path)
        except OSError:
            pass  # already unlinked by a peer of the node
    return removed
