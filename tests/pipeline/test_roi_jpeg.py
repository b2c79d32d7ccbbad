"""The libjpeg-turbo region decoder: same pixels as Pillow's decode, declines what it can't do,
and a FastLoader using it yields the same bytes as one decoding every image with Pillow."""

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import (
    CenterCrop,
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    SampleError,
    decode,
    roi_jpeg,
)


def test_the_shim_is_built_and_used():
    # setup.py builds it on any machine with a C compiler and libjpeg's headers (make setup);
    # everything else here is void without it, so its absence is a failure, not a skip.
    assert roi_jpeg.available(), "terrapipe/pipeline/_jpeg.c was not built (pip install -e .)"
    assert roi_jpeg.enabled()


def _photo(seed, w, h):
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    f = g.uniform(0.02, 0.3, (3, 2))
    img = np.stack([120 + 60 * np.sin(xx * f[c, 0] + c) * np.cos(yy * f[c, 1]) for c in range(3)], -1)
    img += g.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _jpeg(arr, **kw):
    b = io.BytesIO()
    Image.fromarray(arr).save(b, "JPEG", **kw)
    return b.getvalue()


@settings(deadline=None)  # examples: the profile's (tests/conftest.py; fewer in CI)
@given(w=st.integers(1, 260), h=st.integers(1, 260), sub=st.sampled_from([0, 1, 2]),
       progressive=st.booleans(), gray=st.booleans(), seed=st.integers(0, 1000), data=st.data())
