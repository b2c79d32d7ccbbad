"""Sleeping on a step counter (NOTE [sleeping on a counter] in kernels/sync.py), between threads
of one process: the futex words are the same whether the counters are shared with another
process or not. The multi-process runs are every collective's tests in tests/comm."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from terrapipe.kernels.sync import (
    CAN_SLEEP,
    address_of,
    fetch_add,
    load_seq_cst,
    release_step,
    sig_digest,
    sig_digests,
    sleep_until,
    spin_until,
    store_seq_cst,
    yield_until,
)

needs_futex = pytest.mark.skipif(not CAN_SLEEP, reason="futex sleeping is Linux on x86-64/AArch64")


def _timespec(seconds: float) -> np.ndarray:
    return np.array([int(seconds), int((seconds % 1) * 1e9)], np.int64)


def _board(p: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Step counters and sleeper counts a cache line apart, strided as on the shm board."""
    table = np.zeros((p, 64), np.int64)
    return table[:, 0], table[:, 3]


@njit
def _atomics(a):
    old = fetch_add(a, 1, 5)
    store_seq_cst(a, 2, 7)
    return old, load_seq_cst(a, 1), address_of(a, 2)


def test_atomics_against_plain_arithmetic():
    a = np.arange(0, 40, 10, dtype=np.int64)
    old, now, addr = _atomics(a)
    assert (old, now) == (10, 15) and a.tolist() == [0, 15, 7, 30]
    assert addr == a.ctypes.data + 2 * a.strides[0]
    steps, _ = _board(3)
    assert _atomics(steps)[2] == steps.ctypes.data + 2 * 512  # strided: one board slot apart


@needs_futex
def test_sleep_until_returns_at_once_when_every_counter_is_there():
    steps, sleepers = _board()
    steps[:] = 4
    start = time.monotonic()
    assert sleep_until(steps, sleepers, 4, _timespec(5.0))
    assert time.monotonic() - start < 1 and not sleepers.any()


@needs_futex
def test_sleep_until_times_out_and_deregisters():
    steps, sleepers = _board()
    steps[:] = (3, 2)
    start = time.monotonic()
    assert not sleep_until(steps, sleepers, 3, _timespec(0.05))
    assert time.monotonic() - start >= 0.04 and not sleepers.any()


@needs_futex
def test_a_sleeper_is_woken_by_the_step_not_by_its_timeout():
    steps, sleepers = _board()
    steps[0] = 3
    woke = []

    def waiter():
        sleep_until(steps, sleepers, 3, _timespec(30.0))
        woke.append(time.monotonic())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while sleepers[1] != 1 and time.monotonic() < deadline:  # it registered on counter 1
        time.sleep(0.001)
    time.sleep(0.05)
    assert t.is_alive() and sleepers[1] == 1
    released = time.monotonic()
    release_step(steps, sleepers, 1, 3)
    t.join(10)  # a lost wake-up would sleep out the 30 s timeout
    assert woke and woke[0] - released < 5 and sleepers[1] == 0


@needs_futex
def test_ping_pong_through_sleeps_loses_no_wakeup():
    """Two threads hand a step back and forth 2000 times, each waiting only by sleeping (one
    poll, then sleep_until with a 20 s timeout): a single lost wake-up (NOTE [sleeping on a
    counter] 2) would stall the run for 20 s."""
    steps, sleepers = _board()
    rounds = 2000
    stalls = []

    def player(me: int):
        other = 1 - me
        nap = _timespec(20.0)
        for k in range(1, rounds + 1):
            if me == 1 or k > 1:  # player 0 opens
                target = k if me == 1 else k - 1
                while not spin_until(steps[other:other + 1], target, 1):
                    t0 = time.monotonic()
                    sleep_until(steps[other:other + 1], sleepers[other:other + 1], target, nap)
                    if time.monotonic() - t0 > 10:
                        stalls.append(k)
            release_step(steps, sleepers, me, k)

    threads = [threading.Thread(target=player, args=(me,), daemon=True) for me in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not stalls
    assert steps.tolist() == [rounds, rounds] and not sleepers.any()
    assert time.monotonic() - start < 60


def test_yield_until_returns_once_every_counter_is_there_and_gives_up_after_its_yields():
    steps, _ = _board(3)
    steps[:] = (4, 5, 3)
    assert not yield_until(steps, 4, 8, 16)  # rank 2 is behind: every yield spent, then False
    steps[2] = 4
    assert yield_until(steps, 4, 8, 0)

    # A peer thread that gets there while this one yields: the yields let it run.
    steps[:] = 0
    seen = []

    def peer():
        time.sleep(0.01)
        release_step(steps, _board(3)[1], 1, 1)
        release_step(steps, _board(3)[1], 2, 1)

    steps[0] = 1
    t = threading.Thread(target=peer)
    t.start()
    while not seen:
        if yield_until(steps, 1, 64, 1000):
            seen.append(True)
    t.join()
    assert steps.tolist() == [1, 1, 1]


@given(st.lists(st.integers(-(2 ** 63), 2 ** 63 - 1), min_size=1, max_size=24), st.data())
def test_a_signature_digest_is_the_same_for_equal_signatures_and_differs_for_others(words, data):
    # NOTE [agreement across nodes] 4 in comm/transports/shm.py: the exchange across nodes
    # compares digests, so equal signatures must digest alike (a copy, another process) and a
    # change of any one word, or two different words swapped, must change the digest.
    sig = np.array(words, np.int64)
    assert sig_digest(sig) == sig_digest(sig.copy())
    i = data.draw(st.integers(0, len(words) - 1))
    other = sig.copy()
    other[i] = np.int64(data.draw(st.integers(-(2 ** 63), 2 ** 63 - 1).filter(lambda v: v != words[i])))
    assert sig_digest(other) != sig_digest(sig)
    j = data.draw(st.integers(0, len(words) - 1))
    if sig[i] != sig[j]:
        swapped = sig.copy()
        swapped[[i, j]] = swapped[[j, i]]
        assert sig_digest(swapped) != sig_digest(sig)
    table = np.stack([sig, other])
    out = np.full((3, 2), -1, np.int64)
    sig_digests(table, out, 0)
    assert out[0, 0] == sig_digest(sig) and out[1, 0] == sig_digest(other) and (out[2] == -1).all()
