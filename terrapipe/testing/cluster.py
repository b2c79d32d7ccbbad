"""An emulated cluster on one machine: N "nodes" joined by shaped links, one MPI job across them.

    python -m terrapipe.testing.cluster run --nodes 2 --ranks-per-node 2 --link 1gbit -- \\
        python train.py
    python -m terrapipe.testing.cluster run --nodes 2 --ranks-per-node 2 --launcher torchrun -- \\
        python train_ddp.py

    with Cluster(nodes=2, link="1gbit") as c:
        code = c.run(["python", "train.py"], ranks_per_node=2)

Each node is a network namespace with its own address (``10.231.X.i``), hostname (``node<i>``),
IPC namespace, ``/etc/hosts`` and private ``/dev/shm``, its ``eth0`` joined to a bridge on the
host; the link is shaped to the rate given in both directions (``tc tbf`` on either end of the
veth pair). To MPI and to terrapipe the nodes are separate machines: MPICH's hydra starts one
proxy per node (through ``--launcher-exec``, which enters the node's namespaces where ``ssh``
would log in), ranks group by node from the host they run on, and shared memory never spans
nodes. Needs root and iproute2; :func:`available` says why not otherwise.

NOTE [what an emulated cluster measures]

  1. Links: each node's link runs at the rate given, both ways, with the latency of a veth
     (tens of microseconds) plus the shaper's queue. Data between nodes crosses the kernel's
     TCP stack as it would between machines.
  2. Not the machines: every node shares this machine's cores and memory bandwidth. On two
     cores, anything above 2-3 Gbit/s is bound by the CPU, not by the link, and ranks of
     different nodes compete for the same cores.

NOTE [leaving nothing behind]

  1. Every object is named after the process that made it and its count of clusters made
     (``tp<pid>c<k>n<i>`` namespaces, ``tp<pid>c<k>v<i>`` links, ``tp<pid>c<k>br`` the
     bridge). :meth:`Cluster.close` (also on an exception, Ctrl-C or SIGTERM in ``run``) kills
     every process in each node's namespace, then deletes the namespaces, which takes their
     mounts and ``/dev/shm`` with them, then the bridge. The links are deleted by name first: a
     node's namespace whose kernel sockets outlive it (TCP connections cut off by a link taken
     down retry for minutes) lingers, nameless, with its link, after ``ip netns del``. The nodes
     share the host's ``/tmp`` (a job's files stay where its launcher wrote them), so the
     topology files MPICH's proxies write there and leave when cut off from their launcher or
     killed (``launch_env.remove_orphaned_mpi_files``) are removed last. A cluster whose maker
     died without closing is removed by the next one made (``remove_stale``).
  2. Between jobs the nodes live on, so each job's end is cleaned up on each node as a resource
     manager's epilogue does (:meth:`Cluster.run`): processes the job left are killed (mpiexec
     exits at once when a node's proxy is lost, and the other nodes' proxies and ranks would
     outlive it), and after a failed job MPICH's node files are swept from each node's
     ``/dev/shm``.

Why one module: the namespaces' set-up, the ways into them (nsenter prefixes, the ssh stand-in
launchers call, mpiexec's and torchrun's arguments) and the teardown all read the same table of
nodes and holders, and the CLI is their one user outside tests.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import launch_env

__all__ = ["Cluster", "available", "remove_stale", "main"]

_PREFIX = "tp"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def available() -> str | None:
    """None when a cluster can be emulated here, else why not (for a test's skip reason)."""
    if sys.platform != "linux":
        return "an emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "an emulated cluster needs root (network namespaces, veth links, tc)"
    for tool in ("ip", "tc", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"an emulated cluster needs `{tool}` (iproute2 / util-linux)"
    if launch_env.mpiexec_path() is None:
        return "an emulated cluster needs mpiexec (the 'mpi' extra: mpi4py + mpich)"
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def _kill_namespace(ns: str, spare: int | None = None) -> None:
    """SIGKILL every process in network namespace ``ns`` but ``spare`` until none is left."""
    launch_env.kill_until_gone(lambda: [p for p in _pids(ns) if p != spare], timeout=2.0,
                               interval=0.02)


def _delete_links(name: str, stale: Callable[[re.Match], bool]) -> list[str]:
    """Delete the bridges and host-side link ends whose name matches ``name`` (a regex, whole
    name) and that ``stale(match)`` says to; returns their names."""
    deleted = []
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(rf"^\d+: ({name})[:@]", line)
        if m and stale(m):
            _sh("ip", "link", "del", m.group(1), check=False)
            deleted.append(m.group(1))
    return deleted


# Run on a node after a failed job: MPICH's node files its killed ranks left in the node's /dev/shm.
_SWEEP = ("import sys; from terrapipe import launch_env; "
          "launch_env.remove_orphaned_mpi_files(float(sys.argv[1]))")


def remove_stale() -> list[str]:
    """Remove the namespaces and bridges of clusters whose maker process is gone; returns their
    names (NOTE [leaving nothing behind])."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"^({_PREFIX}(\d+)c\d+n\d+)\b", line)
        if m and not launch_env.alive(int(m.group(2))):
            _kill_namespace(m.group(1))
            _sh("ip", "netns", "del", m.group(1), check=False)
            removed.append(m.group(1))
    # Bridges, and host ends of links (a node's namespace outlives its deletion while the
    # kernel still holds its sockets: TCP ones cut off by a link taken down, for minutes).
    removed += _delete_links(rf"{_PREFIX}(\d+)c\d+(br|v\d+)",
                             lambda m: not launch_env.alive(int(m.group(2))))
    # The maker's folder (the nodes' launcher script and hosts file), which its __exit__ removes.
    for folder in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*c*-cluster-*"):
        m = re.match(rf"^({_PREFIX}(\d+)c\d+)-cluster-", folder.name)
        if m and folder.is_dir() and not launch_env.alive(int(m.group(2))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def _free_subnet() -> str:
    """A 10.231.X.0/24 no interface of this host uses (the cluster's bridge and nodes)."""
    used = _sh("ip", "-o", "-4", "addr", "show", check=False).stdout
    for x in range(256):
        if f" 10.231.{x}." not in used:
            return f"10.231.{x}"
    raise RuntimeError("no free 10.231.X.0/24 subnet for an emulated cluster")


class Cluster:
    """``nodes`` emulated machines joined by links shaped to ``link`` (tc's rate syntax:
    ``"1gbit"``, ``"100mbit"``; None: unshaped). A context manager: the namespaces exist between
    ``__enter__`` and ``__exit__`` (NOTE [leaving nothing behind]).

    Attributes: ``addresses`` (node i's IPv4 address), ``hostnames`` (``node<i>``),
    ``bridge_address`` (the host's address on the cluster's bridge, where launchers listen).
    """

    _made_here = 0

    def __init__(self, nodes: int, link: str | None = "1gbit") -> None:
        if int(nodes) < 1:
            raise ValueError(f"nodes must be at least 1, got {nodes}")
        if link is not None and not _RATE.match(link):
            raise ValueError(f"link: expected a rate such as '1gbit' or '100mbit', got {link!r}")
        self.nodes = int(nodes)
        self.link = link
        Cluster._made_here += 1  # several clusters of one process may be open together
        self.name = f"{_PREFIX}{os.getpid()}c{Cluster._made_here}"
        self.addresses: list[str] = []
        self.hostnames = [f"node{i}" for i in range(self.nodes)]
        self.bridge_address = ""
        self._holders: list[subprocess.Popen] = []
        self._dir: Path | None = None
        self._made: list[str] = []  # namespaces made so far, for close()
        self._bridge = False
        self._opened = time.time()  # files MPICH's processes left since then go in close()

    # -- set-up and teardown -------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        remove_stale()
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, i: int) -> str:
        return f"{self.name}n{i}"

    def _open(self) -> None:
        # A dead process with this pid may have left links of these names (remove_stale cannot
        # tell them from this process's own).
        _delete_links(rf"{self.name}(br|v\d+)", lambda m: True)
        subnet = _free_subnet()
        self.bridge_address = f"{subnet}.254"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(self.nodes)]
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-cluster-"))
        hosts = self._dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames, strict=True)))
        br = f"{self.name}br"
        _sh("ip", "link", "add", br, "type", "bridge")
        self._bridge = True
        _sh("ip", "addr", "add", f"{self.bridge_address}/24", "dev", br)
        _sh("ip", "link", "set", br, "up")
        for i in range(self.nodes):
            ns, veth = self._ns(i), f"{self.name}v{i}"
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", br, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if self.link is not None:
                # Both ends' egress: what leaves the host side is the node's download, what
                # leaves eth0 its upload. A burst of 1 ms at the rate (at least 64 KiB) lets TCP
                # reach the rate without a standing queue.
                shaper = ["root", "tbf", "rate", self.link, "burst", "256kb", "latency", "20ms"]
                _sh("tc", "qdisc", "add", "dev", veth, *shaper)
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shaper)
            # The node's holder: a process in the node's network, IPC, UTS and mount namespaces
            # (its own hostname, /etc/hosts and /dev/shm) that everything run on the node enters.
            setup = (f"hostname {self.hostnames[i]} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm"
                     f" && mount --bind {shlex.quote(str(hosts))} /etc/hosts && echo ready"
                     " && exec sleep infinity")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--ipc", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", setup],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            self._holders.append(holder)
            line = holder.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"node {i}: could not set up its namespaces: "
                                   f"{holder.stderr.read().strip()}")

    def close(self) -> None:
        """Kill everything on every node and remove the namespaces, links and bridge
        (idempotent)."""
        for ns in self._made:
            _kill_namespace(ns)
        for holder in self._holders:
            holder.wait()
            for f in (holder.stdout, holder.stderr):
                if f is not None:
                    f.close()
        self._holders = []
        for i, ns in enumerate(self._made):
            # The link first: deleting the namespace takes it only once the kernel lets the
            # namespace go (NOTE [leaving nothing behind] 1).
            _sh("ip", "link", "del", f"{self.name}v{i}", check=False)
            _sh("ip", "netns", "del", ns, check=False)
        self._made = []
        if self._bridge:
            _sh("ip", "link", "del", f"{self.name}br", check=False)
            self._bridge = False
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        launch_env.remove_orphaned_mpi_files(self._opened)

    # -- running on the nodes ------------------------------------------------------------------
    def enter(self, node: int) -> list[str]:
        """The command prefix that runs a command on ``node`` (nsenter into its holder's
        namespaces; the environment and working directory are this process's)."""
        if not 0 <= node < len(self._holders):
            raise ValueError(f"node: expected 0..{len(self._holders) - 1}, got {node}")
        return ["nsenter", "-t", str(self._holders[node].pid), "-n", "-i", "-u", "-m",
                f"--wd={os.getcwd()}"]

    def processes(self, node: int) -> list[int]:
        """The pids of what runs on ``node`` now: every process in its namespaces but the one
        that holds them (nothing between jobs, NOTE [leaving nothing behind] 2)."""
        self.enter(node)  # checks node
        return [p for p in _pids(self._ns(node)) if p != self._holders[node].pid]

    def mpiexec_args(self, ranks_per_node: int) -> list[str]:
        """``mpiexec`` and its arguments for one job of ``nodes * ranks_per_node`` ranks,
        ``ranks_per_node`` on each node in rank order; append the command."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        return [launch_env.mpiexec_path(), "-launcher", "ssh", "-launcher-exec", self.exec_script(),
                "-localhost", self.bridge_address, "-hosts", ",".join(self.addresses),
                "-ppn", str(ranks_per_node), "-n", str(self.nodes * ranks_per_node)]

    def exec_script(self) -> str:
        """A program that stands in for ssh: ``SCRIPT [ssh options] ADDRESS command...`` runs the
        command (one shell string, as ssh takes it) on the node at ``ADDRESS``, in this
        process's environment and working directory. For launchers that start processes over
        ssh: hydra (``-launcher-exec``), ``terrapipe run``'s elastic jobs (``--launcher-exec``)."""
        path = self._dir / "enter-node"
        if not path.exists():
            table = " ".join(f"{a}:{h.pid}" for a, h in zip(self.addresses, self._holders, strict=True))
            path.write_text(
                f"#!{sys.executable}\n"
                "import sys\n"
                "from terrapipe.testing.cluster import _launcher_exec\n"
                f"sys.exit(_launcher_exec({table!r}, sys.argv[1:]))\n")
            path.chmod(0o755)
        return str(path)

    def torchrun_args(self, node: int, ranks_per_node: int, port: int = 29400) -> list[str]:
        """The command that starts node ``node``'s share of a torchrun job (``nodes`` torchruns,
        ``ranks_per_node`` ranks each, meeting through c10d rendezvous on node 0's address);
        append the whole command (``python train.py``, not ``train.py``). Run it on that node
        (:meth:`enter`)."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        return [*self.enter(node), sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={self.nodes}", f"--nproc-per-node={ranks_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.addresses[0]}:{port}",
                f"--rdzv-id={self.name}", f"--local-addr={self.addresses[node]}",
                f"--log-dir={self._dir / 'torchrun'}",  # not a folder of its own in /tmp, left there
                "--no-python"]  # the command is whole ("python train.py"), as under mpiexec

    def run(self, command: Sequence[str], ranks_per_node: int = 1, env: dict | None = None,
            timeout: float | None = None, launcher: str = "mpi") -> int:
        """Run ``command`` as one job across the nodes and return its exit code (the job is
        killed after ``timeout`` seconds: returns -9). ``launcher``: ``"mpi"`` (one mpiexec,
        hydra's proxies on the nodes) or ``"torchrun"`` (one torchrun per node); with torchrun
        the first node's nonzero exit code is the job's, and the other nodes are stopped."""
        if launcher == "mpi":
            procs = [subprocess.Popen([*self.mpiexec_args(ranks_per_node), *command],
                                      env=env, start_new_session=True)]
        elif launcher == "torchrun":
            procs = [subprocess.Popen([*self.torchrun_args(i, ranks_per_node), *command],
                                      env=env, start_new_session=True) for i in range(self.nodes)]
        else:
            raise ValueError(f"launcher: expected 'mpi' or 'torchrun', got {launcher!r}")
        started = time.time()
        deadline = None if timeout is None else time.monotonic() + timeout
        code = -signal.SIGKILL
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    code = failed[0] if failed else 0
                    return code
                if deadline is not None and time.monotonic() > deadline:
                    return code
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            self._epilogue(started, failed=code != 0)

    def _epilogue(self, started: float, failed: bool) -> None:
        """What a cluster's resource manager does on every node when a job ends (NOTE [leaving
        nothing behind] 2): a launcher that dies with its job (mpiexec on losing a node's
        proxy) leaves the other nodes' proxies and ranks running; they are killed. After a
        failed job, MPICH's node files its killed ranks left in each node's ``/dev/shm`` are
        removed (``launch_env.remove_orphaned_mpi_files``, run on the node)."""
        for i, holder in enumerate(self._holders):
            _kill_namespace(self._ns(i), spare=holder.pid)
            if failed:
                subprocess.run([*self.enter(i), sys.executable, "-c", _SWEEP, str(started)],
                               capture_output=True, timeout=30)


def _launcher_exec(table: str, argv: list[str]) -> int:
    """What hydra runs in place of ``ssh [options] host command...``: the command, in the
    namespaces of the node whose address is ``host``. ``table``: "address:holder_pid ..."."""
    holders = dict(entry.split(":") for entry in table.split())
    args = list(argv)
    while args and args[0].startswith("-"):  # ssh's options (hydra passes -x)
        args.pop(0)
    if len(args) < 2 or args[0] not in holders:
        print(f"terrapipe.testing.cluster: no node at {args[:1]} (nodes: {sorted(holders)})",
              file=sys.stderr)
        return 255
    host, command = args[0], " ".join(args[1:])
    enter = ["nsenter", "-t", holders[host], "-n", "-i", "-u", "-m", f"--wd={os.getcwd()}"]
    return subprocess.call([*enter, "sh", "-c", command])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m terrapipe.testing.cluster",
        description="Emulate a cluster on this machine (network namespaces joined by shaped "
                    "links) and run one MPI job across it.")
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run a command as one job across emulated nodes")
    run.add_argument("--nodes", type=int, required=True)
    run.add_argument("--ranks-per-node", type=int, default=1)
    run.add_argument("--launcher", choices=("mpi", "torchrun"), default="mpi",
                     help="one mpiexec across the nodes, or one torchrun per node")
    run.add_argument("--link", default="1gbit",
                     help="each node's link rate, both ways (tc syntax: 1gbit, 100mbit; "
                          "'none': unshaped)")
    run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("clean", help="remove what clusters whose maker died left behind")
    args = parser.parse_args(argv)
    if args.action == "clean":
        for name in remove_stale():
            print("removed", name)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run: give the command after --")
    link = None if args.link == "none" else args.link

    def stop(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        with Cluster(args.nodes, link) as cluster:
            code = cluster.run(command, args.ranks_per_node, launcher=args.launcher)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, ValueError) as e:
        print(f"terrapipe.testing.cluster: {e}", file=sys.stderr)
        return 2
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