def test_region_pixels_are_those_of_pillows_decode(w, h, sub, progressive, gray, seed, data):
    img = _photo(seed, w, h)
    payload = _jpeg(img[..., 0] if gray else img, quality=90, subsampling=sub, progressive=progressive)
    dec = roi_jpeg.RoiDecoder()
    assert dec.header(payload) == (w, h)
    bx0 = data.draw(st.floats(0, w - 0.5))
    by0 = data.draw(st.floats(0, h - 0.5))
    box = (bx0, by0, data.draw(st.floats(bx0 + 0.5, w)), data.draw(st.floats(by0 + 0.5, h)))
    out_hw = (data.draw(st.integers(1, 64)), data.draw(st.integers(1, 64)))
    got = dec.decode(box, out_hw)
    assert got is not None, dec.message()
    pixels, ox, oy, sw, sh, sbox = got
    denom = decode.draft_scale(w, h, box, out_hw)
    im = Image.open(io.BytesIO(payload))
    if denom > 1:
        im.draft("RGB", (w // denom, h // denom))
    ref = np.asarray(im.convert("RGB"))
    assert ref.shape[:2] == (sh, sw)
    rh, rw = pixels.shape[:2]
    assert sbox[0] >= ox and sbox[1] >= oy and sbox[2] <= ox + rw and sbox[3] <= oy + rh
    window = ref[oy:oy + rh, ox:ox + rw]
    # At an interior edge of the region, chroma upsampling lacks its neighbour: the outermost
    # decoded pixel may differ (the loader never reads it). Everything else is exact.
    left, top = int(ox > 0), int(oy > 0)
    right, bottom = rw - int(ox + rw < sw), rh - int(oy + rh < sh)
    np.testing.assert_array_equal(pixels[top:bottom, left:right, :3], window[top:bottom, left:right])


def test_declines_what_pillow_must_decode():
    g = np.random.default_rng(0)
    rgb = _photo(0, 300, 200)
    good = _jpeg(rgb)
    dec = roi_jpeg.RoiDecoder()
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    cmyk = io.BytesIO()
    Image.fromarray(g.integers(0, 256, (200, 300, 4), dtype=np.uint8), "CMYK").save(cmyk, "JPEG")
    for payload in (png.getvalue(), cmyk.getvalue(), b"", b"\xff\xd8\xff", b"garbage" * 9):
        assert dec.header(payload) is None
    # Truncated data is declined at the header, wherever the cut (no end-of-image marker), so
    # Pillow names it whatever region a crop would have read.
    for cut in (len(good) // 2, 2, 1):
        assert dec.header(good[:-cut]) is None
        assert "truncated" in dec.message()
    # Bytes after the end-of-image marker are no truncation: the shim still decodes it.
    assert dec.header(good + b"\0" * 64 + b"trailer") == (300, 200)
    assert dec.decode((0.0, 0.0, 300.0, 200.0), (200, 300)) is not None
    # The handle is fine afterwards, and a header that is never decoded is dropped cleanly.
    assert dec.header(good) == (300, 200)
    assert dec.header(good) == (300, 200)
    assert dec.decode((0.0, 0.0, 300.0, 200.0), (200, 300)) is not None
    with pytest.raises(RuntimeError, match="header"):
        dec.decode((0.0, 0.0, 300.0, 200.0), (200, 300))


@pytest.mark.parametrize("compiled_fill", ["1", "0"])
def test_a_truncated_jpeg_is_named_whatever_the_crop_reads(tmp_path, monkeypatch, compiled_fill):
    # Regression: a region decode stops below the crop, so a file cut short after the crop's
    # rows decoded without a word under Resize + CenterCrop, and failed or not epoch by epoch
    # under RandomResizedCrop; Pillow, which reads the whole file, names every one of them.
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", compiled_fill)
    good = _jpeg(_photo(5, 320, 240), quality=90)
    cuts = (2, 10, 300, len(good) // 3)
    for k, cut in enumerate(cuts):
        (tmp_path / f"only{k}" / "c").mkdir(parents=True)
        (tmp_path / f"only{k}" / "c" / f"cut{k}.jpg").write_bytes(good[:-cut])
        (tmp_path / "all" / "c").mkdir(parents=True, exist_ok=True)
        (tmp_path / "all" / "c" / f"cut{k}.jpg").write_bytes(good[:-cut])
    (tmp_path / "all" / "c" / "whole.jpg").write_bytes(good)
    for transforms in ([Resize(80), CenterCrop(64)], [RandomResizedCrop(64, scale=(0.05, 0.2))]):
        for k in range(len(cuts)):
            with FastLoader(ImageFolder(tmp_path / f"only{k}"), transforms, batch_size=1) as loader:
                with pytest.raises(SampleError, match=rf"sample 0 \(.*cut{k}.jpg\).*truncated"):
                    next(iter(loader))
        ds = ImageFolder(tmp_path / "all")
        for seed in range(3):  # crops elsewhere each time: the same samples are bad
            with FastLoader(ds, transforms, batch_size=2, num_threads=2, on_error="skip",
                            seed=seed) as loader:
                assert sum(len(y) for _, y in loader) == len(ds)
                assert sorted(i for i, _, _ in loader.skipped) == list(range(len(cuts)))


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    """JPEGs of every kind the shim decodes or declines, and a PNG."""
    root = tmp_path_factory.mktemp("jpegs")
    g = np.random.default_rng(3)
    (root / "a").mkdir()
    (root / "b").mkdir()
    k = 0
    for w, h in [(500, 375), (375, 500), (97, 61), (13, 200), (640, 480), (230, 230), (9, 9)]:
        for sub in (0, 1, 2):
            for progressive in (False, True):
                img = _photo(k, w, h)
                (root / "ab"[k % 2] / f"{k:03d}.jpg").write_bytes(
                    _jpeg(img, quality=int(g.integers(60, 98)), subsampling=sub, progressive=progressive))
                k += 1
    (root / "a" / "gray.jpg").write_bytes(_jpeg(_photo(99, 300, 200)[..., 0]))
    # Scrambled entropy-coded bytes that Pillow still decodes: a garbled picture, which both
    # decoders must garble alike.
    for start in range(3000, 20000, 211):
        bad = bytearray(_jpeg(_photo(97, 300, 200)))
        for i in range(start, start + 40):
            bad[i] = (bad[i] * 7 + 3) & 0xFF
        try:
            Image.open(io.BytesIO(bytes(bad))).load()
        except OSError:
            continue
        (root / "a" / "scrambled.jpg").write_bytes(bytes(bad))
        break
    else:
        raise AssertionError("no scrambling that Pillow decodes")
    Image.fromarray(g.integers(0, 256, (80, 90, 4), dtype=np.uint8), "CMYK").save(root / "b" / "cmyk.jpg")
    Image.fromarray(_photo(98, 120, 90)).save(root / "b" / "image.png")
    return root


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("transforms", [
    [RandomResizedCrop(64), RandomHorizontalFlip(), Normalize(MEAN, STD)],
    [RandomResizedCrop(224, scale=(0.02, 1.0))],
    [RandomResizedCrop((24, 40), scale=(0.5, 1.0))],  # big boxes for small outputs: DCT scaling
    [Resize(72), CenterCrop(64), Normalize(MEAN, STD, dtype=torch.bfloat16)],
])
def test_loader_bytes_are_the_same_with_pillow_decoding(jpeg_folder, monkeypatch, transforms):
    ds = ImageFolder(jpeg_folder)

    def epochs(loader):
        out = []
        with loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                out += [(x.clone(), y.clone()) for x, y in loader]
        return out

    decoded = []
    real_decode = roi_jpeg.RoiDecoder.decode

    def counting_decode(self, box, out_hw):
        got = real_decode(self, box, out_hw)
        decoded.append(got is not None)
        return got

    monkeypatch.setattr(roi_jpeg.RoiDecoder, "decode", counting_decode)
    # The per-sample path, whose decode() calls are counted here (the compiled fill calls the
    # shim itself: tests/pipeline/test_compiled_fill.py compares it with this path).
    monkeypatch.setenv("TERRAPIPE_COMPILED_FILL", "0")
    ours = epochs(FastLoader(ds, transforms, batch_size=8, shuffle=True, num_threads=3))
    # Every JPEG but the CMYK one went through the shim (the PNG never reaches decode()), in
    # both epochs; at the second's end the loader had also begun the first batches of a third
    # (NOTE [the next epoch's first batches]), which close() cancelled or let finish.
    assert len(decoded) >= 2 * (len(ds) - 2) and all(decoded)
    monkeypatch.setenv("TERRAPIPE_JPEG", "pillow")
    assert not roi_jpeg.enabled()
    ref = epochs(FastLoader(ds, transforms, batch_size=8, shuffle=True, num_threads=3))
    assert len(ours) == len(ref)
    for (x, y), (rx, ry) in zip(ours, ref, strict=True):
        assert torch.equal(y, ry)
        assert torch.equal(x, rx)


def test_a_huge_region_does_not_stay_in_the_thread(monkeypatch):
    monkeypatch.setattr(roi_jpeg, "_KEEP_BYTES", 100 * 100 * 4)
    dec = roi_jpeg.RoiDecoder()
    small, big = _jpeg(_photo(1, 64, 48)), _jpeg(_photo(2, 300, 200))
    for payload, size in ((small, (64, 48)), (big, (300, 200)), (small, (64, 48))):
        assert dec.header(payload) == size
        pixels = dec.decode((0.0, 0.0, float(size[0]), float(size[1])), (size[1], size[0]))[0]
        np.testing.assert_array_equal(pixels[..., :3], np.asarray(Image.open(io.BytesIO(payload))))
        assert dec._buf.size <= 100 * 100 * 4


def test_a_source_may_hand_out_any_bytes_like_payload(jpeg_folder):
    folder = ImageFolder(jpeg_folder)

    class Views:
        def __len__(self):
            return len(folder)

        def read(self, i):
            payload, label = folder.read(i)
            return (bytearray(payload) if i % 2 else memoryview(payload)), label

        def describe(self, i):
            return folder.describe(i)

    transforms = [RandomResizedCrop(32)]
    with (FastLoader(Views(), transforms, batch_size=8) as a,
          FastLoader(folder, transforms, batch_size=8) as b):
        for (x, y), (rx, ry) in zip(a, b, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
