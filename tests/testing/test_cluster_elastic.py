"""An elastic job across emulated machines (terrapipe.testing.cluster): ``terrapipe run --horovod
--min-np 2`` over 2 nodes of 2 workers, a generation spanning the nodes (Gloo between them); every
process of node 1 is SIGKILLed mid-run (the machine lost), and the job carries on at 1 node of 2
(shared memory), with every sample of every epoch trained on once. And the launcher SIGKILLed: the
workers on both nodes stop by themselves."""

import os
import re
import signal
from pathlib import Path

import pytest

from tests.elastic_jobs import epochs_covered_once, run_job, wait_for

pytest_plugins = ["terrapipe.testing.fixtures"]
pytestmark = pytest.mark.cluster

WORKER = Path(__file__).resolve().parents[1] / "horovod" / "elastic_worker.py"


@pytest.mark.full  # make test-cluster / test-full (a minute on two cores); CI has the one-machine kill
def test_a_node_lost_at_2x2_the_job_carries_on_at_1x2(emulated_cluster):
    c = emulated_cluster(2, link="1gbit")
    hosts = ",".join(f"{a}:2" for a in c.addresses)

    def lose_node_1(proc, records):
        wait_for(records, lambda rs: sum(r["size"] == 4 for r in rs) >= 12)
        for pid in c.processes(1):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    code, records, err = run_job(
        ["--horovod", "-np", "4", "--min-np", "2", "-H", hosts, "--launcher-exec", c.exec_script(),
         "--rendezvous-address", c.bridge_address], WORKER, ["--sleep", "0.05"], timeout=300,
        during=lose_node_1)
    assert code == 0, err[-3000:]
    # node 1's two workers may be seen dead in one look or in two (a generation between them)
    last = re.findall(r"generation (\d+): (\d+) workers \(([^)]*)\)", err)[-1]
    assert last[1:] == ("2", f"{c.addresses[0]}:1, {c.addresses[0]}:2"), err[-3000:]
    steps = [r for r in records if "step" in r]
    assert {r["size"] for r in steps if r["generation"] == 1} == {4}
    assert {r["size"] for r in steps if r["generation"] == int(last[0])} == {2}
    # 2 machines of 2: shared memory on each, Gloo between them; then one machine's segment
    assert {(r["local_size"], r["tiered"]) for r in steps if r["generation"] == 1} == {(2, True)}
    assert {(r["local_size"], r["tiered"]) for r in steps if r["generation"] == int(last[0])} == {(2, False)}
    assert {r["size"] for r in steps} == {4, 2}
    # Nothing of the lost generation stays open: no connection to node 1 (its TCP rings, Gloo's)
    later = [r for r in steps if r["generation"] == int(last[0])]
    assert all(c.addresses[1] not in r["peers"] for r in later), [r["peers"] for r in later]
    epochs_covered_once(records, 2, 256)
    assert c.processes(0) == [] and c.processes(1) == []


@pytest.mark.full  # make test-cluster / test-full; CI kills the launcher of a job on one machine
def test_the_launchers_death_stops_the_workers_on_every_machine(emulated_cluster):
    # NOTE [a launcher that dies] in comm/rendezvous.py, across machines: the launcher SIGKILLed
    # while its workers on 2 emulated nodes sleep after step 3; each, on either node, must notice
    # through the store's address on the bridge and end, with no process left on any node.
    c = emulated_cluster(2, link="1gbit")
    hosts = ",".join(f"{a}:1" for a in c.addresses)

    def kill_the_launcher(proc, records):
        wait_for(records, lambda rs: sum(r["step"] == 3 for r in rs) == 2)
        proc.kill()
        proc.wait()

    code, records, err = run_job(
        ["--horovod", "-np", "2", "--min-np", "1", "-H", hosts, "--launcher-exec", c.exec_script(),
         "--rendezvous-address", c.bridge_address], WORKER, ["--hang-step", "3"], timeout=300,
        during=kill_the_launcher)
    assert code == -signal.SIGKILL
    assert err.count("the elastic job's launcher") >= 2 and "is gone" in err, err[-3000:]
    assert max(r["step"] for r in records if "step" in r) == 3
    assert c.processes(0) == [] and c.processes(1) == []
