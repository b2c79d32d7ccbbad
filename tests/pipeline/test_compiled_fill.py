"""A chunk of files in one compiled call (pipeline/compiled_fill.py): the same bytes and labels
as the per-sample path for every sample, whatever the compiled call leaves to it (a file that
grows its buffers, one the shim declines, one that cannot be read), and the same errors."""

import dataclasses
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

import terrapipe.pipeline.samples as samples
from terrapipe import FastLoader
from terrapipe.pipeline import (
    CenterCrop,
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    SampleError,
    TarShards,
    compiled_fill,
    write_shards,
)
from terrapipe.pipeline.transforms import compile_plan

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _photo(seed, w, h):
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    f = g.uniform(0.02, 0.3, (3, 2))
    img = np.stack([120 + 60 * np.sin(xx * f[c, 0] + c) * np.cos(yy * f[c, 1]) for c in range(3)], -1)
    return np.clip(img + g.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    """JPEGs of many sizes (small ones first, so the threads' buffers must grow), one over the
    compiled fill's first file buffer (1 MiB), and what the shim declines: CMYK, a PNG, a
    truncated JPEG (which Pillow refuses too: read with on_error="skip")."""
    root = tmp_path_factory.mktemp("mixed")
    for c in ("a", "b"):
        (root / c).mkdir()
    sizes = [(31, 17), (64, 48), (120, 90), (257, 193), (500, 375), (375, 500), (900, 640), (1400, 1000)]
    k = 0
    for i, (w, h) in enumerate(sizes * 2):
        img = _photo(i, w, h)
        kw = dict(quality=85, subsampling=i % 3, progressive=i % 4 == 3)
        Image.fromarray(img[..., 0] if i % 5 == 4 else img).save(root / "ab"[k % 2] / f"{k:03d}.jpg", **kw)
        k += 1
    big = np.random.default_rng(7).integers(0, 256, (1100, 1300, 3), dtype=np.uint8)  # noise: ~3 MB
    Image.fromarray(big).save(root / "a" / "big.jpg", quality=98, subsampling=0)
    assert (root / "a" / "big.jpg").stat().st_size > (1 << 20)
    Image.fromarray(_photo(50, 300, 200)).convert("CMYK").save(root / "b" / "cmyk.jpg")
    Image.fromarray(_photo(51, 200, 300)).save(root / "b" / "img.png")
    b = io.BytesIO()
    Image.fromarray(_photo(52, 320, 240)).save(b, "JPEG", quality=90)
    (root / "a" / "truncated.jpg").write_bytes(b.getvalue()[: len(b.getvalue()) * 2 // 3])
    return root


TRANSFORMS = {
    "rrc-flip-f32": ([RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)], {}),
    "resize-center-u8": ([Resize(160), CenterCrop(128)], {}),
    "rrc-bf16-channels-last": ([RandomResizedCrop(96), RandomHorizontalFlip(0.7),
                                Normalize(MEAN, STD, torch.bfloat16)], {"channels_last": True}),
}


def _epochs(ds, transforms, epochs=2, on_error="skip", **kw):
    out = []
    with FastLoader(ds, transforms, batch_size=8, shuffle=True, seed=5, num_threads=2, on_error=on_error,
                    **kw) as loader:
        for e in range(epochs):
            loader.set_epoch(e)
            out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def _same(a, b):
    assert len(a) == len(b)
    for (x, y), (rx, ry) in zip(a, b, strict=True):
        assert torch.equal(y, ry)
        if x.dtype == torch.bfloat16:
            x, rx = x.view(torch.int16), rx.view(torch.int16)
        assert torch.equal(x, rx)


@pytest.fixture
def statuses(monkeypatch):
    """Every status the compiled fill returns, in call order."""
    seen = []
    real = compiled_fill.fill_rows

    def counting(*args):
        real(*args)
        seen.extend(int(s) for s in args[-2])

    monkeypatch.setattr(samples.compiled_fill, "fill_rows", counting)
    return seen


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_the_compiled_fill_writes_the_per_sample_paths_bytes(mixed_folder, monkeypatch, statuses, name):
    assert compiled_fill.available()
    ds = ImageFolder(mixed_folder)
    transforms, kw = TRANSFORMS[name]
    ours = _epochs(ds, transforms, **kw)
    # It took the samples: the two the shim declines (CMYK, PNG) and the truncated one each
    # epoch, and those whose size grew a thread's buffers (most of a first chunk here, which
    # runs from the smallest to the largest), went the per-sample way.
    assert statuses.count(compiled_fill.OK) >= len(ds)
    assert statuses.count(compiled_fill.DECLINED) >= 2 * 3
    assert compiled_fill.UNREAD not in statuses
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", "0")
    seen = len(statuses)
    ref = _epochs(ds, transforms, **kw)
    assert len(statuses) == seen  # the reference never called it
    _same(ours, ref)


def test_a_file_larger_than_the_threads_buffer_grows_it(mixed_folder, statuses):
    ds = ImageFolder(mixed_folder)
    _epochs(ds, TRANSFORMS["resize-center-u8"][0], epochs=3)
    big = [i for i, (p, _) in enumerate(ds.samples) if p.endswith("big.jpg")]
    assert big and statuses.count(compiled_fill.BIG_FILE) >= 1
    # Each thread reads it the slow way at most once, then its buffer holds it.
    assert statuses.count(compiled_fill.BIG_FILE) <= 2


def test_the_worker_process_fills_the_same_way(mixed_folder, monkeypatch):
    ds = ImageFolder(mixed_folder)
    transforms, _ = TRANSFORMS["rrc-flip-f32"]
    ours = _epochs(ds, transforms, epochs=1, workers="process")
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", "0")  # the spawned worker reads it too
    _same(ours, _epochs(ds, transforms, epochs=1, workers="process"))


def test_a_file_gone_since_the_scan_is_named_and_skipped_as_before(mixed_folder, tmp_path, monkeypatch,
                                                                   statuses):
    root = tmp_path / "gone"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(_photo(i, 80, 60)).save(root / c / f"{i}.jpg")
    ds = ImageFolder(root)
    victim = ds.samples[3][0]
    os.remove(victim)
    transforms = [RandomResizedCrop(48)]
    with pytest.raises(SampleError, match=f"sample 3 \\({victim}\\).*FileNotFoundError"):
        _epochs(ds, transforms, epochs=1, on_error="raise")
    assert compiled_fill.UNREAD in statuses
    ours = _epochs(ds, transforms, epochs=1, on_error="skip")
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", "0")
    _same(ours, _epochs(ds, transforms, epochs=1, on_error="skip"))


def test_only_sources_that_read_whole_files_are_compiled(mixed_folder):
    class Decrypting(ImageFolder):
        def read(self, i):
            payload, label = super().read(i)
            return payload, label

    assert ImageFolder(mixed_folder).file_table() is not None
    assert Decrypting(mixed_folder).file_table() is None
    plan = compile_plan([RandomResizedCrop(32)]).with_size((32, 32))
    assert samples.SampleWriter(ImageFolder(mixed_folder), plan, plan.lut, "raise")._files is not None
    assert samples.SampleWriter(Decrypting(mixed_folder), plan, plan.lut, "raise")._files is None


def test_tar_shards_are_read_by_range_the_same_way(mixed_folder, tmp_path, monkeypatch, statuses):
    folder = ImageFolder(mixed_folder)
    shards = TarShards(write_shards(folder.samples, tmp_path / "shards", samples_per_shard=6))
    assert shards.file_table() is not None
    transforms, kw = TRANSFORMS["rrc-flip-f32"]
    ours = _epochs(shards, transforms, **kw)
    assert statuses.count(compiled_fill.OK) >= len(shards)
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", "0")
    ref = _epochs(shards, transforms, **kw)
    _same(ours, ref)
    # The same as the folder's: shards in the folder's order hold the same samples.
    _same(ours, _epochs(folder, transforms, **kw))


def test_a_shard_cut_short_since_indexing_is_named_as_before(mixed_folder, tmp_path, statuses):
    folder = ImageFolder(mixed_folder)
    paths = write_shards(folder.samples, tmp_path / "cut", samples_per_shard=100)
    shards = TarShards(paths)
    last = len(shards) - 1
    with open(paths[0], "r+b") as f:  # the last member loses its tail
        f.truncate(int(shards.offsets[last]) + int(shards.sizes[last]) // 2)
    with pytest.raises(SampleError, match="truncated"):
        _epochs(shards, [RandomResizedCrop(32)], epochs=1, on_error="raise")
    assert compiled_fill.UNREAD in statuses


def test_a_geometry_that_names_no_box_rule_is_left_to_the_per_sample_path(mixed_folder):
    # A geometry of the user's own that sets only its box function: the compiled fill must not
    # draw some other rule's box for it (the plan's rule was the whole image's by default).
    from terrapipe.pipeline.transforms import BOX_UNNAMED, BOX_WHOLE, Transform

    class Corner(Transform):
        stage = RandomResizedCrop.stage

        def declare(self, spec, draft):
            draft.box = lambda w, h, seed, epoch, index: (0.0, 0.0, w / 2, h / 2)
            return dataclasses.replace(spec, out_hw=(32, 32))

    plan = compile_plan([Corner()])
    assert plan.box_kind == BOX_UNNAMED and plan.box_kind not in compiled_fill.BOX_KINDS
    assert samples.SampleWriter(ImageFolder(mixed_folder), plan, plan.lut, "raise")._files is None
    assert compile_plan([Normalize(MEAN, STD)]).box_kind == BOX_WHOLE
