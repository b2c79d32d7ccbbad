"""How a rank waits on the shared-memory board for a late peer (NOTE [sleeping on a counter] in
kernels/sync.py): it sleeps, leaving its core to the work that makes the peer late (its own
rank's backward, another rank where ranks outnumber cores). Two boards over one array stand for
two local ranks."""

import os
import threading
import time

import numpy as np
import pytest

from terrapipe.comm.transports.board import Board
from terrapipe.kernels.sync import CAN_SLEEP


def _pair() -> tuple[Board, Board]:
    words = np.zeros(Board.nbytes(2) // 8, np.int64)
    return Board(words, 2, 0, [0, 1]), Board(words, 2, 1, [0, 1])


@pytest.mark.skipif(not CAN_SLEEP, reason="futex sleeping is Linux on x86-64/AArch64")
def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning():
    # Regression: the wait spun and yielded, taking a whole core for as long as the peer was
    # late (DDP's reduction thread waiting milliseconds for the peer's backward, on the core its
    # own rank's backward needed): the waiting thread's CPU time equalled the wall time.
    early, late = _pair()
    late.pids[1] = os.getpid()
    # The CPU time is read over a window in which the waiter is known to be inside the wait
    # (registered as a sleeper), from the waiter thread's own CPU clock: whatever the thread
    # did before it got there (on a cold Numba cache, compiling the barrier's kernels for
    # seconds) is outside the window.
    state = {}

    def waiter():
        try:
            state["step"] = early.barrier(timeout=60, what="allreduce")
        except Exception as e:  # noqa: BLE001 - reported below
            state["error"] = e

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    clock = time.pthread_getcpuclockid(t.ident)
    deadline = time.monotonic() + 60
    while early.sleepers[1] == 0 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)  # until it is asleep on the late rank's counter
    assert t.is_alive() and early.sleepers[1] == 1, state
    wall0, cpu0 = time.monotonic(), time.clock_gettime(clock)
    asleep = []  # it leaves the counter for a moment between naps: sample a while
    while time.monotonic() - wall0 < 0.4:
        asleep.append(int(early.sleepers[1]))
        time.sleep(0.001)
    wall, cpu = time.monotonic() - wall0, time.clock_gettime(clock) - cpu0
    assert t.is_alive() and asleep.count(1) > len(asleep) // 2, asleep
    late.publish()
    t.join(10)
    assert not t.is_alive() and state == {"step": 1} and early.sleepers[1] == 0, state
    assert cpu < 0.25 * wall, (cpu, wall)


def test_waits_between_ranks_in_step_many_times_over():
    """1000 barriers between two threads standing for two ranks, one of them pausing now and
    then past the sleep threshold: every barrier completes, none sleeps out its nap."""
    a, b = _pair()
    errors = []

    def rank(board: Board, pause_every: int):
        try:
            for k in range(1000):
                if pause_every and k % pause_every == 0:
                    time.sleep(0.002)
                board.barrier(timeout=30, what="barrier")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(a, 7), daemon=True),
               threading.Thread(target=rank, args=(b, 11), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert a.steps.tolist() == [1000, 1000] and not a.sleepers.any()


def test_the_wait_setting_is_checked_and_spin_never_sleeps(monkeypatch):
    from terrapipe.comm.transports.shm import wait_mode

    monkeypatch.setenv("TERRAPIPE_WAIT", "Spin")
    assert wait_mode() == "spin" and not _pair()[0].sleeps
    monkeypatch.setenv("TERRAPIPE_WAIT", "nap")
    with pytest.raises(ValueError, match="TERRAPIPE_WAIT: expected one of 'sleep', 'spin', got 'nap'"):
        _pair()
    monkeypatch.delenv("TERRAPIPE_WAIT")
    assert _pair()[0].sleeps == CAN_SLEEP
