"""TarShards: WebDataset-layout tar shards read by offset, and the shard writer."""

import gzip
import io
import json
import os
import pickle
import random
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import (
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    SampleError,
    ShardError,
    TarShards,
    write_shards,
)
from terrapipe.pipeline import shards as shards_mod

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN = [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(MEAN, STD)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    g = np.random.default_rng(0)
    for c in ["cat", "dog", "eel"]:
        (root / c).mkdir()
        for i in range(9):
            h, w = g.integers(30, 70, 2)
            fmt = ["jpg", "png", "jpeg"][i % 3]
            img = g.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(img).save(root / c / f"im.{i:02d}.{fmt}")
    return root


@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    ds = ImageFolder(folder)
    paths = write_shards(ds.samples, out, prefix="train", samples_per_shard=4)
    return ds, paths, out


def _tar(path, members, end=True):
    """A tar of (name, bytes) members; ``end=False`` leaves out the end-of-archive blocks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if not end:
        raw = raw.rstrip(b"\0")
        raw += b"\0" * (-len(raw) % 512)
    path.write_bytes(raw)
    return path


def _jpeg(seed=0, size=(20, 30)):
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(b, "JPEG")
    return b.getvalue()


def test_packed_folder_reads_back_byte_for_byte(packed):
    folder, paths, _ = packed
    assert len(paths) == 7 and all(os.path.exists(p + ".tpidx") for p in paths)  # 27 samples / 4
    ts = TarShards(paths)
    assert len(ts) == len(folder) and ts.targets == folder.targets
    order = list(range(len(ts)))
    random.Random(1).shuffle(order)
    for i in order:
        data, label = ts.read(i)
        path, want = folder.samples[i]
        assert label == want and data == open(path, "rb").read()
    # Keys keep the class folder and the file stem, dots replaced (a key ends at the first dot).
    assert ts.describe(0) == f"{paths[0]}:cat/im_00.jpg"
    ts.close()
    assert ts.read(5)[1] == folder.samples[5][1]  # reopened after close


@pytest.mark.parametrize("threads", [1, 3])
def test_same_batches_as_the_image_folder(packed, threads):
    folder, paths, _ = packed
    kw = dict(batch_size=5, shuffle=True, seed=7, num_threads=threads)
    for rank in range(2):
        with FastLoader(folder, TRAIN, rank=rank, world_size=2, **kw) as a, \
                FastLoader(TarShards(paths), TRAIN, rank=rank, world_size=2, **kw) as b:
            for epoch in (0, 3):
                a.set_epoch(epoch)
                b.set_epoch(epoch)
                for (xa, ya), (xb, yb) in zip(a, b, strict=True):
                    assert torch.equal(xa, xb) and torch.equal(ya, yb)
            it = iter(b)
            next(it)
            state = b.state_dict()
            ref = [x.clone() for x, _ in it]
        with FastLoader(TarShards(paths), TRAIN, rank=rank, world_size=2, **kw) as c:
            c.load_state_dict(state)
            rest = [x.clone() for x, _ in c]
        assert len(rest) == len(ref) and all(torch.equal(p, q) for p, q in zip(ref, rest, strict=True))


def test_shards_feed_a_loaders_worker_process(packed):
    # TarShards pickles without its file descriptors, lock and finalizer (the worker process
    # opens the shards again), and the worker's batches equal the threads'.
    _, paths, _ = packed
    shards = TarShards(paths)
    shards.read(0)  # a descriptor open here, which the copy does not take
    copy = pickle.loads(pickle.dumps(shards))
    assert copy._fds == [None] * len(paths) and copy.read(3) == shards.read(3)
    kw = dict(batch_size=5, shuffle=True, seed=7, num_threads=2)
    with FastLoader(shards, TRAIN, **kw) as threads, \
            FastLoader(shards, TRAIN, workers="process", **kw) as proc:
        for (xa, ya), (xb, yb) in zip(threads, proc, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_concurrent_reads_from_many_threads(packed):
    folder, paths, _ = packed
    ts = TarShards(paths)
    want = {i: open(folder.samples[i][0], "rb").read() for i in range(len(ts))}
    errors = []

    def reader(seed):
        order = list(range(len(ts))) * 20
        random.Random(seed).shuffle(order)
        for i in order:
            if ts.read(i)[0] != want[i]:
                errors.append(i)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_index_is_reused_and_rebuilt_when_the_shard_changes(packed, tmp_path, monkeypatch):
    folder, paths, _ = packed
    shard = tmp_path / "s.tar"
    shard.write_bytes(open(paths[0], "rb").read())
    TarShards([shard])
    assert (tmp_path / "s.tar.tpidx").exists()
    calls = []
    real = shards_mod.build_index
    monkeypatch.setattr(shards_mod, "build_index", lambda *a, **k: calls.append(a) or real(*a, **k))
    TarShards([shard])
    assert calls == []  # current index: read, not rebuilt
    shard.write_bytes(open(paths[1], "rb").read())  # another shard's bytes under the same name
    ts = TarShards([shard])
    assert len(calls) == 1 and ts.read(0)[0] == open(folder.samples[4][0], "rb").read()
    TarShards([shard], label="cls", image_exts=("png", "jpeg", "jpg"))  # another choice: rebuilt
    assert len(calls) == 2
    (tmp_path / "s.tar.tpidx").write_bytes(b"torn")  # a torn index is rebuilt, not trusted
    assert len(TarShards([shard])) == 4 and len(calls) == 3


def test_index_goes_to_the_cache_when_the_shard_folder_is_not_writable(packed, tmp_path, monkeypatch):
    _, paths, _ = packed
    shard = tmp_path / "ro.tar"
    shard.write_bytes(open(paths[0], "rb").read())
    (tmp_path / "ro.tar.tpidx").mkdir()  # cannot be written as a file, whoever we are
    monkeypatch.setenv("TERRAPIPE_CACHE", str(tmp_path / "cache"))
    assert len(TarShards([shard])) == 4
    assert len(list((tmp_path / "cache" / "shard-index").glob("*ro.tar.tpidx"))) == 1
    TarShards([shard], index_dir=tmp_path / "idx")
    assert len(list((tmp_path / "idx").glob("*ro.tar.tpidx"))) == 1


def test_index_files_hold_no_pickles(packed):
    _, paths, _ = packed
    with np.load(paths[0] + ".tpidx", allow_pickle=False) as z:  # raises if an object array is inside
        assert set(z.files) == {"stamp", "offsets", "sizes", "labels", "names"}
        assert z["names"].dtype.kind == "U"


def test_json_labels_and_member_grouping(tmp_path):
    members = [
        ("a/x1.jpg", _jpeg(1)), ("a/x1.json", json.dumps({"label": 3, "meta": {"c": 9}}).encode()),
        ("a/x2.json", b'{"label": 5, "meta": {"c": 8}}'), ("a/x2.png", _jpeg(2)), ("a/x2.jpg", _jpeg(3)),
        ("README", b"no extension: not a sample"),
    ]
    shard = _tar(tmp_path / "j.tar", members)
    ts = TarShards(str(shard), label="json:label")
    assert len(ts) == 2 and ts.targets == [3, 5]
    assert ts.read(1)[0] == _jpeg(3)  # jpg preferred to png (image_exts order)
    assert TarShards(str(shard), label="json:meta.c", index_dir=tmp_path / "i").targets == [9, 8]
    assert TarShards(str(shard), label="json:label", image_exts=("png", "jpg"),
                     index_dir=tmp_path / "k").read(1)[0] == _jpeg(2)
    with pytest.raises(ShardError, match=r"j\.tar: member a/x1\.json: no integer at 'nope'"):
        TarShards(str(shard), label="json:nope", index_dir=tmp_path / "n")
    with pytest.raises(ShardError, match=r"j\.tar: sample 'a/x1' has no 'cls' member"):
        TarShards(str(shard), index_dir=tmp_path / "m")


def test_matches_webdataset_grouping(packed):
    wds = pytest.importorskip("webdataset")
    _, paths, _ = packed
    ours = TarShards(paths)
    theirs = [(s["__key__"], s.get("jpg") or s.get("png") or s.get("jpeg"), int(s["cls"]))
              for s in wds.WebDataset(paths, shardshuffle=False, empty_check=False)]
    assert len(theirs) == len(ours)
    for i, (key, data, label) in enumerate(theirs):
        assert ours.read(i) == (data, label)
        assert ours.describe(i).split(":", 1)[1].startswith(key + ".")


@pytest.mark.parametrize("damage, match", [
    ("truncated-data", r"member cat/im_01\.png: truncated: its data needs bytes"),
    ("no-end-block", r"member cat/im_03\.cls: truncated: no end-of-archive block"),
    ("corrupt-header", r"member cat/im_01\.cls: corrupt tar header at byte \d+, after this member"),
    ("gzip", r"not a readable tar archive .*repack them uncompressed"),
    ("bad-label", r"member cat/im_00\.cls: label is not an integer: 'seven'"),
    ("no-image", r"sample 'cat/im_00' has no image member"),
])
def test_damaged_shards_name_the_shard_and_member(packed, tmp_path, damage, match):
    _, paths, _ = packed
    raw = open(paths[0], "rb").read()
    shard = tmp_path / "bad.tar"
    with tarfile.open(paths[0]) as tf:
        infos = tf.getmembers()
    if damage == "truncated-data":
        png = next(i for i in infos if i.name.endswith("im_01.png"))
        shard.write_bytes(raw[:png.offset_data + png.size // 2])
    elif damage == "no-end-block":
        last = infos[-1]
        shard.write_bytes(raw[:last.offset_data + -(-last.size // 512) * 512])
    elif damage == "corrupt-header":
        third = infos[4]  # cat/im_02.*: its header is overwritten
        raw = bytearray(raw)
        raw[third.offset:third.offset + 512] = b"\x7f" * 512
        shard.write_bytes(bytes(raw))
    elif damage == "gzip":
        shard.write_bytes(gzip.compress(raw))
    elif damage == "bad-label":
        _tar(shard, [("cat/im_00.jpg", _jpeg()), ("cat/im_00.cls", b"seven")])
    else:
        _tar(shard, [("cat/im_00.txt", b"hello"), ("cat/im_00.cls", b"1")])
    with pytest.raises(ShardError, match=match) as e:
        TarShards([shard])
    assert e.value.shard == str(shard) and str(shard) in str(e.value)


def test_corrupt_image_in_a_shard_is_a_sample_error_naming_shard_and_member(tmp_path):
    shard = _tar(tmp_path / "c.tar", [("k/a.jpg", _jpeg(1)), ("k/a.cls", b"0"),
                                      ("k/b.jpg", b"\xff\xd8 not really a jpeg" * 20), ("k/b.cls", b"1")])
    with FastLoader(TarShards(str(shard)), TRAIN, batch_size=2, num_threads=2) as loader:
        with pytest.raises(SampleError, match=r"sample 1 \(.*c\.tar:k/b\.jpg\)"):
            list(loader)


def test_a_shard_cut_after_indexing_is_named_on_read(packed, tmp_path):
    _, paths, _ = packed
    shard = tmp_path / "cut.tar"
    shard.write_bytes(open(paths[0], "rb").read())
    ts = TarShards([shard])
    with open(shard, "r+b") as f:
        f.truncate(ts.offsets[2] + 10)
    assert ts.read(1)[1] == ts.labels[1]
    with pytest.raises(ShardError, match=r"cut\.tar: member cat/im_02\.jpeg: truncated: 10 of"):
        ts.read(2)


def test_urls(packed, tmp_path):
    _, paths, out = packed
    assert shards_mod.expand_urls(str(out / "train-{000000..000006}.tar")) == paths
    assert shards_mod.expand_urls(str(out / "train-*.tar")) == paths
    assert shards_mod.expand_urls(["file://" + paths[1], paths[0]]) == [paths[1], paths[0]]
    with pytest.raises(ValueError, match="read by offset from a file system"):
        TarShards("https://example.com/train-{0000..0001}.tar")
    with pytest.raises(FileNotFoundError, match="train-000098.tar does not exist"):
        TarShards(str(out / "train-{000098..000099}.tar"))
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        TarShards(str(tmp_path / "nothing-*.tar"))
    with pytest.raises(ValueError, match="label"):
        TarShards(paths, label="")


def test_write_command_packs_an_image_folder(folder, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "terrapipe.pipeline.shards", "write", str(folder), str(out),
                        "--prefix", "val", "--samples-per-shard", "10"], capture_output=True, text=True)
    assert r.returncode == 0 and "27 samples of 3 classes in 3 shards" in r.stdout, (r.stdout, r.stderr)
    assert json.loads((out / "val-classes.json").read_text()) == ["cat", "dog", "eel"]
    ts = TarShards(str(out / "val-{000000..000002}.tar"))
    assert ts.targets == ImageFolder(folder).targets
    r = subprocess.run([sys.executable, "-m", "terrapipe.pipeline.shards", "index", str(out / "val-*.tar")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "27 samples in 3 shards" in r.stdout, (r.stdout, r.stderr)
