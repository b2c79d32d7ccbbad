"""A checkpoint taken mid-epoch at world size W resumes at world size V (NOTE [resume at any world
size]): read DistributedSampler's way, the V ranks yield exactly the unconsumed rest of the
epoch's order, each sample with the bytes of the uninterrupted run, then at most V - 1 padding
samples; every rank the same number of batches; the next epoch is an ordinary one at V."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, RandomHorizontalFlip, RandomResizedCrop, TarShards, write_shards

N = 37  # not a multiple of any world size below: the deal pads
BATCH = 3
TRANSFORMS = [RandomResizedCrop(12), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same N images as an ImageFolder and as tar shards; sample i has label i (one class
    folder per image), so a label names its sample."""
    root = tmp_path_factory.mktemp("resume")
    g = np.random.default_rng(1)
    picked = []
    for i in range(N):
        d = root / "folder" / f"c{i:03d}"
        d.mkdir(parents=True)
        path = d / "img.jpg"
        Image.fromarray(g.integers(0, 256, (20 + i % 7, 24, 3), dtype=np.uint8)).save(path, quality=90)
        picked.append((str(path), i))
    shards = write_shards(picked, root / "shards", samples_per_shard=10)
    return {"folder": lambda: ImageFolder(root / "folder"), "shards": lambda: TarShards(shards)}


def _loader(source, rank, world, shuffle, drop_last, **kw):
    return FastLoader(source(), TRANSFORMS, batch_size=BATCH, shuffle=shuffle, drop_last=drop_last, seed=5,
                      num_threads=2, rank=rank, world_size=world, **kw)


def _pass(loader, steps=None):
    """(labels, images) of one pass, or of its first ``steps`` batches."""
    labels, images = [], []
    it = iter(loader)
    for x, y in (it if steps is None else (next(it) for _ in range(steps))):
        labels += y.tolist()
        images += [img.clone() for img in x]
    return labels, images


def _global(per_rank):
    """Per-rank sequences read DistributedSampler's way: position r + W * i is rank r's i-th."""
    world = len(per_rank)
    assert len({len(s) for s in per_rank}) == 1, "ranks yielded different numbers of samples"
    return [per_rank[i % world][i // world] for i in range(world * len(per_rank[0]))]


@pytest.mark.parametrize("source", ["folder", "shards"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("w,v", [(2, 1), (2, 4), (4, 3), (3, 2), (2, 2)])
def test_a_mid_epoch_checkpoint_resumes_at_another_world_size(sources, source, shuffle, drop_last, w, v):
    src = sources[source]
    epoch, steps = 3, 2
    # The uninterrupted epoch at W: its global order, and every sample's bytes.
    full = []
    for r in range(w):
        with _loader(src, r, w, shuffle, drop_last) as L:
            L.set_epoch(epoch)
            full.append(_pass(L))
    order = _global([labels for labels, _ in full])
    if not drop_last:
        assert sorted(set(order)) == list(range(N))
    bytes_of = {}
    for labels, images in full:
        for label, img in zip(labels, images, strict=True):
            bytes_of.setdefault(label, img)
            assert torch.equal(bytes_of[label], img)  # a padded repeat is the same sample

    # Every rank stops after `steps` batches; one rank's state is the checkpoint.
    states = []
    for r in range(w):
        with _loader(src, r, w, shuffle, drop_last) as L:
            L.set_epoch(epoch)
            _pass(L, steps)
            states.append(L.state_dict())
    assert all(s["consumed"] == steps * BATCH * w for s in states)
    buf = io.BytesIO()
    torch.save(states[-1], buf)
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)

    resumed, nexts = [], []
    for r in range(v):
        with _loader(src, r, v, shuffle, drop_last) as L:
            L.load_state_dict(checkpoint)
            labels, images = _pass(L)
            resumed.append((labels, images))
            for label, img in zip(labels, images, strict=True):
                assert torch.equal(img, bytes_of[label]), f"sample {label} differs from the uninterrupted run"
            L.set_epoch(epoch + 1)
            nexts.append(_pass(L)[0])
    got = _global([labels for labels, _ in resumed])
    consumed = steps * BATCH * w
    rest = order[consumed:N]
    if drop_last:
        per_rank = -(-len(rest) // v)
        assert len(got) == v * BATCH * (per_rank // BATCH)
        assert got == (rest + order[: v - 1])[: len(got)]
    else:
        pad = got[len(rest):]
        assert got[: len(rest)] == rest, "the resumed ranks do not deal the rest of the epoch in order"
        assert len(pad) <= v - 1 and pad == order[: len(pad)]
    # The next epoch is an ordinary epoch at V.
    fresh = []
    for r in range(v):
        with _loader(src, r, v, shuffle, drop_last) as L:
            L.set_epoch(epoch + 1)
            fresh.append(_pass(L)[0])
    assert nexts == fresh


def test_a_checkpoint_inside_a_resumed_pass_resumes_again(sources):
    """4 -> 3 -> 2: the second resume continues where the resumed pass stopped."""
    src = sources["folder"]
    full = []
    for r in range(4):
        with _loader(src, r, 4, True, False) as L:
            L.set_epoch(1)
            full.append(_pass(L)[0])
    order = _global(full)
    with _loader(src, 3, 4, True, False) as L:
        L.set_epoch(1)
        _pass(L, 1)
        first = L.state_dict()
    with _loader(src, 1, 3, True, False) as L:
        L.load_state_dict(first)
        _pass(L, 2)
        second = L.state_dict()
    assert second["consumed"] == 1 * BATCH * 4 + 2 * BATCH * 3
    got = []
    for r in range(2):
        with _loader(src, r, 2, True, False) as L:
            L.load_state_dict(second)
            got.append(_pass(L)[0])
    got = _global(got)
    rest = order[second["consumed"]:N]
    assert got[: len(rest)] == rest and len(got) - len(rest) <= 1


@pytest.mark.parametrize("field, change", [("num_samples", 1), ("seed", 1), ("batch_size", 1),
                                            ("shuffle", None)])
def test_a_state_from_an_incompatible_loader_is_refused_naming_the_field(sources, field, change):
    with _loader(sources["folder"], 0, 2, True, False) as L:
        state = L.state_dict()
        bad = dict(state)
        bad[field] = (not state[field]) if change is None else state[field] + change
        with pytest.raises(ValueError, match=field):
            L.load_state_dict(bad)
        L.load_state_dict(state)  # its own state loads


@pytest.mark.parametrize("world,new", [(4, 3), (2, 5)])
def test_set_world_deals_the_rest_as_a_loader_made_at_the_new_world(sources, world, new):
    # An elastic job's survivors keep their loader and move it to the next generation's world
    # (Engine(elastic=True)): it must deal what a loader built at that world would.
    first = _loader(sources["folder"], 1, world, True, False)
    _pass(first, steps=2)
    state = first.state_dict()
    for r in range(new):
        moved = _loader(sources["folder"], min(r, world - 1), world, True, False)
        moved.set_world(r, new)
        moved.load_state_dict(state)
        made = _loader(sources["folder"], r, new, True, False)
        made.load_state_dict(state)
        a, b = _pass(moved), _pass(made)
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
        assert moved.state_dict()["world_size"] == new and moved.state_dict()["rank"] == r
        for loader in (moved, made):
            loader.close()
    first.close()
    with pytest.raises(ValueError, match="set_world: rank 3 is outside world_size 3"):
        _loader(sources["folder"], 0, 1, True, False).set_world(3, 3)
