"""The device stage: choosing the GPU, normalizing on the device, the CUDA feed.

The CUDA tests run for real where a GPU is visible and skip elsewhere; the device-side
normalization is plain torch code, so its equality with the CPU path is checked here on any
machine.
"""

import os
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from terrapipe import FastLoader
from terrapipe.kernels.image import build_normalize_lut, normalize_lut
from terrapipe.pipeline import ArrayDataset, Normalize, RandomHorizontalFlip, RandomResizedCrop
from terrapipe.pipeline.device import (
    SlotLedger,
    normalize_into,
    pick_cuda_index,
    resolve_device,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _threads():
    return [t for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]


def _dataset(n=40, seed=0):
    g = np.random.default_rng(seed)
    return ArrayDataset(g.integers(0, 256, (n, 48, 56, 3), dtype=np.uint8), g.integers(0, 10, n))


# -- choosing the device -------------------------------------------------------------------------
def test_cuda_index_rules():
    assert pick_cuda_index(1, 2, local_rank=0, current=0) == 1
    # Round-robin when ranks outnumber GPUs, as TorchMPI did.
    assert [pick_cuda_index(None, 2, r, current=0) for r in range(5)] == [0, 1, 0, 1, 0]
    assert pick_cuda_index(None, 4, None, current=2) == 2
    with pytest.raises(ValueError, match="cuda:2 does not exist"):
        pick_cuda_index(2, 2, None, 0)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        pick_cuda_index(None, 0, None, 0)


def test_cuda_device_without_cuda_fails_at_construction_naming_it():
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        return
    before = len(_threads())
    with pytest.raises(RuntimeError, match="device='cuda'.*CUDA is not available"):
        FastLoader(_dataset(), batch_size=8, device="cuda")
    with pytest.raises(RuntimeError, match="device='cuda:1'"):
        FastLoader(_dataset(), batch_size=8, device=torch.device("cuda", 1))
    assert len(_threads()) == before
    assert resolve_device("cpu") == torch.device("cpu")


# -- device slot bookkeeping --------------------------------------------------------------------
@given(passes=st.lists(st.tuples(st.integers(0, 12), st.lists(st.booleans(), min_size=12, max_size=12)),
                       min_size=1, max_size=6))
def test_slot_ledger_never_reuses_a_slot_the_consumer_still_holds(passes):
    # Drives the ledger exactly as FastLoader.__iter__ does (request; copy the batch if it was
    # not copied ahead; hand out; maybe copy the next one ahead), over passes cut short by
    # ``break``, and keeps a model of what each slot holds.
    ledger = SlotLedger()
    contents: dict[int, tuple[int, int]] = {}
    held: list[tuple[int, tuple[int, int]]] = []  # (slot, (pass, batch)) handed out, newest last
    for p, (length, ahead_ready) in enumerate(passes):
        ledger.start_pass()
        for b in range(length):
            ledger.request()
            held = held[-1:]  # this request releases all but the previous batch
            if not ledger.is_enqueued(b):
                slot, _ = ledger.take(b)
                assert slot not in [s for s, _ in held]
                contents[slot] = (p, b)
            slot = ledger.hand_out(b)
            assert contents[slot] == (p, b)
            held.append((slot, (p, b)))
            for s, batch in held:
                assert contents[s] == batch  # nothing the consumer holds was overwritten
            if ahead_ready[b] and b + 1 < length:
                slot, _ = ledger.take(b + 1)
                assert slot not in [s for s, _ in held]
                contents[slot] = (p, b + 1)


def test_slot_ledger_makes_copies_wait_only_for_slots_that_were_handed_out():
    ledger = SlotLedger()
    ledger.start_pass()
    waits = []
    for b in range(6):
        ledger.request()
        waits.append(ledger.take(b)[1])
        ledger.hand_out(b)
    assert waits == [False, False, False, True, True, True]


# -- normalization on the device, checked against the CPU path ----------------------------------
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16,
                                                          torch.float64]),
       channels_last=st.booleans(), n=st.integers(1, 3))
