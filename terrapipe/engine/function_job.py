"""A Python function as a job: run it on N new ranks and return what each returned.

The mechanics under ``horovod.run`` (terrapipe/horovod/runner.py, which gives it Horovod's
arguments and errors). Standard library only at import (cloudpickle when called), so a worker
(engine/function_task.py) starts without torch.

NOTE [a function as a job]
    1. The call starts ``num_proc`` ranks as ``terrapipe run --horovod`` starts a script's
       (engine/launcher.py: mpiexec, or ranks on this machine over Gloo), each running
       ``python -m terrapipe.engine.function_task``, which runs ``func(*args, **kwargs)``; the
       call returns their return values, indexed by rank.
    2. The function reaches the workers, and their results come back, over one socket the call
       listens on (``multiprocessing.connection``, which authenticates both ends by HMAC with a
       random key the workers get in their environment). Both go pickled with cloudpickle, as
       Horovod sends them, so a function defined in a script, a notebook or a test body works.
       Neither is written to a file, and a payload is unpickled only from a peer that proved it
       holds this call's key: this call's own workers, or the call itself.
    3. A worker connects first, before it imports torch, says its rank, takes the function, runs
       it and sends back its result, or the exception's traceback; then the exception is raised
       on, uncaught, as in a script: where the function joined a world, comm's excepthook aborts
       the job, and the launcher stops the other ranks at a non-zero exit, so a failure ends the
       job within seconds, not when the slowest rank's function returns.
    4. Failure raises :class:`FunctionJobError`, naming the first rank whose function raised (its
       traceback kept), else the rank the launcher saw fail first (one killed before it could
       say anything: the launcher writes it, as JSON, to ``TERRAPIPE_RUN_REPORT``), and the
       job's exit code. Workers that have not all connected within ``start_timeout`` seconds
       stop the job, and the error names the ranks that never did. Ctrl-C in the caller stops
       the job and is raised as KeyboardInterrupt once it has ended; the job's processes never
       outlive the call.
    5. The job's environment is the caller's without the variables of a job the caller may
       itself run in (an MPI launcher's, torchrun's, Horovod's rank variables, ``terrapipe run``'s
       status folder): the new job's launcher sets its own.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from .. import launch_env, settings
from .launcher import _local_hosts

__all__ = ["run_function", "FunctionJobError", "connect", "job_env"]

ADDRESS = "TERRAPIPE_RUN_FUNC"  # host:port of the call's socket
KEY = "TERRAPIPE_RUN_FUNC_KEY"  # the socket's HMAC key, hex
_ACCEPT_POLL = 0.1  # seconds between the accepting thread's looks at close()
_STOP_WAIT = 30.0  # seconds the launcher gets to stop its ranks after SIGTERM, before SIGKILL
OUTPUT = "TERRAPIPE_RUN_FUNC_OUTPUT"  # each rank's stdout / stderr go under this folder

# Clause 5: variables of a job the caller itself runs in (a name ending in "_" is a prefix).
_JOB_VARIABLES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "OMPI_", "MV2_",
                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "HOROVOD_RANK", "HOROVOD_SIZE",
                  "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
                  "TERRAPIPE_RUN_STATUS", "TERRAPIPE_RUN_REPORT")


class FunctionJobError(RuntimeError):
    """A job of :func:`run_function` failed (NOTE [a function as a job] 4). rank / text: the first
    rank whose function raised and its traceback (None when none did); exit_code: the job's;
    missing: ranks that never connected (start timeout) or returned nothing."""

    def __init__(self, message: str, *, rank: int | None = None, text: str | None = None,
                 exit_code: int | None = None, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank, self.text, self.exit_code, self.missing = rank, text, exit_code, list(missing)


def job_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables of an enclosing job (clause 5)."""
    def of_a_job(name: str) -> bool:
        return any(name.startswith(v) if v.endswith("_") else name == v for v in _JOB_VARIABLES)

    return {k: v for k, v in env.items() if not of_a_job(k)}


