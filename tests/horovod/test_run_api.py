"""``horovod.run`` (terrapipe.horovod.runner over engine/function_job.py): a function run on the
processes of a new job, its results by rank; the arguments Horovod's run() takes and refuses;
a failure named at once; workers that never start; only this call's workers get the function.
The jobs here run over Gloo, in make test's second lane (NOTE [two lanes] in tests/lanes.py);
tests/horovod/test_run_api_mpi.py runs them through MPI's launcher, in the first."""

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest
import torch

from terrapipe.engine import function_job
from terrapipe.horovod.runner import run


def test_results_by_rank_over_gloo_with_each_ranks_output_in_its_folder(tmp_path):
    offset = 1000  # a closure's variable: cloudpickle sends the function by value, as Horovod does

    def fn(a, b, c, d):
        import terrapipe.horovod as hvd

        hvd.init()
        rank = hvd.rank()
        print(f"stdout of rank {rank}", flush=True)
        print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
        res = hvd.allgather(torch.tensor([rank, a + b + c + d + offset])).tolist()
        return res if rank == 0 else ("ret_val_of_rank_1" if rank == 1 else None)

    got = run(fn, (1, 20), {"c": 300, "d": 4000}, num_proc=2, use_gloo=True, output_filename=str(tmp_path))
    assert got == [[0, 5321, 1, 5321], "ret_val_of_rank_1"]
    for rank in (0, 1):
        assert (tmp_path / f"rank.{rank}" / "stdout").read_text() == f"stdout of rank {rank}\n"
        assert f"stderr of rank {rank}\n" in (tmp_path / f"rank.{rank}" / "stderr").read_text()


def test_a_failing_rank_is_named_at_once_in_horovods_words():
    def _fail_on_rank_1():
        import terrapipe.horovod as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("rank 1 gives up")
        time.sleep(120)  # the launcher stops this rank when rank 1 fails

    start = time.monotonic()
    words = (r"Horovod detected that one or more processes exited with non-zero status.*"
             r"The first process to do so was: rank 1: ValueError: rank 1 gives up")
    with pytest.raises(RuntimeError, match=words) as e:
        run(_fail_on_rank_1, num_proc=2, use_gloo=True)
    assert time.monotonic() - start < 60  # not the other rank's two minutes
    assert "in _fail_on_rank_1" in e.value.__notes__[0]  # the rank's traceback rides along


def test_workers_that_never_start_stop_the_job_and_are_named(tmp_path):
    # An "interpreter" that never runs the worker: no rank connects within start_timeout.
    stuck = tmp_path / "python"
    stuck.write_text("#!/bin/sh\nexec sleep 120\n")
    stuck.chmod(0o755)
    start = time.monotonic()
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] of 2 did not start within 2 s"):
        run(print, num_proc=2, use_gloo=True, start_timeout=2, executable=str(stuck))
    assert time.monotonic() - start < 60
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is the caller's again


@pytest.mark.parametrize("kwargs, match", [
    (dict(hosts="localhost:2", hostfile="hosts.txt"), "hosts and hostfile only allow one"),
    (dict(use_gloo=True, use_mpi=True), "use_gloo and use_mpi only allow one"),
    (dict(num_proc=0), "num_proc: expected a positive integer"),
    (dict(min_num_proc=1), "min_num_proc: run.. starts a static job.*--min-np"),
    (dict(host_discovery_script="discover.sh"), "host_discovery_script: run.. starts a static job"),
    (dict(mpi_args="-bind-to core"), "mpi_args: terrapipe's launcher has no equivalent"),
    (dict(network_interfaces=["eth0"]), "network_interfaces: terrapipe's launcher has no equivalent"),
])
def test_arguments_it_refuses_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(print, **kwargs)
    with pytest.raises(TypeError, match="func: expected a callable"):
        run("print")


