"""The staging gate (NOTE [staging gate] in comm/message.py), checked on the host at 1, 2 and 4 ranks.

A stand-in for device memory: a source element shows up in the host views only when the
reduction asks for it with ``ready``, and the result is "copied back" exactly as it is in the
host views when ``wrote`` says it is final. Reading before ``ready`` reads NaN; calling ``wrote``
too early uploads an unfinished result: either way the uploaded result differs from NumPy's.

The rows' protocol (NOTE [staged rows] in comm/algorithms/staged_rows.py) is played by a copy
thread that runs each queued copy later, in queue order, as a CUDA stream does: a reduction that
read a row before ``wait_in``, queued a download into a half still being read, or returned
before ``settle`` reads or uploads the wrong values.
"""

import os
import queue
import threading
import time
from collections import deque

import numpy as np
import pytest

import terrapipe.comm as comm
from terrapipe.comm import select
from terrapipe.comm.collectives import _Sig
from terrapipe.kernels import reduce as kreduce
from terrapipe.kernels.floats import BF16, F16


class DeviceStandIn:
    def __init__(self, device: list[np.ndarray]) -> None:
        self.device = device
        fill = np.nan if device[0].dtype.kind == "f" else 0xFFFF  # 16-bit bits: a NaN pattern
        self.views = [np.full_like(d, fill) for d in device]  # host memory before any download
        self.offsets = np.concatenate([[0], np.cumsum([d.shape[0] for d in device])])
        self.n = int(self.offsets[-1])
        self.uploaded = [np.full_like(d, fill) for d in device]
        self.ready_calls: list[int] = []
        self.wrote_calls: list[int] = []

    def _copy(self, lo: int, hi: int, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
        for i in range(len(src)):
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i + 1])
            if b > a:
                o = self.offsets[i]
                dst[i][a - o:b - o] = src[i][a - o:b - o]

    def ready(self, upto: int) -> None:
        done = self.ready_calls[-1] if self.ready_calls else 0
        assert upto >= done, "ready() went backwards"
        self._copy(done, upto, self.device, self.views)
        self.ready_calls.append(upto)

    def wrote(self, upto: int) -> None:
        done = self.wrote_calls[-1] if self.wrote_calls else 0
        assert upto >= done, "wrote() went backwards"
        self._copy(done, upto, self.views, self.uploaded)
        self.wrote_calls.append(upto)

    # -- the rows' protocol: copies on a thread, later, in order ----------------------------------
    def pin(self, address: int, nbytes: int) -> None:
        self.pinned = (address, nbytes)
        self.stream: queue.Queue = queue.Queue()
        self.arrivals: deque = deque()
        self.landed = None
        self.copied_in: list[int] = []
        self.copied_out: list[int] = []
        self.queued = self.done = 0
        threading.Thread(target=self._run_copies, daemon=True).start()

    def _run_copies(self) -> None:
        while True:
            job = self.stream.get()
            if job is None:
                return
            copy, done = job
            time.sleep(0.002)  # the device is slower than the host asks
            copy()
            self.done += 1
            done.set()

    def _queue(self, copy) -> threading.Event:
        done = threading.Event()
        self.queued += 1
        self.stream.put((copy, done))
        return done

    def _in_pinned(self, arr: np.ndarray) -> None:
        a, n = self.pinned
        assert a <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= a + n, "a copy outside pinned memory"

    def copy_in(self, c0: int, length: int, dst: np.ndarray) -> None:
        self._in_pinned(dst)
        self.copied_in.append(c0)

        def copy() -> None:
            for i in range(len(self.device)):
                a, b = max(c0, self.offsets[i]), min(c0 + length, self.offsets[i + 1])
                if b > a:
                    o = self.offsets[i]
                    dst[a - c0:b - c0] = self.device[i][a - o:b - o]
        self.arrivals.append(self._queue(copy))

    def wait_in(self) -> None:
        assert self.arrivals.popleft().wait(60)

    def copy_out(self, c0: int, src: np.ndarray) -> None:
        self._in_pinned(src)
        self.copied_out.append(c0)

        def copy() -> None:
            for i in range(len(self.device)):
                a, b = max(c0, self.offsets[i]), min(c0 + src.shape[0], self.offsets[i + 1])
                if b > a:
                    o = self.offsets[i]
                    self.uploaded[i][a - o:b - o] = src[a - c0:b - c0]
        self.landed = self._queue(copy)

    def settle(self) -> None:
        assert self.landed.wait(60)
        self.stream.put(None)


def _tensors(rank: int, sizes: list[int]) -> list[np.ndarray]:
    g = np.random.default_rng(rank)
    return [g.uniform(-1, 1, n).astype(np.float32) for n in sizes]


