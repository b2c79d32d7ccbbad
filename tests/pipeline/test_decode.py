import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from terrapipe.kernels.image import resize_crop
from terrapipe.pipeline import decode


def _encode(arr, fmt, mode=None, **kw):
    b = io.BytesIO()
    im = Image.fromarray(arr, mode) if mode else Image.fromarray(arr)
    if fmt == "PNG-P":
        im, fmt = im.convert("P"), "PNG"
    im.save(b, fmt, **kw)
    return b.getvalue()


@pytest.mark.parametrize("kind", ["rgb_jpeg", "rgb_png", "rgba_png", "gray_jpeg", "cmyk_jpeg", "palette_png"])
def test_pixels_match_pillow_conversion(kind):
    g = np.random.default_rng(0)
    rgb = g.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    payload = {
        "rgb_jpeg": lambda: _encode(rgb, "JPEG", quality=95),
        "rgb_png": lambda: _encode(rgb, "PNG"),
        "rgba_png": lambda: _encode(g.integers(0, 256, (37, 53, 4), dtype=np.uint8), "PNG"),
        "gray_jpeg": lambda: _encode(rgb[..., 0], "JPEG"),
        "cmyk_jpeg": lambda: _encode(g.integers(0, 256, (37, 53, 4), dtype=np.uint8), "JPEG", "CMYK"),
        "palette_png": lambda: _encode(rgb, "PNG-P"),
    }[kind]()
    ref = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB"))
    arr, keep = decode.pixels(decode.open_image(payload))
    assert arr.shape[:2] == (37, 53) and arr.shape[2] in (3, 4)
    np.testing.assert_array_equal(arr[..., :3], ref)


def test_rgb_jpeg_pixels_are_read_in_place():
    payload = _encode(np.full((20, 30, 3), 9, np.uint8), "JPEG")
    arr, keep = decode.pixels(decode.open_image(payload))
    if decode._ZERO_COPY:
        assert arr.shape[2] == 4 and not arr.flags.owndata  # a view of Pillow's buffer


def test_draft_decodes_smaller_and_keeps_the_box():
    yy, xx = np.mgrid[0:800, 0:1200]
    smooth = (np.sin(xx / 40) * np.cos(yy / 30) * 100 + 128).astype(np.uint8)
    img = np.stack([smooth, smooth[::-1], smooth[:, ::-1]], -1)
    payload = _encode(img, "JPEG", quality=95)
    box = (100.0, 50.0, 1100.0, 750.0)
    im = decode.open_image(payload)
    new_box = decode.draft_box(im, box, (64, 64))
    assert im.size == (150, 100)  # 1/8: the 1000x700 box still covers 64x64
    assert new_box == pytest.approx((12.5, 6.25, 137.5, 93.75))
    arr, keep = decode.pixels(im)
    small = resize_crop(np.ascontiguousarray(arr[..., :3]), new_box, (64, 64))
    full = resize_crop(img, box, (64, 64))
    assert np.abs(small.astype(int) - full).mean() < 4  # same picture, DCT-scaled
    # A box that needs full resolution is left alone.
    im2 = decode.open_image(payload)
    assert decode.draft_box(im2, box, (700, 1000)) == box and im2.size == (1200, 800)


@settings(max_examples=80, deadline=None)
@given(w=st.integers(1, 700), h=st.integers(1, 700), data=st.data())
def test_draft_scale_is_the_scale_pillow_picks_for_the_needed_size(w, h, data):
    import math

    payload = _encode(np.zeros((h, w, 3), np.uint8), "JPEG")
    bx0 = data.draw(st.floats(0, w - 0.5))
    by0 = data.draw(st.floats(0, h - 0.5))
    box = (bx0, by0, data.draw(st.floats(bx0 + 0.5, w)), data.draw(st.floats(by0 + 0.5, h)))
    oh, ow = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 300))
    need = (math.ceil(w * ow / (box[2] - box[0])), math.ceil(h * oh / (box[3] - box[1])))
    im = Image.open(io.BytesIO(payload))
    if need[0] < w and need[1] < h:
        im.draft("RGB", need)  # Pillow's own choice for the size the box needs
    denom = decode.draft_scale(w, h, box, (oh, ow))
    assert im.size == (-(-w // denom), -(-h // denom))