def test_deprecated_names_warn_as_horovods_do():
    with pytest.warns(DeprecationWarning, match="np is deprecated, use num_proc instead"), \
            pytest.raises(ValueError, match="num_proc"):
        run(print, np=0)
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"), \
            pytest.raises(ValueError, match="min_num"):
        run(print, min_np=1)


def test_a_hostfile_is_read_as_horovod_reads_it(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("terrapipe.horovod.runner.run_function",
                        lambda func, args, kwargs, **kw: seen.update(kw) or [None])
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the machines\nnode1 slots=4\nnode2   slots = 2\nnode3\n")
    assert run(print, num_proc=2, hostfile=str(hostfile)) == [None]
    assert seen["hosts"] == "node1:4,node2:2,node3:1"
    hostfile.write_text("node1 slots=four\n")
    with pytest.raises(ValueError, match="line 1: expected '<hostname> slots=<n>'"):
        run(print, hostfile=str(hostfile))


def test_an_enclosing_jobs_variables_stay_behind():
    kept = {"PATH": "/bin", "PYTHONPATH": "/p", "HOROVOD_FUSION_THRESHOLD": "1", "RANKING": "kept",
            "NUMBA_CACHE_DIR": "/c"}
    job = {"PMI_RANK": "0", "PMI_FD": "5", "HYDRA_CONTROL_FD": "7", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "x", "TORCHELASTIC_RUN_ID": "1", "HOROVOD_RANK": "0", "OMPI_COMM_WORLD_RANK": "0",
           "TERRAPIPE_RUN_STATUS": "/tmp/s"}
    assert function_job.job_env({**job, **kept}) == kept


def test_only_a_peer_with_the_calls_key_gets_the_function():
    key = os.urandom(32)
    collector = function_job._Collector("127.0.0.1", key, b"the function", 2)
    address = ("127.0.0.1", collector.port)
    try:
        with pytest.raises(AuthenticationError):
            Client(address, authkey=os.urandom(32))
        got = []

        def worker(rank):
            with Client(address, authkey=key) as conn:
                conn.send_bytes(f'{{"rank": {rank}}}'.encode())
                got.append(conn.recv_bytes())
                conn.send_bytes(b'{"kind": "result"}')
                conn.send_bytes(f"result {rank}".encode())

        threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        deadline = time.monotonic() + 10
        while len(collector.results) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [b"the function"] * 2
        assert collector.results == {0: b"result 0", 1: b"result 1"} and collector.connected == {0, 1}
        # a worker still connected when the job is over is cut off, not waited for
        lingering = Client(address, authkey=key)
        lingering.send_bytes(b'{"rank": 1}')
        assert lingering.recv_bytes() == b"the function"
    finally:
        start = time.monotonic()
        collector.close()
        assert time.monotonic() - start < 5
    assert not [t for t in threading.enumerate() if t.name.startswith("terrapipe-run")]
    with pytest.raises(EOFError):
        lingering.recv_bytes()


@pytest.mark.full  # make test-full (CI time): CI names a rank's failure above
def test_a_result_that_cannot_be_pickled_is_named():
    def fn():
        return threading.Lock()

    with pytest.raises(RuntimeError, match=r"rank 0: TypeError: cannot pickle '_thread.lock' object") as e:
        run(fn, use_gloo=True)
    assert "its result (lock) could not be pickled" in e.value.__notes__[0]


DRIVER = """
import os, sys, time
from terrapipe.horovod.runner import run

def fn():
    import terrapipe.horovod as hvd
    hvd.init()
    # One write(2) of under PIPE_BUF bytes: the ranks share the driver's stdout, and print()
    # under PYTHONUNBUFFERED writes each piece on its own, so two ranks' lines could interleave
    # (regression: "RANKRANK 0  1984", and the test waited for a third line until the ranks'
    # sleep ended).
    os.write(1, f"RANK {hvd.rank()} {os.getpid()}\\n".encode())
    time.sleep(300)

if __name__ == "__main__":
    try:
        run(fn, num_proc=2, use_gloo=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
"""


def test_ctrl_c_in_the_caller_stops_the_job_and_leaves_no_rank(tmp_path):
    from terrapipe.launch_env import alive
    from tests.pipeline.test_interrupt import as_at_a_terminal

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, preexec_fn=as_at_a_terminal, start_new_session=True)
    ranks, lines = [], []
    try:
        while len(ranks) < 2:
            line = driver.stdout.readline()
            assert line, (lines, driver.stderr.read())
            lines.append(line)
            if line.startswith("RANK "):
                ranks.append(int(line.split()[2]))
        os.killpg(driver.pid, signal.SIGINT)  # the terminal's Ctrl-C: the caller's process group
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert "INTERRUPTED" in out and driver.returncode == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks)