def _run(g, sizes: list[int], op: str, ckind: int = 0) -> DeviceStandIn:
    r, p = g.rank, g.size
    dev = DeviceStandIn(_tensors(r, sizes))
    sig = _Sig("float32", dev.n, (dev.n, len(sizes)))
    log = g.record_algorithms()
    before = len(log)
    select.allreduce_views(g, dev.views, dev.views, kreduce.op_code(op), 0, ckind, coll="jit_allreduce",
                           sig_buf=sig, gate=dev)
    uploaded = [u.copy() for u in dev.uploaded]  # what the device holds as the call returns
    ran = log[before:]
    if ran and ran[-1][1] == "staged_rows":
        assert dev.done == dev.queued, "returned while copies still read or wrote the rows"
        assert not dev.ready_calls and not dev.wrote_calls  # one protocol per call
        assert sorted(dev.copied_in) == sorted(dev.copied_out) == dev.copied_in and dev.copied_in[0] == 0
    else:
        assert dev.ready_calls[-1] >= dev.n and dev.wrote_calls[-1] >= dev.n
    dev.algorithm = ran[-1][1] if ran else None
    per_rank = [_tensors(q, sizes) for q in range(p)]
    for i in range(len(sizes)):
        stack = np.stack([per_rank[q][i].astype(np.float64) for q in range(p)])
        ref = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0)}[op]
        tol = 2e-2 * p if ckind else 1e-5 * p
        np.testing.assert_allclose(uploaded[i], ref, rtol=tol, atol=tol)
    return dev


def _rows_or_segment(g) -> str:
    """Where a large staged allreduce goes: straight into the rows on one node, the segment
    across nodes (NOTE [algorithm selection] 1 in comm/select.py)."""
    return "staged_rows" if g.nnodes == 1 else "segment"


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=240)
def test_gate_is_asked_before_reading_and_told_only_final_results(mpi_comm):
    g = comm.init(timeout=60)
    _run(g, [1, 100, 37], "sum")  # the one-shot path
    large = _run(g, [5, 1_500_003, 700_001, 3], "avg")  # several chunks: straight through the rows
    _run(g, [1000, 300_000], "sum", ckind=BF16)  # compressed: the segment
    g.use_algorithm("allreduce", "segment")
    through_segment = _run(g, [5, 1_500_003, 700_001, 3], "avg")
    g.use_algorithm("allreduce", None)
    if g.size > 1:
        assert large.algorithm == _rows_or_segment(g) and through_segment.algorithm == "segment"
        # Pipelined: the reduction started before every source was there, and results went back
        # before the end.
        assert through_segment.ready_calls[0] < large.n and through_segment.wrote_calls[0] < large.n
        if g.nnodes == 1:
            assert len(large.copied_in) > 2


@pytest.mark.mpi(ranks=(2, 4), timeout=240)
def test_rows_protocol_in_a_loop_between_other_algorithms(mpi_comm):
    """Staged calls through the rows, back to back and between calls of the segment and the
    one-shot that use the same rows (NOTE [staged rows] 3-4), sizes across chunk boundaries,
    16-bit values, every op."""
    g = comm.init(timeout=60)
    rng = np.random.default_rng(7)
    half = g.shm.row_bytes // 4 // 2  # float32 elements of a chunk; beyond the one-shot's limit
    sizes = [half + 1, 2 * half, 2 * half + 1, 3 * half + 5]
    for i in range(24):
        n = sizes[i % len(sizes)]
        op = ("sum", "avg", "max", "min")[i % 4]
        if i % 3 == 1:  # a host call through the segment, in the same rows
            x = np.full(int(rng.integers(half, 3 * half)), g.rank + 1.0, np.float32)
            g.use_algorithm("allreduce", "segment")
            comm.allreduce(x, "sum", group=g)
            g.use_algorithm("allreduce", None)
            assert (x == sum(range(1, g.size + 1))).all()
        if i % 3 == 2:  # a staged one-shot, in the rows too
            assert _run(g, [10, 990], op).algorithm == ("oneshot" if g.nnodes == 1 else "oneshot_nodes")
        dev = _run(g, [n // 3, n - n // 3], op)
        assert dev.algorithm == _rows_or_segment(g)


@pytest.mark.mpi(ranks=(2,), timeout=180)
def test_rows_protocol_of_16_bit_values(mpi_comm):
    g = comm.init(timeout=60)
    n = g.shm.row_bytes  # 16-bit: four chunks of a row half
    for op in ("sum", "avg"):
        bits = [_tensors(q, [n])[0].astype(np.float16) for q in range(g.size)]
        dev = DeviceStandIn([bits[g.rank].view(np.uint16)])
        sig = _Sig("float16", n, (n, 1))
        log = g.record_algorithms()
        before = len(log)
        select.allreduce_views(g, dev.views, dev.views, kreduce.op_code(op), F16, coll="jit_allreduce",
                               sig_buf=sig, gate=dev)
        assert [a for _, a, _ in log[before:]] == [_rows_or_segment(g)]
        ref = sum(b.astype(np.float32) for b in bits) / (g.size if op == "avg" else 1)
        got = dev.uploaded[0].view(np.float16).astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.mpi(ranks=(2,), timeout=180)
def test_gate_on_the_mpi_path(mpi_comm):
    os.environ["TERRAPIPE_COMM_BACKEND"] = "mpi"
    g = comm.init(timeout=60)
    assert g.force_mpi
    _run(g, [1, 100, 37], "sum")
    _run(g, [5, 1_500_003, 3], "avg")


@pytest.mark.mpi(ranks=(4,), timeout=240, ci_ranks=(), one_node=True)  # make test-full (CI time)
def test_gate_across_emulated_nodes(mpi_comm):
    os.environ["TERRAPIPE_NODE_SIZE"] = "2"
    g = comm.init(timeout=60)
    assert g.nnodes == 2
    _run(g, [7, 100], "sum")
    _run(g, [5, 1_500_003, 3], "avg")

