import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from terrapipe import FastLoader
from terrapipe.kernels.geometry import random_resized_crop_box
from terrapipe.kernels.image import resize_crop
from terrapipe.pipeline import (
    ArrayDataset,
    CenterCrop,
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    SampleError,
    epoch_indices,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN = [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize(MEAN, STD)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    g = np.random.default_rng(0)
    for name in ["b_cls", "a_cls", "c_cls"]:
        (root / name).mkdir()
        for i in range(7):
            h, w = g.integers(40, 90, 2)
            img = g.integers(0, 256, (h, w, 3), dtype=np.uint8)
            fmt = ["jpg", "png", "jpg"][i % 3]
            Image.fromarray(img).save(root / name / f"{i:02d}.{fmt}")
        Image.fromarray(g.integers(0, 256, (50, 60), dtype=np.uint8)).save(root / name / "gray.jpg")
        cmyk = Image.fromarray(g.integers(0, 256, (50, 60, 4), dtype=np.uint8), "CMYK")
        cmyk.save(root / name / "cmyk.jpg")
    (root / "a_cls" / "notes.txt").write_text("not an image")
    return root


def _threads():
    return [t for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]


def test_imagefolder_classes_sorted_like_torchvision(folder):
    ds = ImageFolder(folder)
    assert ds.classes == ["a_cls", "b_cls", "c_cls"]
    assert len(ds) == 27 and all(p.endswith((".jpg", ".png")) for p, _ in ds.samples)
    assert ds.samples[0][1] == 0 and ds.samples[-1][1] == 2


def test_imagefolder_refuses_an_empty_class_folder_as_torchvision_does(tmp_path):
    # Regression: an empty class folder was kept silently, an index with no samples, where
    # torchvision's ImageFolder raises (a data problem more often than not).
    for c in ("a", "b", "c"):
        (tmp_path / c).mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.jpg")
    Image.new("RGB", (8, 8)).save(tmp_path / "c" / "y.png")
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match=r"class folders b of .*allow_empty"):
        ImageFolder(tmp_path)
    ds = ImageFolder(tmp_path, allow_empty=True)
    assert ds.classes == ["a", "b", "c"] and [label for _, label in ds.samples] == [0, 2]


def test_imagefolder_reads_whole_files_even_when_the_size_changes(folder, tmp_path, monkeypatch):
    import os
    from pathlib import Path

    ds = ImageFolder(folder)
    for i in range(len(ds)):
        assert ds.read(i) == (Path(ds.samples[i][0]).read_bytes(), ds.samples[i][1])
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "empty.jpg").write_bytes(b"")
    (tmp_path / "x" / "big.jpg").write_bytes(bytes(range(256)) * 9000)  # > one 1 MiB read
    small = ImageFolder(tmp_path)
    assert small.read(1)[0] == b""
    big = (tmp_path / "x" / "big.jpg").read_bytes()
    real_fstat = os.fstat
    for wrong in (10, len(big) + 5000):  # grew since fstat / shrank (or a short read)
        monkeypatch.setattr(os, "fstat", lambda fd, n=wrong: type("S", (), {"st_size": n})())
        assert small.read(0)[0] == big
    monkeypatch.setattr(os, "fstat", real_fstat)
    (tmp_path / "x" / "big.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="big.jpg"):
        small.read(0)


def test_batches_shapes_labels_and_dtypes(folder):
    ds = ImageFolder(folder)
    with FastLoader(ds, TRAIN, batch_size=8, num_threads=2) as loader:
        batches = [(x.clone(), y.clone()) for x, y in loader]
    assert len(batches) == len(loader) == 4
    assert [b[0].shape[0] for b in batches] == [8, 8, 8, 3]
    assert batches[0][0].shape[1:] == (3, 32, 32) and batches[0][0].dtype == torch.float32
    labels = torch.cat([b[1] for b in batches])
    assert labels.dtype == torch.int64 and labels.tolist() == ds.targets
    with FastLoader(ds, [Resize(40), CenterCrop(32)], batch_size=8, drop_last=True) as loader:
        xs = [x for x, _ in loader]
    assert len(xs) == 3 and xs[0].dtype == torch.uint8


def test_matches_the_kernel_reference_per_sample():
    g = np.random.default_rng(1)
    imgs = [g.integers(0, 256, (g.integers(20, 60), g.integers(20, 60), 3), dtype=np.uint8)
            for _ in range(10)]
    ds = ArrayDataset(imgs, list(range(10)))
    loader = FastLoader(ds, [Resize(24), CenterCrop(20)], batch_size=4, num_threads=2)
    out = torch.cat([x.clone() for x, _ in loader]).numpy()
    for i, img in enumerate(imgs):
        # Reference: torchvision-style Resize + CenterCrop done by Pillow in two steps.
        h, w = img.shape[:2]
        rw, rh = (24, int(24 * h / w)) if w <= h else (int(24 * w / h), 24)
        r = np.asarray(Image.fromarray(img).resize((rw, rh), Image.BILINEAR))
        top, left = int(round((rh - 20) / 2)), int(round((rw - 20) / 2))
        ref = r[top:top + 20, left:left + 20].transpose(2, 0, 1)
        assert np.abs(out[i].astype(int) - ref).max() <= 3
    loader.close()


@pytest.mark.parametrize("threads", [2, 8])
def test_same_bytes_at_any_thread_count_and_after_resume(folder, threads):
    ds = ImageFolder(folder)
    kw = dict(batch_size=5, shuffle=True, seed=3)
    with FastLoader(ds, TRAIN, num_threads=1, **kw) as one:
        one.set_epoch(2)
        ref = [x.clone() for x, _ in one]
    with FastLoader(ds, TRAIN, num_threads=threads, **kw) as many:
        many.set_epoch(2)
        got = [x.clone() for x, _ in many]
        for a, b in zip(ref, got, strict=True):
            assert torch.equal(a, b)
        # Stop after two batches, save, resume in a fresh loader.
        it = iter(many)
        next(it), next(it)
        state = many.state_dict()
        it.close()
    with FastLoader(ds, TRAIN, num_threads=threads, **kw) as resumed:
        resumed.load_state_dict(state)
        rest = [x.clone() for x, _ in resumed]
    assert len(rest) == len(ref) - 2
    for a, b in zip(ref[2:], rest, strict=True):
        assert torch.equal(a, b)


def test_epochs_differ_and_shards_partition_the_dataset():
    ds = ArrayDataset(np.zeros((23, 4, 4, 3), np.uint8), list(range(23)))
    seen = []
    for rank in range(4):
        with FastLoader(ds, batch_size=3, shuffle=True, seed=5, rank=rank, world_size=4) as loader:
            labels = torch.cat([y.clone() for _, y in loader]).tolist()
            assert len(loader) == 2 and len(labels) == 6
            seen += labels
    assert sorted(set(seen)) == list(range(23)) and len(seen) == 24  # one wrap-around pad
    a = epoch_indices(23, seed=5, epoch=0, shuffle=True, rank=1, world_size=4)
    b = epoch_indices(23, seed=5, epoch=1, shuffle=True, rank=1, world_size=4)
    assert not np.array_equal(a, b)


@given(n=st.integers(1, 200), world=st.integers(1, 8), seed=st.integers(0, 100), shuffle=st.booleans())
def test_order_is_distributed_sampler(n, world, seed, shuffle):
    from torch.utils.data import DistributedSampler

    for rank in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        s.set_epoch(3)
        ours = epoch_indices(n, seed=seed, epoch=3, shuffle=shuffle, rank=rank, world_size=world)
        assert ours.tolist() == list(s)


@given(w=st.integers(1, 2000), h=st.integers(1, 2000), index=st.integers(0, 10**6))
def test_random_resized_crop_box_in_bounds(w, h, index):
    logr = (math.log(3 / 4), math.log(4 / 3))
    x0, y0, x1, y1 = random_resized_crop_box(w, h, 0.08, 1.0, *logr, 0, 0, index, 1)
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    assert x0 == int(x0) and y1 == int(y1)


def test_corrupt_truncated_and_empty_files(folder, tmp_path):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(folder, root)
    good = (root / "a_cls" / "00.jpg").read_bytes()
    (root / "a_cls" / "03.jpg").write_bytes(good[: len(good) // 3])  # truncated
    (root / "b_cls" / "01.png").write_bytes(b"")  # empty
    (root / "c_cls" / "02.jpg").write_bytes(b"garbage" * 50)  # not an image
    ds = ImageFolder(root)
    with FastLoader(ds, TRAIN, batch_size=4, num_threads=2) as loader:
        with pytest.raises(SampleError) as e:
            for _ in loader:
                pass
    bad = {ds.samples.index((str(root / "a_cls" / "03.jpg"), 0))}
    bad |= {i for i, (p, _) in enumerate(ds.samples) if p.endswith(("01.png", "c_cls/02.jpg"))}
    assert e.value.index in bad
    assert ds.describe(e.value.index) in str(e.value)
    # Each says what is wrong with the file, not the in-memory stream Pillow was handed.
    assert "BytesIO" not in str(e.value)
    assert not _threads()
    with FastLoader(ds, TRAIN, batch_size=4, num_threads=2, on_error="skip") as loader:
        n = sum(x.shape[0] for x, _ in loader)
        assert n == len(ds)
        assert sorted(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for _, p, _ in loader.skipped) == [
            "a_cls/03.jpg", "b_cls/01.png", "c_cls/02.jpg"]
        why = {p.rsplit("/", 1)[-1]: text for _, p, text in loader.skipped}
        assert why["01.png"] == "the file is empty (0 bytes)"
        assert why["02.jpg"].startswith("not an image format Pillow reads (350 bytes")


def test_break_and_close_leave_no_threads(folder):
    loader = FastLoader(ImageFolder(folder), TRAIN, batch_size=2, num_threads=3, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    loader.close()
    assert not _threads()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader).__next__()


def test_yielded_views_stay_valid_until_reuse():
    g = np.random.default_rng(2)
    imgs = g.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    with FastLoader(ArrayDataset(imgs, range(40)), batch_size=4, prefetch=2, num_threads=2) as loader:
        it = iter(loader)
        x0, _ = next(it)
        snap = x0.clone()
        next(it)  # the consumer may still hold batch 0 while using batch 1
        assert torch.equal(x0, snap)
    with FastLoader(ArrayDataset(imgs, range(40)), batch_size=4, copy=True) as loader:
        xs = [x for x, _ in loader]
    assert torch.equal(torch.cat(xs), torch.from_numpy(imgs.transpose(0, 3, 1, 2)))


@pytest.mark.parametrize("transforms, channels_last", [
    ([], False),
    ([], True),
    ([Normalize(MEAN, STD)], False),
    ([Normalize(MEAN, STD, dtype=torch.bfloat16)], True),
])
def test_batches_kept_past_the_next_are_never_overwritten(transforms, channels_last):
    # NOTE [batch buffer ownership] 3: list(loader) keeps every batch; each must be its own.
    # Regression: the slots were refilled under the kept tensors, and list(loader) gave the
    # ring's last batches over and over.
    g = np.random.default_rng(3)
    imgs = g.integers(0, 256, (50, 6, 5, 3), dtype=np.uint8)
    kw = dict(transforms=transforms, batch_size=4, prefetch=1, num_threads=2, channels_last=channels_last)
    with FastLoader(ArrayDataset(imgs, range(50)), copy=True, **kw) as loader:
        want = list(loader)
    with FastLoader(ArrayDataset(imgs, range(50)), **kw) as loader:
        for epoch in range(3):  # the slot sequence runs on across passes (clause 1)
            loader.set_epoch(epoch)
            kept = list(loader)
            assert len(kept) == len(want) == 13
            for b, ((x, y), (wx, wy)) in enumerate(zip(kept, want, strict=True)):
                assert torch.equal(x, wx) and torch.equal(y, wy), f"epoch {epoch} batch {b}"
                assert x.is_contiguous(memory_format=torch.channels_last) == channels_last
        # a view is enough to keep the memory: only a row of each batch is held here
        rows = [x[1] for x, _ in loader]
        for b, row in enumerate(rows):
            assert torch.equal(row, want[b][0][1]), f"batch {b}"


def test_a_loop_that_lets_go_of_its_batches_reuses_the_slots():
    # Clause 2's loop gets no new memory: the replacement is only for batches still alive.
    imgs = np.random.default_rng(4).integers(0, 256, (64, 4, 4, 3), dtype=np.uint8)
    with FastLoader(ArrayDataset(imgs, range(64)), batch_size=4, num_threads=2) as loader:
        slots = {loader._feed.images[s].ctypes.data for s in range(len(loader._feed.images))}
        for epoch in range(3):
            loader.set_epoch(epoch)
            held = []
            for x, y in loader:
                held = [x, y]  # the previous batch is let go as the next arrives
                assert x.shape == (4, 3, 4, 4)
            del held
        assert loader._feed.replaced == 0
        assert {loader._feed.images[s].ctypes.data for s in range(len(loader._feed.images))} == slots


def test_without_a_geometry_an_image_of_another_size_is_named_not_squeezed():
    # Regression: with no crop or resize transform, decoded arrays were resampled whole to the
    # first one's size, squeezing other aspect ratios, where DataLoader's collate refuses to
    # stack them (encoded files without a geometry are refused at construction).
    arrays = [np.zeros((8, 9, 3), np.uint8), np.zeros((9, 8, 3), np.uint8), np.zeros((0, 9, 3), np.uint8),
              np.ones((8, 9, 3), np.uint8)]

    class Arrays(torch.utils.data.Dataset):
        def __len__(self):
            return len(arrays)

        def __getitem__(self, i):
            return arrays[i], i

    with FastLoader(Arrays(), batch_size=1) as loader:
        it = iter(loader)
        assert next(it)[0].shape == (1, 3, 8, 9)
        with pytest.raises(SampleError, match=r"sample 1 .*8x9 \(width x height\), the batch.s 9x8"):
            next(it)
    with FastLoader(Arrays(), batch_size=2, on_error="skip") as loader:
        assert [tuple(x.shape) for x, _ in loader] == [(2, 3, 8, 9)] * 2
        why = {i: message for i, _, message in loader.skipped}  # in the order threads met them
        assert sorted(why) == [1, 2] and "one size" in why[1] and "no pixels" in why[2]
    with FastLoader(Arrays(), [RandomResizedCrop(4)], batch_size=1, on_error="skip") as loader:
        assert len(list(loader)) == 4 and [i for i, _, _ in loader.skipped] == [2]


def test_every_argument_of_the_design_documents_call():
    # DESIGN.md's FastLoader call, argument for argument (workers="threads" was refused: the
    # code spelled it "thread", which stays accepted).
    g = np.random.default_rng(5)
    ds = ArrayDataset(g.integers(0, 256, (10, 40, 40, 3), dtype=np.uint8), range(10))
    batches = []
    for workers in ("threads", "thread"):
        with FastLoader(ds, transforms=TRAIN, batch_size=4, shuffle=True, seed=0, drop_last=False,
                        num_threads=None, prefetch=3, device="cpu", rank=None, world_size=None,
                        on_error="raise", workers=workers, decode="cpu", copy=True) as loader:
            assert loader.workers == "threads" and len(loader) == 3
            batches.append(list(loader))
    for (x, y), (u, v) in zip(*batches, strict=True):
        assert torch.equal(x, u) and torch.equal(y, v)
    with pytest.raises(ValueError, match="workers"):
        FastLoader(ds, workers="thread_pool")


def test_one_transform_alone_is_a_chain_of_one_and_a_non_list_is_named():
    # Regression: FastLoader(ds, CenterCrop(8)) raised "'CenterCrop' object is not iterable".
    ds = ArrayDataset(np.random.default_rng(7).integers(0, 256, (4, 20, 20, 3), dtype=np.uint8), range(4))
    with FastLoader(ds, CenterCrop(8), batch_size=2, copy=True) as one, \
            FastLoader(ds, [CenterCrop(8)], batch_size=2, copy=True) as listed:
        for (x, _), (u, _) in zip(one, listed, strict=True):
            assert x.shape == (2, 3, 8, 8) and torch.equal(x, u)
    with pytest.raises(TypeError, match="transforms: expected a list of .* transforms, got int"):
        FastLoader(ds, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size"),
    ({"num_threads": 0}, "num_threads"),
    ({"on_error": "ignore"}, "on_error"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"device": "mps"}, "device"),
    ({"device": "not-a-device"}, "device"),
])
def test_bad_arguments(kwargs, match):
    ds = ArrayDataset(np.zeros((4, 4, 4, 3), np.uint8), range(4))
    with pytest.raises(ValueError, match=match):
        FastLoader(ds, **kwargs)


def test_default_shard_prefers_the_mpi_launchers_variables(monkeypatch):
    # Regression: RANK/WORLD_SIZE inherited from a parent process (0/1) once beat mpiexec's
    # PMI_RANK/PMI_SIZE, so no rank sharded its data.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    ds = ArrayDataset(np.zeros((10, 4, 4, 3), np.uint8), range(10))
    with FastLoader(ds, batch_size=2) as loader:
        assert (loader.rank, loader.world_size, len(loader)) == (1, 2, 3)
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("PMI_SIZE")
    with FastLoader(ds, batch_size=2) as loader:
        assert (loader.rank, loader.world_size) == (0, 1)


def test_bad_transforms_and_datasets():
    with pytest.raises(ValueError, match="size"):
        RandomResizedCrop(0)
    with pytest.raises(ValueError, match="std"):
        Normalize(MEAN, (0.2, 0, 0.2))
    with pytest.raises(ValueError, match=r"dtype must be one of torch.float32, .*got torch.int32"):
        Normalize(MEAN, STD, torch.int32)
    # kept by name (the worker process compiles a plan without torch), given either way
    named, given = Normalize(MEAN, STD, "bfloat16"), Normalize(MEAN, STD, torch.bfloat16)
    assert named.dtype is given.dtype is torch.bfloat16
    with pytest.raises(ValueError, match="empty"):
        ArrayDataset([], [])
    ds = ArrayDataset(np.zeros((4, 4, 4, 3), np.uint8), range(4))
    with pytest.raises(ValueError, match="before"):
        FastLoader(ds, [Normalize(MEAN, STD), RandomResizedCrop(4)])
    with pytest.raises(ValueError, match="CenterCrop"):
        FastLoader(ds, [Resize(4)])


def test_normalize_dtypes_and_grayscale_arrays():
    g = np.random.default_rng(4)
    imgs = g.integers(0, 256, (6, 10, 12), dtype=np.uint8)  # (N, H, W): one channel
    for dtype in (torch.float16, torch.bfloat16):
        tf = [Normalize((0.5,), (0.25,), dtype)]
        with FastLoader(ArrayDataset(imgs, range(6)), tf, batch_size=3) as L:
            x = torch.cat([b.clone() for b, _ in L])
        ref = ((torch.from_numpy(imgs).float() / 255 - 0.5) / 0.25).to(dtype)[:, None]
        assert x.dtype == dtype and torch.equal(x, ref)


def test_resize_crop_reference_agrees_with_loader_on_full_box():
    img = np.random.default_rng(5).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    with FastLoader(ArrayDataset([img], [0]), [CenterCrop((30, 40))], batch_size=1) as L:
        (x, _), = list(L)
    assert np.array_equal(x[0].numpy(), resize_crop(img, (0, 0, 40, 30), (30, 40)))
