"""Generated ImageNet-like JPEG folders for benchmarks and the demo (no download needed).

Each image is photo-like rather than noise or flat colour, so JPEG sizes and decode costs are
realistic: a smooth illumination field, shapes with hard edges, a mid-frequency texture and sensor
grain; about 500x375 at quality 90 gives files of roughly 110 KB, like ImageNet's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def photo_like(seed: int, w: int = 500, h: int = 375) -> Image.Image:
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        f = g.uniform(0.004, 0.02, 4)
        p = g.uniform(0, 2 * np.pi, 4)
        img[..., c] = (110 + 50 * np.sin(xx * f[0] + p[0]) * np.cos(yy * f[1] + p[1])
                       + 30 * np.sin((xx + yy) * f[2] + p[2]))
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(g.integers(6, 14)):
        x0, y0 = g.integers(0, w), g.integers(0, h)
        x1, y1 = x0 + g.integers(20, 200), y0 + g.integers(20, 160)
        col = tuple(int(v) for v in g.integers(0, 256, 3))
        (draw.ellipse if g.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=col)
    pil = pil.filter(ImageFilter.GaussianBlur(0.8))
    arr = np.asarray(pil).astype(np.float32)
    tex = 36 * np.sin(xx * g.uniform(0.3, 0.6)) * np.sin(yy * g.uniform(0.3, 0.6))
    arr += tex[..., None] + g.normal(0, 20.0, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def make_image_folder(root: str | os.PathLike, n: int, classes: int = 10, seed: int = 0,
                      quality: int = 90) -> Path:
    """Write ``n`` JPEGs into ``root/class_XX/`` unless they are already there; returns root."""
    root = Path(root)
    paths = [root / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg" for i in range(n)]
    todo = [(i, p) for i, p in enumerate(paths) if not p.exists()]
    for c in range(min(classes, n)):  # a folder per class that gets an image: none is empty
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)

    def write(item):
        i, p = item
        tmp = p.with_suffix(".tmp")
        photo_like(seed * 1_000_003 + i).save(tmp, "JPEG", quality=quality)
        tmp.rename(p)  # never leave a half-written file where a reader would pick it up

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(write, todo))
    return root
