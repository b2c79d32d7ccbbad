"""Joining a world without MPI: torchrun's environment (RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT), SLURM's (SLURM_PROCID / SLURM_NTASKS with a MASTER_ADDR) and a key-value store
(torch's FileStore and TCPStore, what a torch.distributed backend is handed). Each runs two real
processes started here with only those variables, and checks the collectives against NumPy."""

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import textwrap

import pytest

# What every rank runs once its world is up: the collectives on both sides of the one-shot's
# limit, checked against NumPy, and a report of the world it joined.
BODY = textwrap.dedent("""
    import json, sys
    import numpy as np
    import terrapipe.comm as comm

    def check(g):
        r, p = g.rank, g.size
        for n in (5, 300_000, 1_100_000):  # one-shot, chunked / ring, single copy
            x = (np.arange(n) % 7 + r).astype(np.float32)
            want = sum((np.arange(n) % 7 + q).astype(np.float32) for q in range(p))
            np.testing.assert_array_equal(comm.allreduce(x, "sum", group=g), want)
        y = np.full(4, r, np.int64)
        np.testing.assert_array_equal(comm.broadcast(y, root=p - 1, group=g), np.full(4, p - 1))
        np.testing.assert_array_equal(comm.allgather(np.array([r]), group=g), np.arange(p)[:, None])
        comm.barrier(group=g)
        return {"rank": r, "size": p, "gloo": g.gloo is not None, "shm": g.shm is not None}
""")


