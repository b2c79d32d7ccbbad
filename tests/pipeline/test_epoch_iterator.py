"""One iterator per epoch (NOTE [one iterator per epoch]) and transforms that declare themselves."""

import gc
import threading

import numpy as np
import pytest
import torch

from terrapipe import FastLoader
from terrapipe.kernels.geometry import resize_center_crop_box
from terrapipe.pipeline import ArrayDataset, CenterCrop, RandomHorizontalFlip, Resize, SampleError, Transform
from terrapipe.pipeline.transforms import SampleSpec, compile_plan

IMGS = np.random.default_rng(0).integers(0, 256, (40, 12, 14, 3), dtype=np.uint8)


def _loader(**kw):
    kw = {"batch_size": 4, "shuffle": True, "seed": 1, "num_threads": 2, **kw}
    return FastLoader(ArrayDataset(IMGS, range(40)), [CenterCrop(8), RandomHorizontalFlip()], **kw)


def _epoch(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_a_second_live_iterator_is_refused():
    with _loader() as L:
        it = iter(L)
        next(it)
        with pytest.raises(RuntimeError, match=r"still live \(epoch 0, 1 of 10 batches"):
            iter(L)
        it.close()
        assert len(_epoch(L)) == 10  # closed: a new pass may start
        it = iter(L)
        for _ in it:
            pass
        assert len(_epoch(L)) == 10  # exhausted: likewise
        for i, _ in enumerate(L):
            if i == 2:
                break
        gc.collect()  # (CPython frees it at once; be explicit for other interpreters)
        assert len(_epoch(L)) == 10  # dropped after break: likewise


def test_the_iterator_captures_epoch_and_seed_when_created():
    with _loader() as L:
        L.set_epoch(3)
        ref = _epoch(L)
        L.set_epoch(3)
        it = iter(L)
        got = [tuple(t.clone() for t in next(it))]
        L.set_epoch(4)  # affects the next iterator only
        L.seed = 99
        got += [(x.clone(), y.clone()) for x, y in it]
        for (a, b), (c, d) in zip(ref, got, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
        assert it.epoch == 3 and it.seed == 1
        L.seed = 1
        assert not torch.equal(torch.cat([y for _, y in _epoch(L)]), torch.cat([y for _, y in ref]))


def test_state_dict_follows_the_live_iterator_and_resume_is_consumed_once():
    with _loader() as L:
        L.set_epoch(2)
        it = iter(L)
        for _ in range(3):
            next(it)
        sd = L.state_dict()
        assert (sd["epoch"], sd["batch"]) == (2, 3)
        ref = _epoch_rest = [(x.clone(), y.clone()) for x, y in it]
        assert L.state_dict()["batch"] == 0  # a finished epoch resumes at its start
        L.set_epoch(3)
        assert (L.state_dict()["epoch"], L.state_dict()["batch"]) == (3, 0)
        it = iter(L)
        next(it)
        it.close()  # stopped early: the state says where, until the next set_epoch
        assert (L.state_dict()["epoch"], L.state_dict()["batch"]) == (3, 1)
    with _loader() as M:
        M.load_state_dict(sd)
        rest = _epoch(M)
        assert len(rest) == 7 and all(torch.equal(a[0], b[0]) for a, b in zip(ref, rest, strict=True))
        assert len(_epoch(M)) == 10  # the resume point served one iterator only
    del _epoch_rest


def test_an_error_ends_the_iterator_and_frees_the_loader():
    class Flaky(ArrayDataset):
        fail = True

        def read(self, i):
            if i == 13 and self.fail:
                raise OSError("disk hiccup")
            return super().read(i)

    ds = Flaky(IMGS, range(40))
    with FastLoader(ds, [CenterCrop(8)], batch_size=4, num_threads=2) as L:
        with pytest.raises(Exception, match="disk hiccup"):
            for _ in L:
                pass
        ds.fail = False
        assert len(_epoch(L)) == 10


def test_pool_threads_never_read_the_loaders_epoch():
    # Regression: pool threads once read the live ``loader.epoch``; a set_epoch() while batches
    # were prefetched gave them the next epoch's crops and flips.
    with _loader(prefetch=6, num_threads=1) as L:
        ref = _epoch(L)
        it = iter(L)
        first = tuple(t.clone() for t in next(it))
        L.set_epoch(1)  # batches 1..6 are queued or being built right now
        got = [first] + [(x.clone(), y.clone()) for x, y in it]
        for (a, _), (b, _) in zip(ref, got, strict=True):
            assert torch.equal(a, b)


class FixedCrop(Transform):
    """A transform written outside terrapipe: the top-left (h, w) corner, no resampling."""

    stage = 0

    def __init__(self, h, w):
        self.h, self.w = h, w

    def declare(self, spec, draft):
        draft.box = lambda w, h, seed, epoch, index: (0.0, 0.0, float(self.w), float(self.h))
        return SampleSpec((self.h, self.w), spec.channels, spec.dtype)


def test_a_new_transform_is_one_class():
    with FastLoader(ArrayDataset(IMGS, range(40)), [FixedCrop(5, 7)], batch_size=8) as L:
        x = torch.cat([b.clone() for b, _ in L])
    assert torch.equal(x, torch.from_numpy(IMGS[:, :5, :7].transpose(0, 3, 1, 2).copy()))


def test_plans_are_immutable_and_transforms_reusable():
    crop = CenterCrop(8)
    with_resize = compile_plan([Resize(10), crop])
    alone = compile_plan([crop])
    assert with_resize.box(14, 12, 0, 0, 0) == resize_center_crop_box(14, 12, 10, 8, 8)
    assert alone.box(14, 12, 0, 0, 0) == resize_center_crop_box(14, 12, 0, 8, 8)
    none = compile_plan([])
    with FastLoader(ArrayDataset(IMGS, range(40)), [], batch_size=8) as L:
        assert L.plan.out_hw == (12, 14) and none.out_hw is None
    with pytest.raises(AttributeError):
        L.plan.out_hw = (1, 1)
    with pytest.raises(ValueError, match="unsupported transform"):
        compile_plan([lambda x: x])


def test_close_ends_a_live_iterator_and_leaves_no_threads():
    L = _loader()
    it = iter(L)
    next(it)
    L.close()
    assert it.finished
    assert not [t for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]
    with pytest.raises(StopIteration):
        next(it)


# -- NOTE [the next epoch's first batches] -------------------------------------------------------
def _fresh(epoch, **kw):
    """Epoch ``epoch`` from a loader that never ran another: nothing to take over."""
    with _loader(**kw) as L:
        L.set_epoch(epoch)
        return _epoch(L)


def _same(a, b):
    assert len(a) == len(b)
    for (x, y), (u, v) in zip(a, b, strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)


@pytest.mark.parametrize("workers", ["threads", "process"])
def test_the_next_epochs_first_batches_are_taken_over_with_the_same_bytes(workers):
    with _loader(workers=workers) as L:
        for epoch in range(3):
            L.set_epoch(epoch)
            it = iter(L)
            if epoch:  # taken over: the slot sequence runs on, its first batches were submitted
                assert it._base == 10 * epoch and L._next is None and 0 in it._submitted
            got = [(x.clone(), y.clone()) for x, y in it]
            _same(got, _fresh(epoch, workers="threads"))
            # the pass that follows has begun: the next epoch, from its start
            assert L._next is not None and L._next.epoch == epoch + 1 and L._next.submitted == {0, 1, 2}


# The worker process's variants run in make test-full (CI time); CI keeps its take-over test.
PROCESS_IN_FULL = ["threads", pytest.param("process", marks=pytest.mark.full)]


@pytest.mark.parametrize("workers", PROCESS_IN_FULL)
def test_a_pass_other_than_the_expected_one_starts_empty_with_its_own_bytes(workers):
    with _loader(workers=workers) as L:
        _epoch(L)  # epoch 0; epoch 1's first batches submitted
        L.set_epoch(5)
        it = iter(L)
        assert it._submitted == set()  # cancelled, not taken over
        _same([(x.clone(), y.clone()) for x, y in it], _fresh(5))
        L.set_epoch(6)
        _epoch(L)  # took over epoch 6; epoch 7's begun
        state = {**L.state_dict(), "epoch": 7, "consumed": 12}
        L.load_state_dict(state)  # resume inside epoch 7: not the pass begun (from its start)
        _same(_epoch(L), _fresh(7)[3:])
        L.set_epoch(8)
        _epoch(L)
        L.set_world(1, 2)  # another rank's share of epoch 9
        ref = _fresh(9, rank=1, world_size=2)
        L.set_epoch(9)
        _same(_epoch(L), ref)


def test_without_set_epoch_the_same_epoch_is_expected_after_the_second_pass():
    with _loader() as L:
        ref = _fresh(0)
        _same(_epoch(L), ref)
        assert L._next.epoch == 1  # the usual loop calls set_epoch(epoch + 1)
        _same(_epoch(L), ref)  # it did not: epoch 0 again, started empty
        assert L._next.epoch == 0  # from now on the same epoch is expected
        it = iter(L)
        assert it._submitted  # and taken over
        _same([(x.clone(), y.clone()) for x, y in it], ref)


class _FailsOnSecondRead(ArrayDataset):
    """Sample ``bad`` reads once, then raises: epoch 0 reads it, epoch 1 cannot."""

    def __init__(self, images, labels, bad: int) -> None:
        super().__init__(images, labels)
        self.bad, self.reads, self.lock = bad, 0, threading.Lock()

    def read(self, i):
        if i == self.bad:
            with self.lock:
                self.reads += 1
                if self.reads > 1:
                    raise ValueError("unreadable")
        return super().read(i)


def test_an_error_in_the_next_epochs_first_batch_is_raised_by_that_epoch():
    # A sample of epoch 1's first batch that epoch 0 reads in its first 7 batches: those are
    # read before epoch 1's first batch is submitted (at the request of epoch 0's batch 7), so
    # its second read is epoch 1's, whatever the threads' timing.
    order0 = torch.cat([y for _, y in _fresh(0)]).tolist()
    candidates = [int(i) for i in _fresh(1)[0][1] if order0.index(int(i)) < 7 * 4]
    assert candidates, "the seed's orders leave no such sample: pick another seed"
    first = candidates[0]
    ds = _FailsOnSecondRead(IMGS, range(40), bad=first)
    with FastLoader(ds, [CenterCrop(8)], batch_size=4, shuffle=True, seed=1, num_threads=2) as L:
        assert len(_epoch(L)) == 10  # epoch 0 whole, though epoch 1's first batch already failed
        assert L._next is not None and L._next.epoch == 1 and 0 in L._next.submitted
        L.set_epoch(1)
        with pytest.raises(SampleError, match=f"sample {first} .*unreadable"):
            next(iter(L))


def test_skip_mode_submits_nothing_ahead_and_break_cancels_what_was():
    with _loader(on_error="skip") as L:
        _epoch(L)
        assert L._next is None
    with _loader() as L:
        for i, _ in enumerate(L):
            if i == 8:  # the next epoch's begun, then a break before the last batch
                assert L._next is not None and L._next.submitted == {0, 1}
                break
        gc.collect()
        assert L._next is None  # the pass ended early: its batches and the next epoch's cancelled
        L.set_epoch(1)
        _same(_epoch(L), _fresh(1))


@pytest.mark.parametrize("workers", PROCESS_IN_FULL)
def test_cancel_ahead_leaves_the_next_pass_to_start_empty(workers):
    with _loader(workers=workers) as L:
        it = iter(L)
        next(it)
        L.cancel_ahead()  # a live iterator: its own batches stay
        rest = [(x.clone(), y.clone()) for x, y in it]
        assert len(rest) == 9 and L._next is not None
        L.cancel_ahead()
        assert L._next is None
        L.set_epoch(1)
        it = iter(L)
        assert it._submitted == set()  # nothing was taken over
        _same([(x.clone(), y.clone()) for x, y in it], _fresh(1))
        L.cancel_ahead()
        L.cancel_ahead()  # nothing begun: a no-op
