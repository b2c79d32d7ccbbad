"""Datasets for the worker-process tests, in a module the worker process can import (a spawned
process cannot unpickle classes defined in a test's ``python -c`` script)."""

import io
import os
import time

import numpy as np
from PIL import Image

from terrapipe.pipeline import ArrayDataset


class Slow(ArrayDataset):
    """A slow disk: each read sleeps ``delay`` seconds, so the pool is busy when something lands."""

    def __init__(self, images, labels, delay: float = 0.01) -> None:
        super().__init__(images, labels)
        self.delay = delay

    def read(self, i):
        time.sleep(self.delay)
        return super().read(i)


class Jpegs:
    """``n`` encoded JPEGs of varied sizes (a photo-like gradient plus noise), label i % 5; sample
    ``bad`` (if any) is truncated."""

    def __init__(self, n: int, bad: int | None = None) -> None:
        g = np.random.default_rng(1)
        self.blobs = []
        for i in range(n):
            h, w = (int(v) for v in g.integers(40, 120, 2))
            yy, xx = np.mgrid[0:h, 0:w]
            img = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx + yy) % 256)], -1).astype(np.int16)
            img = np.clip(img + g.integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
            b = io.BytesIO()
            Image.fromarray(img).save(b, "JPEG", quality=90)
            data = b.getvalue()
            self.blobs.append(data[: len(data) // 3] if i == bad else data)

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, i: int):
        return self.blobs[i], i % 5

    def describe(self, i: int) -> str:
        return f"jpegs[{i}]"


class Unpicklable(ArrayDataset):
    """Holds an open file: pickling it for a worker process fails."""

    def __init__(self, images, labels) -> None:
        super().__init__(images, labels)
        self.handle = open(os.devnull, "rb")  # noqa: SIM115 (the point: a handle pickle refuses)


class FailsInTheWorker(ArrayDataset):
    """Unpickles only in the process that made it: the worker process's unpickling raises, as a
    dataset whose state needs something only the trainer has (a handle, a module) would."""

    def __init__(self, images, labels) -> None:
        super().__init__(images, labels)
        self.maker = os.getpid()

    def __setstate__(self, state) -> None:
        if state["maker"] != os.getpid():
            raise ValueError("this dataset cannot be rebuilt in another process")
        self.__dict__.update(state)