def _port() -> int:
    """A free port for a store the ranks start themselves, below the kernel's ephemeral range.
    A port found free by binding to port 0 is in that range, where any connection made meanwhile
    (the suite's other jobs are still running) may take it before the store binds it: this
    test failed once in CI with EADDRINUSE that way."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 8000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    drop = ("PMI_", "OMPI_", "MPI_", "HYDRA_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "MV2_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def _launch(script: str, envs: list[dict[str, str]], timeout: float = 180) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", script], env=_clean_env(e), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank failed ({p.returncode}):\n{err[-3000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return reports


def test_torchrun_environment_joins_over_gloo():
    port = str(_port())
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    reports = _launch(BODY + "print(json.dumps(check(comm.init(timeout=60))))", envs)
    assert [(d["rank"], d["size"], d["gloo"]) for d in reports] == [(0, 2, True), (1, 2, True)]


def test_slurm_variables_with_a_master_address_join_over_gloo():
    port = str(_port())
    envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    script = BODY + textwrap.dedent("""
        import os
        g = comm.init(timeout=60)
        report = check(g)
        report["env"] = [os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]]
        print(json.dumps(report))
    """)
    reports = _launch(script, envs)
    assert [(d["rank"], d["size"], d["gloo"]) for d in reports] == [(0, 2, True), (1, 2, True)]
    assert [d["env"] for d in reports] == [["0", "2", "0"], ["1", "2", "1"]]


@pytest.mark.parametrize("store", [pytest.param("file", marks=pytest.mark.full), "tcp"])  # file: CI time
def test_a_store_sets_up_a_shared_memory_group(store, tmp_path):
    port = _port()
    make = {
        "file": f"dist.FileStore({str(tmp_path / 'store')!r}, 2)",
        "tcp": f"dist.TCPStore('127.0.0.1', {port}, 2, rank == 0, timeout=datetime.timedelta(seconds=60))",
    }[store]
    script = BODY + textwrap.dedent(f"""
        import datetime, os
        import torch.distributed as dist
        rank = int(os.environ["TEST_RANK"])
        store = {make}
        g = comm.Group.over_store(store, "test", rank, 2, timeout=60)
        report = check(g)
        # split over the same store: the whole group again (key: reversed ranks), and alone
        both, alone = g.split(0, key=-rank), g.split(rank)
        report["split"] = [check(both), check(alone)]
        for x in (alone, both, g):
            x.close()
        print(json.dumps(report))
    """)
    reports = _launch(script, [{"TEST_RANK": str(r)} for r in range(2)])
    assert [(d["rank"], d["size"], d["gloo"], d["shm"]) for d in reports] == [(0, 2, False, True),
                                                                            (1, 2, False, True)]
    assert [[(x["rank"], x["size"], x["shm"]) for x in d["split"]] for d in reports] == [
        [(1, 2, True), (0, 1, False)], [(0, 2, True), (0, 1, False)]]


def test_a_store_group_names_a_rank_that_never_came():
    # Rank 1 of 2 never starts: rank 0's set-up through the store must end with an error that
    # names it, not hang (c10d's own error says only that a wait timed out).
    script = textwrap.dedent("""
        import datetime, sys, tempfile
        import torch.distributed as dist
        import terrapipe.comm as comm
        store = dist.FileStore(tempfile.mktemp(), 2)
        try:
            comm.Group.over_store(store, "lonely", 0, 2, timeout=3)
        except comm.CollectiveTimeoutError as e:
            print(f"{e.ranks} {e}")
            sys.exit(0)
        sys.exit("set-up returned without its peer")
    """)
    p = subprocess.run([sys.executable, "-c", script], env=_clean_env({}), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("[1] ") and "waiting for rank 1" in p.stdout, p.stdout


def test_a_hosted_tcp_store_holds_the_port_it_shares(monkeypatch):
    # Regression: rank 0 picked a free port, closed it and shared it for the store to bind
    # later; anything could take it in between (EADDRINUSE, seen under `terrapipe run --gloo`).
    # Here a thief tries to bind the port while it is being shared, and must fail.
    import terrapipe.comm as comm

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    stolen, shared = [], []

    def share(where):
        with socket.socket() as thief:
            try:
                thief.bind(("", where[1]))
                stolen.append(where)
            except OSError:
                pass
        shared.append(where)
        return where

    store0 = comm.hosted_tcp_store(0, 2, share, timeout=30)
    assert shared and not stolen, stolen
    store1 = comm.hosted_tcp_store(1, 2, lambda _none: shared[0], timeout=30)
    store1.set("from rank 1", b"hello")
    assert store0.get("from rank 1") == b"hello"


def _until(done, timeout: float, what: str) -> None:
    import time

    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def test_elastic_workers_join_generations_as_their_launcher_forms_them():
    """NOTE [elastic generations] in terrapipe/comm/rendezvous.py, with this test as the launcher:
    a generation whose third member never comes gets no go and is superseded; the next one's
    group works; after comm.finalize() both ask for a newer one; one of them is removed."""
    import datetime

    from torch.distributed import TCPStore

    import terrapipe.comm as comm

    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    gens = comm.Generations(store)
    script = BODY + textwrap.dedent("""
        import os
        from terrapipe.comm import rendezvous
        reports = []
        g = comm.init(timeout=30)
        reports.append([rendezvous.last_generation(), check(g)])
        comm.finalize()
        try:
            g = comm.init(timeout=30)
            reports.append([rendezvous.last_generation(), check(g)])
            comm.finalize()
        except comm.WorkerRemoved as e:
            reports.append(["removed", str(e)])
        print(json.dumps(reports))
    """)
    envs = [{"TERRAPIPE_ELASTIC": f"127.0.0.1:{store.port}", "TERRAPIPE_ELASTIC_WORKER": w,
             "TERRAPIPE_ELASTIC_TIMEOUT": "60"} for w in ("a", "b")]
    procs = [subprocess.Popen([sys.executable, "-c", script], env=_clean_env(e), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    try:
        assert gens.publish(["b", "a", "ghost"], "start", 0) == 1
        _until(lambda: len(gens.ready(1, ["a", "b", "ghost"])) == 2, 60, "a and b ready")
        assert gens.publish(["b", "a"], "the ghost never came", 1) == 2
        _until(lambda: len(gens.ready(2, ["a", "b"])) == 2, 60, "a and b ready again")
        gens.go(2)
        _until(lambda: len(gens.resets(2, ["a", "b"])) == 2, 60, "both asking for more")
        gens.remove("b")
        assert gens.publish(["a"], "b removed", 1) == 3
        _until(lambda: gens.ready(3, ["a"]) == ["a"], 60, "a ready")
        gens.go(3)
        out = {}
        for name, p in zip("ab", procs, strict=True):
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            out[name] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [out["b"][0][0], out["b"][0][1]["rank"], out["b"][0][1]["size"]] == [2, 0, 2]
    assert [out["a"][0][0], out["a"][0][1]["rank"], out["a"][0][1]["size"]] == [2, 1, 2]
    assert out["b"][1][0] == "removed" and "worker b: removed" in out["b"][1][1]
    assert [out["a"][1][0], out["a"][1][1]["rank"], out["a"][1][1]["size"]] == [3, 0, 1]


def test_a_generation_whose_member_vanished_during_set_up_is_left_for_the_next():
    """A member that came (ready) and then vanished before its group was set up: the others'
    set-up waits give up once the launcher publishes a newer generation (SetupAbandoned inside
    comm.init), and they join that one, instead of waiting out the timeout."""
    import datetime
    import time

    from torch.distributed import TCPStore

    import terrapipe.comm as comm

    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    gens = comm.Generations(store)
    script = BODY + textwrap.dedent("""
        import time
        from terrapipe.comm import rendezvous
        began = time.monotonic()
        g = comm.init(timeout=60)  # the collectives' timeout: the abandoned wait must not take it
        print(json.dumps([rendezvous.last_generation(), time.monotonic() - began, check(g)]))
        comm.finalize()
    """)
    envs = [{"TERRAPIPE_ELASTIC": f"127.0.0.1:{store.port}", "TERRAPIPE_ELASTIC_WORKER": w,
             "TERRAPIPE_ELASTIC_TIMEOUT": "60"} for w in ("a", "b")]
    procs = [subprocess.Popen([sys.executable, "-c", script], env=_clean_env(e), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    try:
        gens.publish(["a", "ghost", "b"], "start", 0)
        store.set("elastic/gen/1/ready/ghost", "1")  # it came, and will never set up
        _until(lambda: len(gens.ready(1, ["a", "b", "ghost"])) == 3, 60, "everyone ready")
        gens.go(1)
        time.sleep(1.0)  # a and b are inside generation 1's set-up, waiting for the ghost
        gens.publish(["a", "b"], "the ghost is gone", 1)
        _until(lambda: len(gens.ready(2, ["a", "b"])) == 2, 60, "a and b in generation 2")
        gens.go(2)
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            # stdout too: whether it failed before its report or after it, at exit
            assert p.returncode == 0, f"stdout: {stdout[-500:]!r}\nstderr: {stderr[-3000:]}"
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [(g, rep["rank"], rep["size"]) for g, _, rep in out] == [(2, 0, 2), (2, 1, 2)]
    assert all(seconds < 30 for _, seconds, _ in out), out


class _SlowReplies:
    """A TCP proxy in front of ``port`` whose replies arrive ``delay`` seconds late: every
    question a client asks through it is in flight that long."""

    def __init__(self, port: int, delay: float):
        import threading

        self.port, self.delay = port, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        import time

        try:
            while data := src.recv(1 << 16):
                time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def test_an_elastic_worker_exits_cleanly_while_its_launcher_watch_asks_the_store():
    """Regression (NOTE [a launcher that dies] 4): a finished elastic worker was aborted at exit
    (SIGABRT, "terminate called without an active exception"), rarely, under load in CI. The
    launcher's watcher, a daemon thread, was inside torch's store call (the GIL released) when
    the interpreter began to finalize; returning, it retook the GIL in a C++ destructor and
    Python's ending of the thread unwound through it. Here every store reply arrives 0.4 s late
    and the worker's finalization takes 1.5 s (an object's ``__del__``), longer than one of the
    watcher's rounds (0.5 s apart, 0.4 s in flight), so a question returns during it: the
    worker must stop its watcher before finalizing. Failed 4 times in 4 before the fix."""
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=60))
    proxy = _SlowReplies(store.port, 0.4)
    script = textwrap.dedent("""
        import time
        from terrapipe.comm import rendezvous
        rendezvous.connect(30)
        class SlowToFinalize:
            def __del__(self):
                time.sleep(1.5)  # the GIL released while the interpreter finalizes
        held = SlowToFinalize()
        time.sleep(1.0)  # the watcher's questions under way
        print("done", flush=True)
    """)
    env = _clean_env({"TERRAPIPE_ELASTIC": proxy.address, "TERRAPIPE_ELASTIC_WORKER": "a"})
    try:
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=120)
        assert (p.returncode, p.stdout.strip()) == (0, "done"), p.stderr[-2000:]
    finally:
        proxy.close()
