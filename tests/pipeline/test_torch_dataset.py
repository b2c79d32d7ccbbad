"""TorchDataset: any map-style torch dataset through FastLoader's compiled transforms."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import (
    ArrayDataset,
    CenterCrop,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    SampleError,
    TorchDataset,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
G = np.random.default_rng(3)
IMGS = [G.integers(0, 256, (int(G.integers(20, 50)), int(G.integers(20, 50)), 3), dtype=np.uint8)
        for _ in range(11)]
JPEGS = []
for img in IMGS:
    b = io.BytesIO()
    Image.fromarray(img).save(b, "JPEG", quality=90)
    JPEGS.append(b.getvalue())


class Items(torch.utils.data.Dataset):
    """Returns sample i in one of the accepted forms."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return len(IMGS)

    def __getitem__(self, i):
        label = [i, np.int64(i), torch.tensor(i)][i % 3]
        if self.kind == "bytes":
            return JPEGS[i], label
        if self.kind == "bytes-tensor":  # what torchvision.io.read_file returns
            return torch.frombuffer(bytearray(JPEGS[i]), dtype=torch.uint8), label
        if self.kind == "pil":
            return Image.fromarray(IMGS[i]), label
        if self.kind == "hwc":
            return IMGS[i], label
        return torch.from_numpy(IMGS[i]).permute(2, 0, 1).contiguous(), label  # chw


TF = [Resize(20), CenterCrop(16), RandomHorizontalFlip(), Normalize(MEAN, STD)]


def _batches(ds, tf=TF, **kw):
    with FastLoader(ds, tf, batch_size=4, shuffle=True, seed=2, num_threads=3, **kw) as L:
        return [(x.clone(), y.clone()) for x, y in L]


@pytest.mark.parametrize("kind", ["pil", "hwc", "chw"])
def test_decoded_items_match_the_array_source(kind):
    ref = _batches(ArrayDataset(IMGS, list(range(len(IMGS)))))
    got = _batches(Items(kind))  # a torch Dataset is wrapped in TorchDataset by FastLoader itself
    assert len(got) == len(ref) == 3
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("kind", ["bytes", "bytes-tensor"])
def test_encoded_items_decode_like_files(kind):
    tf = [RandomResizedCrop(16), RandomHorizontalFlip(), Normalize(MEAN, STD)]

    class Files:
        def __len__(self):
            return len(JPEGS)

        def read(self, i):
            return JPEGS[i], i

        def describe(self, i):
            return f"file{i}"

    ref = _batches(Files(), tf)
    got = _batches(TorchDataset(Items(kind)), tf)
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


class Broken(torch.utils.data.Dataset):
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            if self.bad == "raise":
                raise KeyError("record 5 is missing")
            if self.bad == "type":
                return "not an image", 1
            if self.bad == "label":
                return IMGS[0], 2.5
            if self.bad == "float-array":
                return IMGS[0].astype(np.float32), 1
            return (IMGS[0],)  # not a pair
        return IMGS[i], i


@pytest.mark.parametrize("bad, cause", [
    ("raise", r"KeyError: 'record 5 is missing'"),
    ("type", r"Broken\[5\]: unsupported image type str"),
    ("label", r"Broken\[5\]: label must be an int, got float"),
    ("float-array", r"Broken\[5\]: image arrays must be uint8, got float32"),
    ("pair", r"Broken\[5\]: expected an \(image, label\) pair"),
])
def test_errors_become_sample_errors_naming_the_index(bad, cause):
    with FastLoader(Broken(bad), [CenterCrop(16)], batch_size=3, num_threads=2) as L:
        with pytest.raises(SampleError, match=r"sample 5 \(Broken\[5\]\): .*" + cause) as e:
            list(L)
    assert e.value.index == 5
    with FastLoader(Broken(bad), [CenterCrop(16)], batch_size=3, on_error="skip") as L:
        labels = torch.cat([y.clone() for _, y in L]).tolist()
    assert labels == [0, 1, 2, 3, 4, 6, 6, 7] and [s[0] for s in L.skipped] == [5]


def test_not_a_dataset():
    with pytest.raises(TypeError, match="dataset: a source needs"):
        FastLoader([1, 2, 3])
    with pytest.raises(TypeError, match="map-style"):
        TorchDataset(object())
    with pytest.raises(TypeError, match=r"uint8 on the CPU"):
        TorchDataset(torch.utils.data.TensorDataset(torch.zeros(2, 3, 4, 4), torch.zeros(2))).read(0)
