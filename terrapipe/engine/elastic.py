"""``terrapipe run --horovod --min-np A [--max-np B] (--hosts H | --host-discovery-script S)``:
the launcher of an elastic job, as ``horovodrun`` is in elastic mode.

It hosts the job's rendezvous store, starts a worker per slot of the known hosts (at most
``--max-np``), and forms *generations* of the job from the workers alive (NOTE [elastic
generations] in terrapipe/comm/rendezvous.py): the first at the start, a new one whenever a
worker dies (its host is blacklisted: no worker is started there again, or not until
``--blacklist-cooldown-range`` has passed), a member asks for one
(its group failed), or the discovery script (run again every second) shows hosts added (new
workers are started, up to ``--max-np``) or removed (their workers are told to leave). Workers
run ``hvd.elastic.run``: they restore their last commit and go on in the new generation.

The job ends when every worker has ended: with exit code 0 when the last generation's workers
all exited 0, else the first failing one's code. It fails at once, naming why, when fewer than
``--min-np`` workers are left, when more than ``--reset-limit`` generations were formed after the
first, or when ``--elastic-timeout`` seconds pass without ``--min-np`` slots (at the start) or
without every member of a generation arriving. Workers run on this machine only (a host entry
must name it: ``localhost``, ``127.0.0.1``, its host name); Ctrl-C stops every worker.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

from .. import comm
from .launcher import _local_hosts

__all__ = ["ElasticSettings", "run_elastic", "parse_hosts"]

REMOVED, ADDED = 1, 2  # the update flags of a generation (NOTE [elastic generations] 2)
_TICK = 0.05  # seconds between looks at the workers and the store
_DISCOVERY_INTERVAL = 1.0  # seconds between runs of the discovery script (horovodrun's)


@dataclasses.dataclass
class ElasticSettings:
    """What ``terrapipe run`` was asked: ``np`` workers to start with (fewer when fewer slots),
    ``min_np`` .. ``max_np`` (None: no limit) workers at any time, ``hosts`` (``h:slots,...``)
    or ``discovery`` (a script printing ``host:slots`` or ``host`` lines; ``slots_per_host``
    for the latter), ``timeout`` seconds for slots and members to come, ``reset_limit``
    (None: no limit) new generations after the first; ``launcher_exec`` and ``address``: how
    workers on other hosts are started and where they find the store (see the module);
    ``cooldown``: (low, high) seconds a failed host stays blacklisted (None: for good)."""

    np: int
    min_np: int
    max_np: int | None
    hosts: str | None
    discovery: str | None
    slots_per_host: int | None
    timeout: float
    reset_limit: int | None
    launcher_exec: str = "ssh -o BatchMode=yes"
    address: str | None = None
    cooldown: tuple[float, float] | None = None


class ElasticError(RuntimeError):
    """The job cannot go on (too few workers, a timeout, the reset limit); names why."""


def parse_hosts(text: str, slots_per_host: int | None, what: str) -> dict[str, int]:
    """``host:slots`` entries (commas or lines) -> {host: slots}, in order; ``host`` alone takes
    ``slots_per_host``. ValueError naming ``what`` (the flag or script) and the bad entry."""
    hosts: dict[str, int] = {}
    for entry in text.replace(",", "\n").split():
        name, sep, slots = entry.partition(":")
        if not sep:
            if slots_per_host is None:
                raise ValueError(f"{what}: {entry!r} names no slots (host:slots, or --slots-per-host)")
            n = slots_per_host
        else:
            try:
                n = int(slots)
            except ValueError:
                raise ValueError(f"{what}: {entry!r}: slots must be an integer") from None
        if not name or n < 0:
            raise ValueError(f"{what}: bad entry {entry!r}")
        hosts[name] = hosts.get(name, 0) + n
    return hosts


def _is_this_machine(host: str) -> bool:
    """A name ``--gloo`` accepts as this machine, or one resolving to a loopback address or an
    address of this host."""
    if host in _local_hosts():
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return str(address) in mine


@dataclasses.dataclass
class _Worker:
    id: str
    host: str
    proc: subprocess.Popen
    removed: bool = False  # its host left: it was told to leave (NOTE [elastic generations] 5)
    reported: bool = False  # its end was acted on


class _Job:
    """One elastic job: its workers, hosts and generations (the launcher's state)."""

    def __init__(self, settings: ElasticSettings, command: list[str], env: dict) -> None:
        from torch.distributed import TCPStore

        self.s, self.command, self.env = settings, command, env
        # Hosted here for the whole job, as horovodrun's driver hosts its rendezvous server.
        self.store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=settings.timeout))
        self.generations = comm.Generations(self.store)
        self.workers: list[_Worker] = []
        self.members: list[_Worker] = []  # the current generation's, in rank order
        self.blacklist: dict[str, float] = {}  # host: when it may take workers again (monotonic)
        self.failures: dict[str, int] = {}
        self.count = 0  # workers started so far (their ids' last field)
        self.pending: tuple[int, float] | None = None  # (generation, since) waiting for its go
        self.resets = 0
        self.finishing = False  # a worker ended its function (exit 0): no new generations

    # -- hosts --------------------------------------------------------------------------------
    def discover(self) -> dict[str, int]:
        if self.s.discovery is None:
            hosts = parse_hosts(self.s.hosts or "", self.s.slots_per_host, "--hosts")
        else:
            run = subprocess.run([self.s.discovery], capture_output=True, text=True, timeout=60)
            if run.returncode != 0:
                raise ElasticError(f"--host-discovery-script {self.s.discovery} exited with "
                                   f"{run.returncode}: {run.stderr.strip()[-500:]}")
            hosts = parse_hosts(run.stdout, self.s.slots_per_host, self.s.discovery)
        return hosts

    def usable(self, hosts: dict[str, int]) -> dict[str, int]:
        """``hosts`` but those blacklisted now."""
        now = time.monotonic()
        return {h: n for h, n in hosts.items() if self.blacklist.get(h, 0.0) <= now}

    def blacklisted(self) -> list[str]:
        now = time.monotonic()
        return sorted(h for h, until in self.blacklist.items() if until > now)

    def blacklist_host(self, host: str) -> str:
        """Blacklist ``host`` after a failure there: for good, or, with a cooldown (low, high),
        for low * 2^(failures - 1) seconds plus up to a second of jitter, at most high
        (horovodrun's backoff). Returns for how long, in words."""
        self.failures[host] = self.failures.get(host, 0) + 1
        if self.s.cooldown is None:
            self.blacklist[host] = math.inf
            return "blacklisted"
        low, high = self.s.cooldown
        delay = min(high, low * 2 ** (self.failures[host] - 1) + random.random())
        self.blacklist[host] = time.monotonic() + delay
        return f"blacklisted for {delay:.1f}s"

    def free_slots(self, hosts: dict[str, int]) -> list[str]:
        """A host name per slot of the usable ``hosts`` not taken by a live worker, in order."""
        hosts = self.usable(hosts)
        taken: dict[str, int] = {}
        for w in self.live():
            taken[w.host] = taken.get(w.host, 0) + 1
        return [h for h, n in hosts.items() for _ in range(max(0, n - taken.get(h, 0)))]

    # -- workers ------------------------------------------------------------------------------
    def live(self) -> list[_Worker]:
        return [w for w in self.workers if w.proc.poll() is None and not w.removed]

    def start(self, host: str, first_generation: int) -> _Worker:
        self.count += 1
        wid = f"{host}:{self.count}"
        local = _is_this_machine(host)
        address = "127.0.0.1" if local else (self.s.address or socket.getfqdn())
        env = dict(self.env, TERRAPIPE_ELASTIC=f"{address}:{self.store.port}", TERRAPIPE_ELASTIC_WORKER=wid,
                   TERRAPIPE_ELASTIC_FIRST=str(first_generation),
                   TERRAPIPE_ELASTIC_TIMEOUT=str(self.s.timeout), HOROVOD_HOSTNAME=host)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # the world comes from the rendezvous, not from these
        if local:
            proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        else:  # as ssh runs it: the variables this launcher sets, in the command itself
            ours = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if os.environ.get(k) != v)
            remote = f"cd {shlex.quote(os.getcwd())} && env {ours} {shlex.join(self.command)}"
            proc = subprocess.Popen([*shlex.split(self.s.launcher_exec), host, remote], env=env,
                                    start_new_session=True)
        worker = _Worker(wid, host, proc)
        self.workers.append(worker)
        return worker

    def form(self, why: str, update: int, new_hosts: list[str]) -> None:
        """Publish the next generation: the live workers, then new ones on ``new_hosts``."""
        live = self.live()
        survivors = [w for w in self.members if w in live]
        survivors += [w for w in live if w not in survivors]
        if len(survivors) + len(new_hosts) < self.s.min_np:
            raise ElasticError(f"{len(survivors) + len(new_hosts)} workers left, fewer than "
                               f"--min-np {self.s.min_np} ({why}; blacklisted hosts: "
                               f"{self.blacklisted() or 'none'})")
        if self.generations.latest >= 1:
            self.resets += 1
            if self.s.reset_limit is not None and self.resets > self.s.reset_limit:
                raise ElasticError(f"more than --reset-limit {self.s.reset_limit} resets ({why})")
        g = self.generations.latest + 1
        started = [self.start(h, g) for h in new_hosts]
        self.members = survivors + started
        self.generations.publish([w.id for w in self.members], why, update)
        self.pending = (g, time.monotonic())
        print(f"terrapipe run: generation {g}: {len(self.members)} workers "
              f"({', '.join(w.id for w in self.members)}): {why}", file=sys.stderr, flush=True)

    def stop_all(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                _killpg(w.proc, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(w.proc.poll() is None for w in self.workers):
            time.sleep(_TICK)
        for w in self.workers:
            if w.proc.poll() is None:
                _killpg(w.proc, signal.SIGKILL)
            w.proc.wait()

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        # As horovodrun: wait for -np slots, then take every slot there is, up to --max-np.
        slots = self.free_slots(self._wait_for_slots(max(self.s.np, self.s.min_np)))
        self.form("start", 0, slots[:self.s.max_np] if self.s.max_np is not None else slots)
        last_discovery = time.monotonic()
        while True:  # until every worker has ended and none was started again
            time.sleep(_TICK)
            if all(w.proc.poll() is not None and w.reported for w in self.workers):
                break
            why, update, new_hosts = [], 0, []
            for w in self.workers:
                code = w.proc.poll()
                if code is None or w.reported:
                    continue
                w.reported = True
                if w.removed:
                    continue
                if code == 0:
                    self.finishing = True
                else:
                    how = self.blacklist_host(w.host)
                    why.append(f"worker {w.id} exited with {code}; host {w.host} {how}")
                    update |= REMOVED
            if self.finishing:
                continue  # the job is ending: the others finish in the generation they are in
            if self.pending is not None:
                self._check_pending(why)
            if time.monotonic() - last_discovery >= _DISCOVERY_INTERVAL:
                # The discovery script's hosts (or --hosts), every second: workers on hosts no
                # longer listed leave; free slots on usable hosts (new ones, or blacklisted ones
                # whose cooldown passed) get workers, up to --max-np.
                last_discovery = time.monotonic()
                hosts = self.discover()
                for w in self.live():
                    if w.host not in hosts:
                        w.removed = True
                        self.generations.remove(w.id)
                        why.append(f"host {w.host} left: worker {w.id} removed")
                        update |= REMOVED
                free = self.free_slots(hosts)
                room = len(free) if self.s.max_np is None else self.s.max_np - len(self.live())
                new_hosts = free[:max(0, room)]
                if new_hosts:
                    why.append(f"{len(new_hosts)} slots added on {sorted(set(new_hosts))}")
                    update |= ADDED
            asked = self.generations.resets(self.generations.latest, [w.id for w in self.live()])
            if asked and not why and self.pending is None:
                why.append(f"workers {asked} asked for a new generation")
            if why:
                self.form("; ".join(why), update, new_hosts)
        return self._exit_code()

    def _check_pending(self, why: list[str]) -> None:
        g, since = self.pending
        ids = [w.id for w in self.members]
        if len(self.generations.ready(g, ids)) == len(ids):
            self.generations.go(g)
            self.pending = None
        elif time.monotonic() - since > self.s.timeout:
            late = sorted(set(ids) - set(self.generations.ready(g, ids)))
            raise ElasticError(f"generation {g}: workers {late} did not arrive within "
                               f"--elastic-timeout {self.s.timeout:g}s")

    def _wait_for_slots(self, n: int) -> dict[str, int]:
        end = time.monotonic() + self.s.timeout
        while True:
            hosts = self.discover()
            hosts = self.usable(hosts)
            if sum(hosts.values()) >= n:
                return hosts
            if time.monotonic() > end:
                raise ElasticError(f"{sum(hosts.values())} slots available after --elastic-timeout "
                                   f"{self.s.timeout:g}s, fewer than the {n} asked for")
            time.sleep(_DISCOVERY_INTERVAL)

    def _exit_code(self) -> int:
        codes = [w.proc.returncode for w in self.members if not w.removed]
        failed = [c for c in codes if c != 0]
        if not failed:
            return 0
        code = failed[0]
        return code if code > 0 else 128 - code


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run_elastic(settings: ElasticSettings, command: list[str], env: dict) -> int:
    """Run ``command`` as an elastic job (see the module's docstring); returns its exit code."""
    if not command:
        raise SystemExit("terrapipe run: no command given")
    if settings.min_np < 1 or settings.np < 1:
        raise SystemExit(f"terrapipe run: -np and --min-np must be positive, got {settings.np}, "
                         f"{settings.min_np}")
    if settings.max_np is not None and settings.max_np < settings.min_np:
        raise SystemExit(f"terrapipe run: --max-np {settings.max_np} is below --min-np {settings.min_np}")
    if (settings.hosts is None) == (settings.discovery is None):
        raise SystemExit("terrapipe run: an elastic job needs --hosts or --host-discovery-script (one)")
    job = _Job(settings, command, env)
    print(f"terrapipe run: elastic job of {settings.min_np}..{settings.max_np or 'any'} workers: "
          f"{shlex.join(command)}", file=sys.stderr, flush=True)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return job.run()
    except ElasticError as e:
        print(f"terrapipe run: the elastic job failed: {e}", file=sys.stderr, flush=True)
        job.stop_all()
        return 1
    except KeyboardInterrupt:
        job.stop_all(stop["signal"] or signal.SIGINT)
        return 128 + (stop["signal"] or signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        job.stop_all(grace=0)