def connect(env: Mapping[str, str] = os.environ):
    """A worker's authenticated connection to the call that started it (clause 3)."""
    address, key = settings.get(ADDRESS, env), settings.get(KEY, env)
    if not address or not key:
        raise RuntimeError(f"{ADDRESS} / {KEY} unset: function_task runs as a rank of a run_function job")
    host, port = address.rsplit(":", 1)
    return Client((host, int(port)), authkey=bytes.fromhex(key))


def _all_local(hosts: str | None) -> bool:
    local = _local_hosts()
    return not hosts or all(h.split(":")[0] in local for h in hosts.split(","))


class _Collector:
    """The call's end of clauses 2-3: a listening socket that hands each worker proving the
    key the function, and keeps what it sends back; one thread per worker (a worker blocks only
    its own thread). :meth:`close` stops it: the accepting thread looks for that between
    ``_ACCEPT_POLL`` waits (a socket closed under a blocked ``accept`` does not wake it)."""

    def __init__(self, host: str, key: bytes, payload: bytes, num_proc: int) -> None:
        self._server = socket.create_server((host, 0))
        self._server.settimeout(_ACCEPT_POLL)
        self.port = self._server.getsockname()[1]
        self._key, self._payload, self._num_proc = key, payload, num_proc
        self._closing = threading.Event()
        self.lock = threading.Lock()
        self.connected: set[int] = set()
        self.results: dict[int, bytes] = {}
        self.errors: list[tuple[float, int, str]] = []  # (when, rank, traceback text)
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, name="terrapipe-run-accept", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock,), name="terrapipe-run-worker", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        with self.lock:
            self._sockets.append(sock)  # close() shuts it down, waking a blocked read
        with Connection(os.dup(sock.fileno())) as conn:
            try:
                # What Listener.accept does: each side proves it holds the key (HMAC).
                deliver_challenge(conn, self._key)
                answer_challenge(conn, self._key)
                rank = int(json.loads(conn.recv_bytes())["rank"])
                if not 0 <= rank < self._num_proc:
                    return
                with self.lock:
                    self.connected.add(rank)
                conn.send_bytes(self._payload)
                head = json.loads(conn.recv_bytes())
                body = conn.recv_bytes()
            except (AuthenticationError, EOFError, OSError, ValueError, KeyError):
                return  # a stranger, or a worker that died (the job's exit code says so)
            with self.lock:
                if head.get("kind") == "result":
                    self.results[rank] = body
                else:
                    self.errors.append((time.time(), rank, body.decode(errors="replace")))

    def close(self) -> None:
        """Stop accepting and end every worker's connection (a worker still connected after
        its job ended is cut off, not waited for)."""
        self._closing.set()
        self._accepting.join()
        self._server.close()
        with self.lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for t in self._threads:
            t.join()


def _read_report(path: str) -> dict:
    """What the launcher wrote to ``TERRAPIPE_RUN_REPORT`` ({} when it wrote nothing)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _signal(job: subprocess.Popen, signum: int) -> None:
    """``signum`` to the launcher's process group (it forwards SIGINT / SIGTERM to the ranks)."""
    try:
        os.killpg(job.pid, signum)
    except ProcessLookupError:
        pass


