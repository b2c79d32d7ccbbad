"""MPI's C API from compiled code (NOTE [MPI from compiled code] in
comm/transports/mpi_native.py): the pieces that need no second rank. The exchanges themselves run
in every test across emulated nodes (tests/comm/test_collectives.py runs the four-node one both
ways: compiled, and through mpi4py)."""

import types

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from terrapipe.comm.transports import mpi_native


@given(st.integers(0, 5000), st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_the_reduce_scatter_blocks_partition_the_payload_and_each_round_joins_two_siblings(m, p):
    # After every round, each rank's block is its own and its peer's (rank ^ k) halves: the
    # blocks of the ranks of a group of k tile the block of their group, and after the last
    # round the blocks of all ranks tile [0, m), each once (what the allgather sends back).
    k = p >> 1
    final = sorted(mpi_native.halving_block(r, m, k) for r in range(p))
    assert final[0][0] == 0 and final[-1][1] == m
    assert all(a[1] == b[0] for a, b in zip(final, final[1:], strict=False))
    dist = 1
    while dist < p:
        for r in range(p):
            lo, hi = mpi_native.halving_block(r, m, dist >> 1)  # before the round of distance dist
            mine, theirs = mpi_native.halving_block(r, m, dist), mpi_native.halving_block(r ^ dist, m, dist)
            assert sorted([mine, theirs]) == [(lo, lo + (hi - lo) // 2), (lo + (hi - lo) // 2, hi)]
        dist <<= 1


@given(st.integers(-(2 ** 31), 2 ** 31 - 1))
def test_an_mpich_handle_comes_back_as_the_int32_it_is_in_c(value):
    # mpi4py hands out MPICH's handles sign-extended to 64 bits (0x84000002 as 2**64 - ...).
    assert mpi_native._int32(value & 0xFFFFFFFFFFFFFFFF) == value
    assert mpi_native._int32(value & 0xFFFFFFFF) == value


def test_only_int32_handles_are_taken_for_compiled_code():
    MPI = pytest.importorskip("mpi4py.MPI")
    assert mpi_native.supported(MPI) == (MPI._sizeof(MPI.Comm) == 4)
    pointers = types.SimpleNamespace(Comm=1, Datatype=2, Request=3, _sizeof=lambda t: 8)  # Open MPI's
    assert not mpi_native.supported(pointers)


def test_an_exchange_of_one_rank_is_done_at_once_and_leaves_its_state_ready():
    # One rank: no round to run, the table checked against itself.
    MPI = pytest.importorskip("mpi4py.MPI")
    exchange = mpi_native.bind(MPI.COMM_SELF, 7, doubling=False)
    if exchange is None:
        pytest.skip("this MPI's handles are not int32 (the mpi4py path runs)")
    from terrapipe.comm.transports.board import TABLE_COLS

    head = 2 * 8 * TABLE_COLS
    inbox = np.zeros((1, head + 64), np.uint8)
    words = inbox.view(np.int64)
    words[0, 0] = 12345  # the table's one row: a signature's digest, then its rank
    words[0, TABLE_COLS - 1] = 0
    words[0, 2 * TABLE_COLS - 1] = -1  # a padding row
    assert exchange.start(inbox, head, head, None, None, 4) == mpi_native.DONE
    assert exchange.st[0] == 1 and not exchange.st[1:].any()


def test_the_fused_calls_local_wait_is_neither_an_exchange_state_nor_an_mpi_error():
    # Regression: LOCAL_WAIT was -3, which is also minus MPI_ERR_TYPE, how the exchange returns
    # that error: an MPI failure would have been taken for a late local rank.
    from terrapipe.comm.algorithms import oneshot_nodes

    states = {mpi_native.PENDING, mpi_native.DONE, mpi_native.DISAGREE, mpi_native.REDUCE}
    assert len(states) == 4 and min(states) >= 0
    assert oneshot_nodes.LOCAL_WAIT > 0 and oneshot_nodes.LOCAL_WAIT not in states


PAYLOADS = (4 << 10, 8 << 10, 16 << 10, 32 << 10)


@given(st.floats(20e-6, 200e-6), st.floats(0.1e-9, 20e-9), st.floats(1.0, 3.0), st.floats(0.55, 0.95))
# Regression: a crossover of 7744.66 bytes was floored to 7744 before rounding up to 64 bytes.
@example(6.936789328017596e-05, 1.102007161012794e-08, 1.3463134198748263, 0.7185242908052057)
def test_the_halving_threshold_is_where_the_two_algorithms_times_cross(rounds_time, per_byte, more_rounds,
                                                                      fewer_bytes):
    # Times linear in the payload, as a link's are: halving pays more per call (its rounds)
    # and less per byte. Where the lines cross among the measured payloads, the threshold is
    # that crossover rounded up to 64 bytes; past the largest, never (0); below the smallest,
    # extrapolated (at least 64 bytes). Below the threshold doubling is no slower, from it on
    # halving is not.
    from terrapipe.comm.transports.base import halving_threshold

    doubling = [rounds_time + m * per_byte for m in PAYLOADS]
    halving = [more_rounds * rounds_time + fewer_bytes * m * per_byte for m in PAYLOADS]
    crossover = (more_rounds - 1) * rounds_time / ((1 - fewer_bytes) * per_byte)
    got = halving_threshold(PAYLOADS, doubling, halving)
    if crossover >= PAYLOADS[-1]:
        assert got == 0
    else:
        assert got % 64 == 0 and got >= 64
        assert max(crossover, 64) <= got < max(crossover, 64) + 64 + 1e-6


def test_the_halving_threshold_trusts_only_a_lead_that_holds_at_every_larger_payload():
    # A lead at 8 KiB lost again at 16 KiB is noise: the threshold is where halving leads for good.
    from terrapipe.comm.transports.base import halving_threshold

    doubling = [100e-6, 150e-6, 200e-6, 400e-6]
    halving = [150e-6, 140e-6, 220e-6, 300e-6]
    got = halving_threshold(PAYLOADS, doubling, halving)
    assert 16 << 10 < got <= 32 << 10
    assert halving_threshold(PAYLOADS, doubling, [h + 1 for h in halving]) == 0  # never leads
    assert halving_threshold(PAYLOADS, [1e-3] * 4, [1e-6] * 4) == 64  # leads everywhere


@given(st.one_of(st.integers(2, 4096), st.sampled_from([2, 4, 8, 16, 32, 64, 1024])), st.integers(1, 16),
       st.booleans())
def test_an_exchange_carries_what_the_one_shot_sends_and_the_inbox_stays_bounded(nodes, largest, doubling):
    # NOTE [one-shot across nodes] 10-12: between two nodes of several ranks a row half, among
    # a power of two of nodes up to 1 MiB (4 MiB on nodes of one rank) while the inbox (one row
    # per node) stays within its budget, else 64 KiB; the same on every rank of the exchange (it
    # depends on what they share).
    from terrapipe.comm.transports import shm

    doubling = doubling and nodes >= 4 and nodes & (nodes - 1) == 0
    got = shm.payload_bytes(nodes, largest, doubling)
    assert got % 64 == 0 and shm.PAYLOAD_BYTES <= got
    if nodes == 2 and largest > 1:
        assert got == shm.PAIR_PAYLOAD_BYTES
    elif doubling:
        most, budget = ((shm.DOUBLING_ALONE_PAYLOAD_BYTES, shm.INBOX_ALONE_BUDGET_BYTES) if largest == 1
                        else (shm.DOUBLING_PAYLOAD_BYTES, shm.INBOX_BUDGET_BYTES))
        assert got <= most
        assert nodes * got <= budget or got == shm.PAYLOAD_BYTES
        assert got == most or got == shm.PAYLOAD_BYTES or nodes * (got + 64) > budget  # as wide as allowed
        if nodes == 4:
            assert got == most
    else:
        assert got == shm.PAYLOAD_BYTES