@pytest.mark.full  # make test-full (CI time): CI names a rank's failure above
def test_a_rank_killed_without_a_word_is_named_from_the_launchers_report():
    def fn():
        import terrapipe.horovod as hvd

        hvd.init()
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"The first process to do so was: rank 1: killed by SIGKILL"):
        run(fn, num_proc=2, use_gloo=True)
    assert time.monotonic() - start < 60


# -- Horovod's own entry below run(): horovod.runner.launch._run(_HorovodArgs) ------------------
def _ranks_of_a_function():
    import terrapipe.horovod as hvd

    hvd.init()
    return [hvd.rank(), hvd.size()]


def test_horovods_args_run_a_command_with_its_knobs_in_the_environment(tmp_path):
    # NOTE [the run API] 4: what Horovod's own test_interactiverun.py drives by hand.
    from terrapipe.horovod.runner import HorovodArgs, launch

    report = ("import os, sys; r = os.environ['RANK']; open(os.path.join(sys.argv[1], 'rank' + r), 'w')"
              ".write(os.environ.get('HOROVOD_FUSION_THRESHOLD', '-') + ' ' + os.environ['WORLD_SIZE'])")
    args = HorovodArgs()
    args.num_proc, args.use_gloo, args.fusion_threshold_mb = 2, True, 2
    args.command = [sys.executable, "-c", report, str(tmp_path)]
    assert args.cycle_time_ms is None and launch(args) is None
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2097152 2", "2097152 2"]
    args.output_filename = str(tmp_path)
    with pytest.raises(ValueError, match="args.output_filename: terrapipe's launcher has no equivalent"):
        launch(args)
    args.output_filename, args.command = None, None
    with pytest.raises(ValueError, match="set run_func .a function. or command"):
        launch(args)


@pytest.mark.full  # make test-full (CI time): the command above, and run() in CI's other tests
def test_horovods_args_run_a_function_and_a_failing_command_raises_in_horovods_words():
    from terrapipe.horovod.runner import HorovodArgs, launch

    args = HorovodArgs()
    args.num_proc, args.use_gloo, args.run_func = 2, True, _ranks_of_a_function
    assert launch(args) == [[0, 2], [1, 2]]
    args.run_func, args.command = None, [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(RuntimeError, match="Horovod detected that one or more processes exited"):
        launch(args)


def test_horovods_elastic_args_make_an_elastic_terrapipe_run():
    from terrapipe.horovod.runner import HorovodArgs, _command_line

    args = HorovodArgs()
    args.num_proc, args.min_num_proc, args.max_num_proc = 2, 1, 4
    args.hosts, args.cooldown_range, args.use_gloo = "localhost:2,127.0.0.1:2", (1, 8), True
    args.command, args.start_timeout = ["python", "train.py", "--epochs", "3"], 45
    cli, env = _command_line(args)
    assert cli[cli.index("--horovod"):] == [
        "--horovod", "-np", "2", "-H", "localhost:2,127.0.0.1:2", "--min-np", "1", "--max-np", "4",
        "--blacklist-cooldown-range", "1", "8", "--", "python", "train.py", "--epochs", "3"]
    assert env["HOROVOD_START_TIMEOUT"] == "45"