def run_function(func: Callable, args: Sequence = (), kwargs: Mapping | None = None, *, num_proc: int,
                 hosts: str | None = None, gloo: bool = False, start_timeout: float = 30.0,
                 output: str | None = None, env: Mapping[str, str] | None = None,
                 executable: str | None = None, verbose: bool = False) -> list:
    """``func(*args, **kwargs)`` on each of ``num_proc`` new ranks of one ``terrapipe run
    --horovod`` job (``hosts``: ``host:slots,...``; ``gloo``: this machine over Gloo, else
    mpiexec); their return values by rank (NOTE [a function as a job]).

    start_timeout: seconds for every rank to connect. output: a folder; rank r's stdout and
    stderr go to ``<output>/rank.<r>/stdout`` and ``stderr`` (r padded with zeros). env: extra
    variables for the job. executable: the ranks' Python (default: this one). verbose: print
    the launch command. Raises :class:`FunctionJobError` (clause 4).
    """
    try:
        import cloudpickle
    except ImportError:
        raise RuntimeError("a function runs as a job pickled with cloudpickle, as Horovod sends it: "
                           "pip install cloudpickle (or 'terrapipe[horovod]')") from None
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    key = os.urandom(32)
    local = _all_local(hosts)
    collector = _Collector("127.0.0.1" if local else "0.0.0.0", key, payload, num_proc)
    job_environment = job_env(os.environ)
    job_environment.update(env or {})
    job_environment.update({ADDRESS: f"{'127.0.0.1' if local else socket.getfqdn()}:{collector.port}",
                            KEY: key.hex()})
    if output:
        job_environment[OUTPUT] = os.path.abspath(output)
    # How the job ended, from its launcher: which rank failed first, even one that was killed
    # before it could say (clause 4).
    report_dir = tempfile.mkdtemp(prefix="terrapipe-function-job-")
    report = job_environment["TERRAPIPE_RUN_REPORT"] = os.path.join(report_dir, "report.json")
    cmd = [sys.executable, "-m", "terrapipe.cli", "run", "--horovod", "-np", str(num_proc)]
    cmd += (["-H", hosts] if hosts else []) + (["--gloo"] if gloo else [])
    cmd += ["--", executable or sys.executable, "-m", "terrapipe.engine.function_task"]
    if verbose:
        print("terrapipe:", " ".join(cmd), file=sys.stderr, flush=True)

    missing = None
    job = None
    # Ctrl-C while the job runs is counted here and passed on to the launcher by the loop below,
    # never raised at whatever line the main thread is on: a KeyboardInterrupt inside Popen.poll
    # can leave its lock held, and the wait that must follow would then never return.
    interrupts: list[int] = []
    own_handler = threading.current_thread() is threading.main_thread()
    if own_handler:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.append(signum))
    try:
        job = subprocess.Popen(cmd, env=job_environment, start_new_session=True)
        started, forwarded = time.monotonic(), 0
        while job.poll() is None:
            time.sleep(0.05)
            while forwarded < len(interrupts):  # each Ctrl-C, once
                forwarded += 1
                _signal(job, signal.SIGINT)
            if missing is None and time.monotonic() - started > start_timeout:
                with collector.lock:
                    missing = sorted(set(range(num_proc)) - collector.connected)
                if missing:
                    _signal(job, signal.SIGTERM)
    except BaseException:
        if job is not None:  # the launcher passes SIGTERM on to the ranks, then ends
            _signal(job, signal.SIGTERM)
        raise
    finally:
        if job is not None:
            try:
                job.wait(_STOP_WAIT)
            except subprocess.TimeoutExpired:
                _signal(job, signal.SIGKILL)
                job.wait()
        if own_handler:  # (None: a handler not set from Python, which cannot be put back)
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        collector.close()
        ended = _read_report(report)
        shutil.rmtree(report_dir, ignore_errors=True)
    if interrupts:
        raise KeyboardInterrupt
    code = job.returncode
    if missing:
        raise FunctionJobError(f"ranks {missing} of {num_proc} did not start within {start_timeout:g} s; "
                               f"the job was stopped", exit_code=code, missing=missing)
    if collector.errors:
        _, rank, text = min(collector.errors)
        last = text.strip().splitlines()[-1] if text.strip() else "an exception"
        error = FunctionJobError(f"rank {rank} raised {last}", rank=rank, text=text, exit_code=code)
        error.add_note(f"rank {rank}'s traceback:\n{text.rstrip()}")
        raise error
    absent = sorted(set(range(num_proc)) - set(collector.results))
    if ended.get("rank") is not None:  # a rank that ended without a word: killed, or exited
        rank, error = ended["rank"], (ended.get("error") or "").strip()
        how = launch_env.how_it_ended(ended["rank_exit_code"])
        how += f": {error.splitlines()[-1]}" if error else ""
        raise FunctionJobError(f"rank {rank} ended: {how}", rank=rank, text=how, exit_code=code,
                               missing=absent)
    if code != 0 or absent:
        what = f"ranks {absent} returned nothing" if absent else "every rank returned"
        raise FunctionJobError(f"the job exited with code {code}; {what}", exit_code=code, missing=absent)
    return [pickle.loads(collector.results[r]) for r in range(num_proc)]