def test_normalize_into_matches_the_cpu_lookup_table_bit_for_bit(seed, dtype, channels_last, n):
    g = np.random.default_rng(seed)
    mean = g.uniform(0, 1, 3)
    std = g.uniform(0.05, 1, 3)
    hwc = g.integers(0, 256, (n, 9, 11, 3), dtype=np.uint8)
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
            torch.float64: "float64"}[dtype]
    lut = build_normalize_lut(mean, std, name)
    ref = np.empty((n, 3, 9, 11), lut.dtype)
    for i in range(n):
        normalize_lut(hwc[i], lut, ref[i])
    expected = torch.from_numpy(ref)
    if dtype in (torch.float16, torch.bfloat16):
        expected = expected.view(dtype)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous()
    out = torch.empty((n, 3, 9, 11), dtype=dtype).contiguous(memory_format=fmt)
    work = torch.empty_like(out, dtype=torch.float32)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    normalize_into(out, images, m, s, work)
    assert out.is_contiguous(memory_format=fmt)
    assert torch.equal(out, expected)


def test_normalize_into_needs_a_float32_work_buffer_for_16_bit_output():
    out = torch.empty((1, 3, 2, 2), dtype=torch.float16)
    with pytest.raises(ValueError, match="work"):
        normalize_into(out, torch.zeros((1, 3, 2, 2), dtype=torch.uint8), torch.zeros(1), torch.ones(1))


@pytest.mark.parametrize("transforms", [
    [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(MEAN, STD)],
    [RandomResizedCrop(24), Normalize(MEAN, STD, dtype=torch.bfloat16)],
    [RandomResizedCrop(24)],
])
def test_channels_last_on_the_cpu_has_the_same_values(transforms):
    ds = _dataset()
    with FastLoader(ds, transforms, batch_size=8, seed=3, copy=True) as a, \
            FastLoader(ds, transforms, batch_size=8, seed=3, channels_last=True) as b:
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert xb.is_contiguous(memory_format=torch.channels_last)
            assert xb.dtype == xa.dtype and torch.equal(xa, xb) and torch.equal(ya, yb)


# -- the CUDA feed (real GPU only) --------------------------------------------------------------
def _cpu_batches(ds, transforms, **kw):
    with FastLoader(ds, transforms, copy=True, **kw) as loader:
        return list(loader)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, None])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_batches_equal_the_cpu_path(dtype, channels_last):
    ds = _dataset()
    transforms = [RandomResizedCrop(24), RandomHorizontalFlip()] + (
        [Normalize(MEAN, STD, dtype=dtype)] if dtype is not None else [])
    ref = _cpu_batches(ds, transforms, batch_size=6, seed=1)
    with FastLoader(ds, transforms, batch_size=6, seed=1, device="cuda",
                    channels_last=channels_last) as loader:
        got = [(x.cpu(), y.cpu(), x.device, x.is_contiguous(memory_format=torch.channels_last))
               for x, y in loader]
    assert len(got) == len(ref)
    for (x, y, dev, cl), (rx, ry) in zip(got, ref, strict=True):
        assert dev.type == "cuda" and (cl or not channels_last)
        assert x.dtype == rx.dtype and torch.equal(x, rx) and torch.equal(y, ry)


@cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_batches_from_a_worker_process_equal_the_cpu_path(channels_last):
    # workers="process": the host slots are shared memory this process pinned with
    # cudaHostRegister (NOTE [the loader's worker process]); unpinned at close.
    ds = _dataset(n=50)
    transforms = [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(MEAN, STD, dtype=torch.float16)]
    ref = _cpu_batches(ds, transforms, batch_size=6, seed=3)
    with FastLoader(ds, transforms, batch_size=6, seed=3, device="cuda", channels_last=channels_last,
                    workers="process") as loader:
        assert all(t.is_pinned() for t in loader._feed.host_images + loader._feed.host_labels)
        got = [(x.cpu(), y.cpu()) for x, y in loader]
        got += [(x.cpu(), y.cpu()) for x, y in loader]  # a second epoch (same seed and epoch: same)
        feed = loader._feed
    assert not any(t.is_pinned() for t in feed.host_images)
    assert len(got) == 2 * len(ref)
    for (x, y), (rx, ry) in zip(got, ref + ref, strict=True):
        assert x.dtype == rx.dtype and torch.equal(x, rx) and torch.equal(y, ry)


