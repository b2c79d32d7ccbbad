"""terrapipe.launch_env: what each launcher's variables say about this process."""

import pytest

from terrapipe import launch_env


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"LOCAL_RANK": "3"}, 3),
    ({"MPI_LOCALRANKID": "1"}, 1),  # MPICH's hydra (the wheel's mpiexec)
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 2),
    ({"SLURM_LOCALID": "5"}, 5),
    ({"LOCAL_RANK": "0", "MPI_LOCALRANKID": "1"}, 0),  # comm.init()/torchrun's value wins
    ({"LOCAL_RANK": "x"}, None),
])
def test_local_rank(env, expected):
    assert launch_env.local_rank(env) == expected


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1)),
    ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "0", "WORLD_SIZE": "8"}, (1, 2)),  # inherited RANK loses
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "6"}, (3, 6)),
    ({"RANK": "1"}, (0, 1)),  # a rank without a size says nothing
])
def test_world(env, expected):
    assert launch_env.world(env) == expected


def test_launchers_are_told_apart():
    assert launch_env.mpi_launched({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert not launch_env.mpi_launched({"RANK": "0"})
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    assert launch_env.torch_launched(dict(torchrun))
    assert not launch_env.torch_launched(dict(torchrun, WORLD_SIZE="1"))  # one process: nothing to join
    assert not launch_env.torch_launched({"RANK": "0", "WORLD_SIZE": "2"})  # no rendezvous address


def test_slurm_variables_become_torch_names():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node7"}
    assert launch_env.torch_launched(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("3", "8", "1", "29500")
    assert launch_env.world(env) == (3, 8) and launch_env.local_rank(env) == 1


def test_rank_status_keeps_the_first_word_and_names_the_earliest_failure(tmp_path):
    # NOTE [rank status] in launch_env.py: the rank's own record (its exception) wins over the
    # wrapper's later one, and the earliest nonzero exit is the one `terrapipe run` names.
    d = str(tmp_path)
    assert launch_env.first_failure(d) is None
    launch_env.record_exit(d, 0, 0)
    launch_env.record_exit(d, 2, 1, "ValueError: bad batch\n")
    launch_env.record_exit(d, 2, -9)  # the wrapper, after the abort: too late
    launch_env.record_exit(d, 1, -9)
    assert launch_env.first_failure(d) == (2, 1, "ValueError: bad batch\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.status", "rank1.status",
                                                          "rank2.error", "rank2.status"]


def test_a_killed_jobs_mpi_files_are_removed_and_a_live_jobs_are_kept():
    # Regression: a job the test harness or a cluster's timeout killed with SIGKILL left hydra's
    # topology file in /tmp (a proxy removes its own only on its way out): four of them a CI run.
    # The sweep removes the files written since the job started that no process holds, and
    # keeps those a live process holds open (another job's proxy) or maps (a live rank).
    import mmap
    import os
    import subprocess
    import sys
    import tempfile
    import time

    since = time.time() - 1
    made = []
    for directory, prefix in (("/tmp", "hydra_hwloc_xmlfile_"), ("/dev/shm", "mpich_shm_")):
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
            os.write(fd, b"x" * mmap.PAGESIZE)
            os.close(fd)
            made.append(path)
    orphans, held_open, mapped = made[0], made[1], made[3]
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, sys, time\n"
         "f = open(sys.argv[1], 'rb')\n"
         "g = open(sys.argv[2], 'r+b'); m = mmap.mmap(g.fileno(), 0); g.close()\n"
         "print('ready', flush=True); time.sleep(60)\n", held_open, mapped],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        removed = launch_env.remove_orphaned_mpi_files(since, settle=0.2)
        assert orphans in removed and made[2] in removed, removed
        assert not os.path.exists(orphans) and not os.path.exists(made[2])
        assert os.path.exists(held_open) and os.path.exists(mapped)
        assert held_open not in removed and mapped not in removed
    finally:
        holder.kill()
        holder.wait()
        for path in made:
            if os.path.exists(path):
                os.unlink(path)
