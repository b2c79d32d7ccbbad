"""The one-shot allreduce and the step-counter primitives, in one process.

The peers of a one-shot allreduce are simulated: their rows, signatures and step counters are
written into the arrays before the call, as a peer process would have written them. The real
multi-process runs are in tests/comm.
"""

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from terrapipe.kernels import oneshot
from terrapipe.kernels.floats import BF16, F16
from terrapipe.kernels.reduce import AVG, MIN, OPS, PROD, SUM, TILE
from terrapipe.kernels.sync import publish_step, release_step, rows_equal, spin_until

SIG_COL = 8
WORDS = 24
ACC = np.empty(TILE, np.float32)


def _to_f32(bits: np.ndarray, kind: int) -> np.ndarray:
    if kind == F16:
        return bits.view(np.float16).astype(np.float32)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


def _to_16(x: np.ndarray, kind: int) -> np.ndarray:
    if kind == F16:
        return x.astype(np.float32).astype(np.float16).view(np.uint16)
    return torch.from_numpy(x.astype(np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def _fold(rows: np.ndarray, op: int) -> np.ndarray:
    """Row 0 combined with rows 1, 2, ... in order, in the rows' dtype (the kernels' order)."""
    acc = rows[0].copy()
    for r in rows[1:]:
        if op in (SUM, AVG):
            acc = acc + r
        elif op == PROD:
            acc = acc * r
        elif op == MIN:
            acc = np.minimum(acc, r)
        else:
            acc = np.maximum(acc, r)
    return acc


def _reference(rows: np.ndarray, op: int, p: int, kind: int) -> np.ndarray:
    """NumPy result of the allreduce over rows: native dtype, or 16-bit bits (float32 math)."""
    if kind:
        out = _to_16(_fold(np.stack([_to_f32(r, kind) for r in rows]), op), kind)
        if op == AVG:
            out = _to_16(_to_f32(out, kind) / np.float32(p), kind)
        return out
    out = _fold(rows, op)
    if op == AVG:
        out = out // rows.dtype.type(p) if rows.dtype.kind == "i" else out / rows.dtype.type(p)
    return out.astype(rows.dtype)


def _peers(p, me, step, sig, board):
    for q in range(p):
        if q != me:
            board[q, SIG_COL:SIG_COL + WORDS] = sig
            board[q, 0] = step


CASES = st.sampled_from(["float32", "float64", "int32", "int64", "float16", "bfloat16", "compressed"])


@given(p=st.integers(1, 4), n=st.integers(0, TILE + 37), case=CASES, op=st.sampled_from(sorted(OPS.values())),
       data=st.data())
def test_oneshot_matches_numpy_for_every_dtype_and_op(p, n, case, op, data):
    me = data.draw(st.integers(0, p - 1))
    half = data.draw(st.sampled_from([0, 1]))
    kind = {"float16": F16, "bfloat16": BF16}.get(case, 0)
    if case == "compressed":
        kind = data.draw(st.sampled_from([F16, BF16]))
    rng = np.random.default_rng(n * 31 + p)
    row_len = 2 * (n + 3)
    h = half * (row_len // 2)
    if kind:
        rows = np.zeros((p, row_len), np.uint16)
        vals = rng.uniform(-3, 3, (p, n)).astype(np.float32)
        rows[:, h:h + n] = _to_16(vals, kind)
    elif case.startswith("int"):
        rows = np.zeros((p, row_len), case)
        rows[:, h:h + n] = rng.integers(-4, 5, (p, n))
    else:
        rows = np.zeros((p, row_len), case)
        rows[:, h:h + n] = rng.uniform(-3, 3, (p, n))
    expect_rows = rows[:, h:h + n].copy()
    if case == "compressed":
        src = vals[me].copy()  # float32, rounded to 16 bits on the way into the row
    else:
        src = rows[me, h:h + n].copy()
    rows[me] = 0  # the kernel must write its own row from src
    board = np.zeros((p, 64), np.int64)
    sig = np.arange(WORDS, dtype=np.int64) + 7
    step = 11
    _peers(p, me, step, sig, board)
    divisor = p if op == AVG else 1
    scratch = np.zeros_like(rows[0])
    acc = np.empty(TILE, np.float32)
    dst = np.zeros(n, np.float32 if case == "compressed" else rows.dtype)
    state = oneshot.oneshot_allreduce(src, dst, rows, h, me, board, SIG_COL, sig, step, op, divisor, kind,
                                      scratch, acc, 100, 0)
    assert state == -1
    assert board[me, 0] == step and np.array_equal(board[me, SIG_COL:SIG_COL + WORDS], sig)
    np.testing.assert_array_equal(rows[me, h:h + n], expect_rows[me])  # published for the peers
    ref = _reference(expect_rows, op, p, kind)
    if case == "compressed":
        ref = _to_f32(ref, kind)
    np.testing.assert_array_equal(dst, ref)


def _native_call(p=3, me=1, late=None, bad=None):
    rows = np.arange(p * 20, dtype=np.float32).reshape(p, 20)
    board = np.zeros((p, 64), np.int64)
    sig = np.arange(WORDS, dtype=np.int64)
    _peers(p, me, 5, sig, board)
    if late is not None:
        board[late, 0] = 4
    if bad is not None:
        board[bad, SIG_COL + 3] += 1
    src = np.full(10, 2.0, np.float32)
    dst = np.full(10, -1.0, np.float32)
    state = oneshot.oneshot_allreduce(src, dst, rows, 0, me, board, SIG_COL, sig, 5, SUM, 1, 0,
                                      np.zeros(20, np.float32), ACC, 50, 0)
    return state, dst, rows, board


def test_oneshot_reports_a_mismatched_signature_and_reduces_nothing():
    state, dst, _, _ = _native_call(bad=2)
    assert state == 2
    assert np.all(dst == -1.0)
    state, dst, _, _ = _native_call(me=1, bad=0)  # row 0 is the odd one: row 1 differs from it
    assert state == 1 and np.all(dst == -1.0)


def test_oneshot_returns_waiting_then_finish_completes_it():
    state, dst, rows, board = _native_call(late=2)
    assert state == oneshot.WAITING
    assert np.all(dst == -1.0)
    assert board[1, 0] == 5 and np.all(rows[1, :10] == 2.0)  # arrived: published before waiting
    board[2, 0] = 5  # the late peer arrives
    assert spin_until(board[:, 0], 5, 1)
    oneshot.finish(dst, rows, 0, SUM, 1, 0, np.zeros(20, np.float32), ACC)
    np.testing.assert_array_equal(dst, rows[0, :10] + rows[1, :10] + rows[2, :10])


def test_publish_step_writes_the_signature_then_the_step():
    board = np.zeros((3, 64), np.int64)
    board[1, SIG_COL:SIG_COL + WORDS] = 99  # stale words beyond a shorter signature are cleared
    sig = np.arange(5, dtype=np.int64) + 1
    publish_step(board[:, SIG_COL:SIG_COL + WORDS], 1, sig, board[:, 0], board[:, 3], 7)
    assert board[1, 0] == 7
    np.testing.assert_array_equal(board[1, SIG_COL:SIG_COL + WORDS], np.r_[sig, np.zeros(WORDS - 5)])
    assert not board[[0, 2]].any()


def test_rows_equal_names_the_first_differing_row():
    t = np.ones((4, 6), np.int64)
    assert rows_equal(t) == -1
    t[2, 5] = 0
    assert rows_equal(t) == 2
    t[1, 0] = 3
    assert rows_equal(t) == 1
    assert rows_equal(t[:1]) == -1


def test_spin_until_sees_a_store_from_another_thread():
    # A poll the compiler hoisted out of the loop would never see the store and spin for 2**62
    # rounds; the acquire load sees it as soon as the other thread releases it.
    steps = np.zeros(64, np.int64)[::32]  # two counters a cache line apart, as on the board
    steps[0] = 3
    result = []
    waiter = threading.Thread(target=lambda: result.append(spin_until(steps, 3, 2**62)), daemon=True)
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive() and not result  # counter 1 is still behind
    release_step(steps, np.zeros(2, np.int64), 1, 3)
    waiter.join(10)
    assert result == [True]


def test_spin_until_gives_up_after_its_polls():
    steps = np.array([5, 4], np.int64)
    assert not spin_until(steps, 5, 1000)
    assert spin_until(steps, 4, 1)


@pytest.mark.parametrize("spins", [0, 1])
def test_oneshot_with_no_polls_left_waits_even_when_peers_are_there(spins):
    p, me, step = 2, 0, 3
    rows = np.ones((p, 8), np.float64)
    board = np.zeros((p, 64), np.int64)
    sig = np.zeros(WORDS, np.int64)
    _peers(p, me, step, sig, board)
    dst = np.zeros(4)
    state = oneshot.oneshot_allreduce(np.ones(4), dst, rows, 0, me, board, SIG_COL, sig, step, SUM, 1, 0,
                                      np.zeros(8), ACC, spins, 0)
    assert state == (oneshot.WAITING if spins == 0 else -1)
    assert np.all(dst == (0.0 if spins == 0 else 2.0))


@given(p=st.integers(1, 4), n=st.integers(0, 300), case=CASES, op=st.sampled_from(sorted(OPS.values())),
       data=st.data())
def test_oneshot_reduces_only_the_part_it_is_given_and_publishes_the_whole_message(p, n, case, op, data):
    # The one-shot across nodes reduces one local rank's part of the message (lo, len(dst)).
    me = data.draw(st.integers(0, p - 1))
    lo = data.draw(st.integers(0, n))
    m = data.draw(st.integers(0, n - lo))
    kind = {"float16": F16, "bfloat16": BF16, "compressed": F16}.get(case, 0)
    rng = np.random.default_rng(n * 7 + lo)
    row_len, h = 2 * (n + 3), n + 3
    rows = np.zeros((p, row_len), np.uint16 if kind else case)
    vals = rng.integers(-4, 5, (p, n)).astype(np.float32)
    rows[:, h:h + n] = _to_16(vals, kind) if kind else vals.astype(case)
    expect = rows[:, h:h + n].copy()
    src = vals[me].copy() if case == "compressed" else rows[me, h:h + n].copy()
    rows[me] = 0
    board = np.zeros((p, 64), np.int64)
    sig = np.arange(WORDS, dtype=np.int64)
    _peers(p, me, 3, sig, board)
    dst = np.full(m, 99, rows.dtype)  # the part stays in the rows' format: it travels on as is
    state = oneshot.oneshot_allreduce(src, dst, rows, h, me, board, SIG_COL, sig, 3, op, 1, kind,
                                      np.zeros_like(rows[0]), ACC, 100, lo)
    assert state == -1
    np.testing.assert_array_equal(rows[me, h:h + n], expect[me])
    np.testing.assert_array_equal(dst, _reference(expect[:, lo:lo + m], SUM if op == AVG else op, p, kind))


@given(p=st.integers(1, 4), n=st.integers(0, 200), part=st.integers(1, 80),
       case=st.sampled_from(["float32", "int64", "float16", "compressed"]))
def test_collect_gathers_each_rows_own_part(p, n, part, case):
    kind = F16 if case in ("float16", "compressed") else 0
    h = 5
    rng = np.random.default_rng(n + 101 * part)
    vals = rng.integers(-9, 10, (p, h + max(n, 1))).astype(np.float32)
    rows = _to_16(vals, kind) if kind else vals.astype(case)
    dst = np.full(n, 7, np.float32 if case == "compressed" else rows.dtype)
    oneshot.collect(dst, rows, h, part, kind)
    owner = np.minimum(np.arange(n) // part, p - 1)
    want = rows[owner, h + np.arange(n)]
    covered = np.arange(n) < p * part  # beyond p parts nothing is any row's: left alone
    want = np.where(covered, _to_f32(want, kind) if case == "compressed" else want, dst)
    np.testing.assert_array_equal(dst, want)


# -- the one-shot copies: allgather, gather, broadcast (NOTE [one-shot copies]) ----------------

def _copy_call(p, me, n, half, seed, late=None, bad=None):
    """Rows of ``p`` simulated ranks holding their n-byte messages at half ``half``, this rank's
    row cleared (the kernel writes it), the peers arrived with the same signature (but ``late``
    one step behind, ``bad`` with one word changed)."""
    rng = np.random.default_rng(seed)
    row_len = 2 * (n + 5)
    h = half * (row_len // 2)
    rows = rng.integers(0, 256, (p, row_len), dtype=np.uint8)
    msgs = rows[:, h:h + n].copy()
    rows[me] = 0
    board = np.zeros((p, 64), np.int64)
    sig = np.arange(WORDS, dtype=np.int64) + 3
    _peers(p, me, 9, sig, board)
    if late is not None:
        board[late, 0] = 8
    if bad is not None:
        board[bad, SIG_COL + 4] += 1
    return rows, h, msgs, board, sig


@given(p=st.integers(1, 4), n=st.integers(0, 700), half=st.sampled_from([0, 1]), collect=st.booleans(),
       data=st.data())
def test_oneshot_gather_publishes_and_places_every_row_in_rank_order(p, n, half, collect, data):
    me = data.draw(st.integers(0, p - 1))
    order = np.array(data.draw(st.permutations(range(p))), np.int64)  # group rank of each local row
    rows, h, msgs, board, sig = _copy_call(p, me, n, half, n * 13 + p)
    out = np.full((p, n), 0xAB, np.uint8)
    state = oneshot.oneshot_gather(msgs[me].copy(), out, rows, h, me, board, SIG_COL, sig, 9, 100, order,
                                   collect)
    assert state == -1
    assert board[me, 0] == 9 and np.array_equal(board[me, SIG_COL:SIG_COL + WORDS], sig)
    np.testing.assert_array_equal(rows[me, h:h + n], msgs[me])  # published for the peers
    want = np.empty_like(out)
    want[order] = msgs
    np.testing.assert_array_equal(out, want if collect else np.full((p, n), 0xAB, np.uint8))


@given(p=st.integers(1, 4), n=st.integers(0, 700), half=st.sampled_from([0, 1]), data=st.data())
def test_oneshot_broadcast_copies_the_roots_row_and_only_the_root_publishes_data(p, n, half, data):
    me, root = data.draw(st.integers(0, p - 1)), data.draw(st.integers(0, p - 1))
    rows, h, msgs, board, sig = _copy_call(p, me, n, half, n * 7 + p)
    src = msgs[me].copy()
    src.flags.writeable = False  # the root only reads it
    dst = np.full(n, 0xCD, np.uint8)
    state = oneshot.oneshot_broadcast(src, dst, rows, h, me, board, SIG_COL, sig, 9, 100, root)
    assert state == -1 and board[me, 0] == 9
    np.testing.assert_array_equal(dst, msgs[root] if me != root else np.full(n, 0xCD, np.uint8))
    np.testing.assert_array_equal(rows[me, h:h + n], msgs[me] if me == root else np.zeros(n, np.uint8))


def test_oneshot_copies_report_a_mismatch_and_copy_nothing():
    order = np.arange(3, dtype=np.int64)
    rows, h, msgs, board, sig = _copy_call(3, 1, 40, 1, 1, bad=2)
    out = np.zeros((3, 40), np.uint8)
    assert oneshot.oneshot_gather(msgs[1].copy(), out, rows, h, 1, board, SIG_COL, sig, 9, 100, order,
                                  True) == 2
    assert not out.any()
    rows, h, msgs, board, sig = _copy_call(3, 0, 40, 0, 2, bad=1)
    x = msgs[0].copy()
    assert oneshot.oneshot_broadcast(x, x, rows, h, 0, board, SIG_COL, sig, 9, 100, 2) == 1
    np.testing.assert_array_equal(x, msgs[0])


def test_oneshot_copies_wait_for_a_late_peer_then_finish():
    order = np.array([2, 0, 1], np.int64)
    rows, h, msgs, board, sig = _copy_call(3, 1, 33, 0, 3, late=0)
    out = np.zeros((3, 33), np.uint8)
    state = oneshot.oneshot_gather(msgs[1].copy(), out, rows, h, 1, board, SIG_COL, sig, 9, 50, order, True)
    assert state == oneshot.WAITING and not out.any()
    np.testing.assert_array_equal(rows[1, h:h + 33], msgs[1])  # arrived: published before waiting
    board[0, 0] = 9
    oneshot.gather_rows(out, rows, h, order)
    np.testing.assert_array_equal(out[order], msgs)
    rows, h, msgs, board, sig = _copy_call(3, 2, 33, 1, 4, late=1)
    x = msgs[2].copy()
    assert oneshot.oneshot_broadcast(x, x, rows, h, 2, board, SIG_COL, sig, 9, 50, 0) == oneshot.WAITING
    np.testing.assert_array_equal(x, msgs[2])
    oneshot.copy_row(x, rows, h, 0)
    np.testing.assert_array_equal(x, msgs[0])