@cuda
@pytest.mark.parametrize("workers", ["threads", "process"])
def test_cuda_slow_consumer_never_sees_a_batch_overwritten(workers):
    # The consumer's stream sleeps on the GPU before reading each batch, while its Python thread
    # races ahead and requests more: a copy into a slot still in use would change the sums.
    ds = _dataset(n=64)
    transforms = [RandomResizedCrop(24), Normalize(MEAN, STD)]
    ref = _cpu_batches(ds, transforms, batch_size=4, seed=2)
    sums, held = [], []
    with FastLoader(ds, transforms, batch_size=4, seed=2, device="cuda", prefetch=2,
                    workers=workers) as loader:
        for k, (x, y) in enumerate(loader):
            torch.cuda._sleep(20_000_000)
            sums.append((x.double().sum(), y.sum()))
            held.append(x)
            if len(held) == 2:  # the previous batch is still the consumer's: check it on the host
                time.sleep(0.005)
                assert torch.equal(held[0].cpu(), ref[k - 1][0])
                held.pop(0)
    assert len(sums) == len(ref)
    for (s, ls), (rx, ry) in zip(sums, ref, strict=True):
        assert s.item() == pytest.approx(rx.double().sum().item(), rel=1e-12, abs=1e-9)
        assert ls.item() == ry.sum().item()


@cuda
def test_cuda_consumer_on_a_side_stream():
    ds = _dataset()
    transforms = [RandomResizedCrop(24), Normalize(MEAN, STD)]
    ref = _cpu_batches(ds, transforms, batch_size=8, seed=4)
    stream = torch.cuda.Stream()
    results = []
    with torch.cuda.stream(stream), FastLoader(ds, transforms, batch_size=8, seed=4, device="cuda") as loader:
        for x, _ in loader:
            torch.cuda._sleep(10_000_000)
            results.append(x * 1.0)  # enqueued on `stream`, ordered after the copy
    stream.synchronize()
    for got, (rx, _) in zip(results, ref, strict=True):
        assert torch.equal(got.cpu(), rx)


@cuda
def test_cuda_close_mid_epoch_and_a_second_epoch_after_break():
    ds = _dataset(n=80)
    transforms = [RandomResizedCrop(24), Normalize(MEAN, STD)]
    ref = _cpu_batches(ds, transforms, batch_size=8, seed=5)
    loader = FastLoader(ds, transforms, batch_size=8, seed=5, device="cuda", copy=True)
    it = iter(loader)
    first = next(it)[0]
    next(it)
    del it  # break: the copy issued ahead is abandoned
    again = [x.cpu() for x, _ in loader]  # a new pass starts from batch 0
    assert torch.equal(first.cpu(), ref[0][0])
    assert all(torch.equal(a, r) for a, (r, _) in zip(again, ref, strict=True))
    it = iter(loader)
    next(it)
    loader.close()
    assert not _threads()
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(loader))


def _loader_nice(loader):
    next(iter(loader))  # the pool starts its threads on the first batch
    return {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in _threads()}


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_cpu_loader_threads_keep_the_consumers_priority():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with FastLoader(_dataset(), [RandomResizedCrop(16)], batch_size=8, num_threads=2) as loader:
        assert _loader_nice(loader) == {mine}


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_cpu_loader_threads_yield_the_cpu_when_asked():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with FastLoader(_dataset(), [RandomResizedCrop(16)], batch_size=8, num_threads=2,
                    yield_cpu=True) as loader:
        assert _loader_nice(loader) == {min(19, mine + 10)}


@cuda
def test_cuda_loader_threads_yield_the_cpu_to_the_consumer():
    # NOTE [loader threads yield the CPU]
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with FastLoader(_dataset(), [RandomResizedCrop(16)], batch_size=8, num_threads=2,
                    device="cuda") as loader:
        assert _loader_nice(loader) == {min(19, mine + 10)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
