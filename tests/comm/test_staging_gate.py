"""The staging gate (NOTE [staging gate] in comm/message.py), checked on the host at 1, 2 and 4 ranks.

A stand-in for device memory: a source element shows up in the host views only when the
reduction asks for it with ``ready``, and the result is "copied back" exactly as it is in the
host views when ``wrote`` says it is final. Reading before ``ready`` reads NaN; calling ``wrote``
too early uploads an unfinished result: either way the uploaded result differs from NumPy's.
"""

import os

import numpy as np
import pytest

import terrapipe.comm as comm
from terrapipe.comm import select
from terrapipe.comm.collectives import _Sig
from terrapipe.kernels import reduce as kreduce
from terrapipe.kernels.floats import BF16


class DeviceStandIn:
    def __init__(self, device: list[np.ndarray]) -> None:
        self.device = device
        self.views = [np.full_like(d, np.nan) for d in device]  # host memory before any download
        self.offsets = np.concatenate([[0], np.cumsum([d.shape[0] for d in device])])
        self.n = int(self.offsets[-1])
        self.uploaded = [np.full_like(d, np.nan) for d in device]
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


def _tensors(rank: int, sizes: list[int]) -> list[np.ndarray]:
    g = np.random.default_rng(rank)
    return [g.uniform(-1, 1, n).astype(np.float32) for n in sizes]


def _run(g, sizes: list[int], op: str, ckind: int = 0) -> DeviceStandIn:
    r, p = g.rank, g.size
    dev = DeviceStandIn(_tensors(r, sizes))
    sig = _Sig("float32", dev.n, (dev.n, len(sizes)))
    select.allreduce_views(g, dev.views, dev.views, kreduce.op_code(op), 0, ckind, coll="jit_allreduce",
                           sig_buf=sig, gate=dev)
    assert dev.ready_calls[-1] >= dev.n and dev.wrote_calls[-1] >= dev.n
    per_rank = [_tensors(q, sizes) for q in range(p)]
    for i in range(len(sizes)):
        ref = sum(per_rank[q][i].astype(np.float64) for q in range(p)) / (p if op == "avg" else 1)
        tol = 2e-2 * p if ckind else 1e-5 * p
        np.testing.assert_allclose(dev.uploaded[i], ref, rtol=tol, atol=tol)
    return dev


@pytest.mark.mpi(ranks=(1, 2, 4), timeout=240)
def test_gate_is_asked_before_reading_and_told_only_final_results(mpi_comm):
    g = comm.init(timeout=60)
    _run(g, [1, 100, 37], "sum")  # the one-shot path
    large = _run(g, [5, 1_500_003, 700_001, 3], "avg")  # several shared-memory chunks
    _run(g, [1000, 300_000], "sum", ckind=BF16)
    if g.size > 1:
        # Pipelined: the reduction started before every source was there, and results went back
        # before the end.
        assert large.ready_calls[0] < large.n and large.wrote_calls[0] < large.n


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
