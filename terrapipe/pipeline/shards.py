"""Tar shards in WebDataset's layout, read by offset: the :class:`TarShards` source.

A shard is a plain (uncompressed) tar file whose members are grouped by *key*: every member
whose path, up to the first dot of its file name, is the same key belongs to one sample
(``n01440764/abc.jpg`` and ``n01440764/abc.cls``), and consecutive members form one sample, as
WebDataset groups them. The text after that dot is the member's extension (lower-cased).

NOTE [shard index]
    Reading a sample must not mean walking a tar, so each shard gets an index, built once:
    1. For every sample: the image member's data offset and size, its label, and its name.
       Labels are read while indexing (the ``cls`` or ``json`` members are tiny), so a sample
       read is then one ``os.pread`` of the image bytes, with the GIL released for the read.
    2. The index is a NumPy ``.npz`` file (``allow_pickle=False``: it holds numbers and
       strings only, and loading it runs no code) beside the shard (``<shard>.tpidx``), or in
       ``index_dir`` / the user cache directory when the shard's folder is not writable.
    3. It records the shard's size and modification time, the index format and how labels and
       images were chosen; any difference rebuilds it. It is written to a temporary file and
       renamed, so ranks building the same index at once never see a torn one.
    4. Indexing proves the shard whole: every member's data lies inside the file, and the
       archive ends with tar's end-of-archive block. ``tarfile`` silently stops at a corrupt
       header after the first member, which would drop the rest of the shard: the index checks
       what follows the last member it saw and names the shard and that member.

Why one module: the tar index, its validation and the source reading by offset are one
format; the NOTE above is their shared contract.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from braceexpand import braceexpand

from .. import settings
from .compiled_fill import FileTable

__all__ = ["TarShards", "ShardError", "expand_urls", "write_shards", "IMAGE_EXTS"]

INDEX_VERSION = 1
INDEX_SUFFIX = ".tpidx"
# Image member extensions, in order of preference when a sample has several.
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "pgm", "tif", "tiff")

# WebDataset's split of a member path into (key, extension): the key runs to the first dot of
# the file name.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class ShardError(ValueError):
    """A shard cannot be indexed or read; the message names the shard and the member."""

    def __init__(self, shard: str, member: str | None, what: str) -> None:
        where = f"{shard}" + (f": member {member}" if member else "")
        super().__init__(f"{where}: {what}")
        self.shard = shard
        self.member = member


def expand_urls(urls: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Shard paths from ``urls``: one string or a list of them; each may use brace ranges
    (``train-{0000..1023}.tar``, WebDataset's notation), shell globs, or a ``file://`` prefix.
    Other URL schemes are refused: shards are read by offset from a (local or network) file
    system. Order is kept as given (a glob's matches sorted)."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not items:
        raise ValueError("urls: no shards given")
    out: list[str] = []
    for item in items:
        for u in braceexpand(os.fspath(item)):
            if u.startswith("file://"):
                u = u[len("file://"):]
            elif "://" in u or u.startswith("pipe:"):
                raise ValueError(f"urls: {u!r}: shards are read by offset from a file system; mount "
                                 f"it (NFS, Lustre, a FUSE object store) and pass the path")
            if any(c in u for c in "*?[") and not os.path.exists(u):
                found = sorted(glob.glob(u))
                if not found:
                    raise FileNotFoundError(f"urls: no shard matches {u!r}")
                out.extend(found)
            else:
                out.append(u)
    for u in out:
        if not os.path.isfile(u):
            raise FileNotFoundError(f"urls: shard {u} does not exist")
    return out


def _label_of(shard: str, key: str, members: dict[str, bytes], label: str) -> int:
    """The label of one sample, from its ``label`` member (an integer in text) or a json field."""
    if label.startswith("json:"):
        data = members.get("json")
        if data is None:
            raise ShardError(shard, None, f"sample {key!r} has no json member (label={label!r})")
        try:
            value = json.loads(data)
            for part in label[5:].split("."):
                value = value[part]
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardError(shard, f"{key}.json", f"no integer at {label[5:]!r}: {exc}") from None
    else:
        data = members.get(label)
        if data is None:
            raise ShardError(shard, None, f"sample {key!r} has no {label!r} member (its members: "
                                          f"{', '.join(sorted(members))})")
        value = data.decode("utf-8", "replace").strip()
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    except (ValueError, TypeError):
        raise ShardError(shard, f"{key}.{label.split(':')[0]}",
                         f"label is not an integer: {str(value)[:40]!r}") from None


def build_index(shard: str, label: str = "cls",
                image_exts: Sequence[str] = IMAGE_EXTS) -> dict[str, np.ndarray]:
    """Walk ``shard`` once (NOTE [shard index]) and return its index arrays: ``offsets`` and
    ``sizes`` (int64, bytes of each sample's image member), ``labels`` (int64) and ``names``
    (str, the image member's path), one entry per sample in tar order."""
    file_size = os.path.getsize(shard)
    offsets: list[int] = []
    sizes: list[int] = []
    labels: list[int] = []
    names: list[str] = []
    rank = {e: i for i, e in enumerate(image_exts)}
    label_ext = "json" if label.startswith("json:") else label
    last = None

    def close_sample(key: str, group: dict[str, tarfile.TarInfo], small: dict[str, bytes]) -> None:
        images = sorted((e for e in group if e in rank), key=rank.__getitem__)
        if not images:
            raise ShardError(shard, None, f"sample {key!r} has no image member ({'/'.join(image_exts)}); "
                                          f"its members: {', '.join(sorted(group))}")
        info = group[images[0]]
        labels.append(_label_of(shard, key, small, label))
        offsets.append(info.offset_data)
        sizes.append(info.size)
        names.append(info.name)

    with open(shard, "rb") as f:
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.ReadError as exc:
            raise ShardError(shard, None, f"not a readable tar archive ({exc}); compressed shards "
                                          f"cannot be read by offset: repack them uncompressed") from None
        key = None
        group: dict[str, tarfile.TarInfo] = {}
        small: dict[str, bytes] = {}
        while True:
            try:
                info = tf.next()
            except tarfile.TarError as exc:
                raise ShardError(shard, last, f"corrupt tar header after this member ({exc})") from None
            if info is None:
                break
            last = info.name
            if not info.isfile():
                continue
            if info.offset_data + info.size > file_size:
                raise ShardError(shard, info.name, f"truncated: its data needs bytes "
                                 f"[{info.offset_data}, {info.offset_data + info.size}) of a "
                                 f"{file_size}-byte file")
            m = _KEY_EXT.match(info.name)
            if m is None:
                continue  # no extension: not part of any sample (WebDataset skips it too)
            k, ext = m.group(1), m.group(2).lower()
            if k != key:
                if key is not None:
                    close_sample(key, group, small)
                key, group, small = k, {}, {}
            if ext in group:
                raise ShardError(shard, info.name, f"sample {k!r} has two {ext!r} members")
            group[ext] = info
            if ext == label_ext:
                small[ext] = tf.extractfile(info).read()
        if key is not None:
            close_sample(key, group, small)
        # What follows the last member must be tar's end-of-archive block (NOTE [shard index] 4).
        end = tf.offset
        f.seek(end)
        tail = f.read(tarfile.BLOCKSIZE)
    if len(tail) < tarfile.BLOCKSIZE or tail.count(0) != len(tail):
        what = ("truncated: no end-of-archive block after this member" if len(tail) < tarfile.BLOCKSIZE
                else f"corrupt tar header at byte {end}, after this member")
        raise ShardError(shard, last, what)
    if not offsets:
        raise ShardError(shard, None, "no samples (no member has an image extension)")
    return {"offsets": np.asarray(offsets, np.int64), "sizes": np.asarray(sizes, np.int64),
            "labels": np.asarray(labels, np.int64), "names": np.asarray(names, dtype=str)}


def _cache_root() -> Path:
    base = settings.get("TERRAPIPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "terrapipe")
    return Path(base) / "shard-index"


def _index_paths(shard: str, index_dir: str | os.PathLike | None) -> list[Path]:
    """Where the index of ``shard`` may live, in order of preference."""
    digest = hashlib.sha1(os.path.abspath(shard).encode()).hexdigest()[:16]
    name = f"{digest}-{os.path.basename(shard)}{INDEX_SUFFIX}"
    if index_dir is not None:
        return [Path(index_dir) / name]
    return [Path(shard + INDEX_SUFFIX), _cache_root() / name]


def _stamp(shard: str, label: str, image_exts: Sequence[str]) -> np.ndarray:
    st = os.stat(shard)
    return np.asarray([f"v{INDEX_VERSION}", str(st.st_size), str(st.st_mtime_ns), label,
                       ",".join(image_exts)])


def load_index(shard: str, label: str = "cls", image_exts: Sequence[str] = IMAGE_EXTS,
               index_dir: str | os.PathLike | None = None) -> tuple[dict[str, np.ndarray], Path | None]:
    """The index of ``shard``, from its file when that is current, else built and saved
    (NOTE [shard index]). Returns the arrays (names left out: :func:`member_names` reads them
    when an error needs one) and the index file's path (None if none could be written)."""
    stamp = _stamp(shard, label, image_exts)
    paths = _index_paths(shard, index_dir)
    for p in paths:
        try:
            z = _read_npz(p, ("stamp", "offsets", "sizes", "labels"))
            if np.array_equal(z["stamp"], stamp):
                return {k: z[k] for k in ("offsets", "sizes", "labels")}, p
        except (OSError, ValueError, KeyError, EOFError):
            continue  # missing, stale format, or torn by a crash: rebuild
    index = build_index(shard, label, image_exts)
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                np.savez(f, stamp=stamp, **index)
            os.replace(tmp, p)
            return index, p
        except OSError:
            continue  # read-only folder: try the next place
    return index, None


def member_names(index_path: Path | None) -> np.ndarray | None:
    if index_path is None:
        return None
    try:
        return _read_npz(index_path, ("names",))["names"]
    except (OSError, ValueError, KeyError):
        return None


# NumPy parses every .npy header with ast.literal_eval, and CPython 3.11 keeps the AST
# builder's recursion-depth counter in state shared by all threads (python/cpython#106905):
# two threads parsing at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (seen on CI while TarShards loaded its indexes on a thread pool). Index files are
# small; reading them one at a time costs nothing next to the scans the pool runs in parallel.
_NPZ_READ = threading.Lock()


def _read_npz(path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Arrays ``keys`` of the .npz at ``path`` (no pickles), read under :data:`_NPZ_READ`."""
    with _NPZ_READ, np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in keys}


class TarShards:
    """WebDataset-layout tar shards as a FastLoader source, read by offset.

    urls: shard paths (see :func:`expand_urls`: brace ranges, globs, ``file://``). label:
    ``"cls"`` (or any extension whose member holds an integer as text) or ``"json:<field>"``
    (an integer field of the sample's ``.json`` member; dots reach into nested objects).
    image_exts: the image member extensions, in order of preference. index_dir: where indices
    go (default beside each shard, else the user cache, NOTE [shard index]). workers: threads
    that index shards at construction.

    Samples are numbered shard by shard in tar order (``len`` in all), so a folder packed by
    :func:`write_shards` gives the same global order, and FastLoader the same batches, as the
    ``ImageFolder`` it came from. ``read(i)`` returns the image member's bytes (one ``pread``)
    and the label; it is thread-safe. ``describe(i)`` is ``"<shard>:<member>"``. Open file
    descriptors (one per shard read so far) are released by :meth:`close` or when collected.
    """

    def __init__(self, urls: str | os.PathLike | Iterable[str | os.PathLike], *, label: str = "cls",
                 image_exts: Sequence[str] = IMAGE_EXTS, index_dir: str | os.PathLike | None = None,
                 workers: int = 8) -> None:
        if not isinstance(label, str) or not label or label == "json:":
            raise ValueError(f"label: an extension such as 'cls' or 'json:<field>', got {label!r}")
        exts = tuple(e.lower().lstrip(".") for e in image_exts)
        if not exts:
            raise ValueError("image_exts: at least one image extension is needed")
        self.shards = expand_urls(urls)
        self.label = label
        with ThreadPoolExecutor(max(1, min(workers, len(self.shards)))) as pool:
            built = list(pool.map(lambda s: load_index(s, label, exts, index_dir), self.shards))
        counts = np.asarray([len(ix["offsets"]) for ix, _ in built], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._index_paths = [p for _, p in built]
        self.offsets = np.concatenate([ix["offsets"] for ix, _ in built])
        self.sizes = np.concatenate([ix["sizes"] for ix, _ in built])
        self.labels = np.concatenate([ix["labels"] for ix, _ in built])
        self._shard_of = np.repeat(np.arange(len(self.shards), dtype=np.int32), counts)
        self._names: dict[int, np.ndarray | None] = {}
        self._own_files()

    def _own_files(self) -> None:
        """This process's descriptors of the shards (opened on first read), their lock and the
        finalizer that closes them."""
        self._fds: list[int | None] = [None] * len(self.shards)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)

    # Pickled for a loader's worker process (NOTE [the loader's worker process] in
    # pipeline/worker_process.py): the index travels; file descriptors, the lock and the
    # finalizer are this process's own, and the copy opens its shards again on first read.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for own in ("_fds", "_lock", "_finalizer"):
            del state[own]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._own_files()

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    def __len__(self) -> int:
        return len(self.offsets)

    def _fd(self, s: int) -> int:
        fd = self._fds[s]
        if fd is None:
            with self._lock:
                fd = self._fds[s]
                if fd is None:
                    fd = self._fds[s] = os.open(self.shards[s], os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return fd

    def read(self, i: int) -> tuple[bytes, int]:
        s = int(self._shard_of[i])
        off, size = int(self.offsets[i]), int(self.sizes[i])
        try:
            data = os.pread(self._fd(s), size, off)
        except OSError as exc:
            raise ShardError(self.shards[s], self._member(i), f"read failed: {exc}") from None
        if len(data) != size:
            raise ShardError(self.shards[s], self._member(i), f"truncated: {len(data)} of {size} bytes "
                             f"at offset {off} (the shard changed after it was indexed)")
        return data, int(self.labels[i])

    def _member(self, i: int) -> str:
        s = int(self._shard_of[i])
        if s not in self._names:
            self._names[s] = member_names(self._index_paths[s])
        names = self._names[s]
        k = i - int(self._starts[s])
        return str(names[k]) if names is not None and k < len(names) else f"sample #{k}"

    def describe(self, i: int) -> str:
        return f"{self.shards[int(self._shard_of[i])]}:{self._member(i)}"

    def file_table(self) -> FileTable | None:
        """Where the samples lie (sample i: ``sizes[i]`` bytes at ``offsets[i]`` of its shard),
        as :meth:`read` reads them; None for a subclass that reads otherwise. The loader's
        threads then read a chunk of members in one compiled call (NOTE [one compiled call per
        chunk] in pipeline/compiled_fill.py)."""
        if type(self).read is not TarShards.read or type(self).__len__ is not TarShards.__len__:
            return None
        return FileTable([str(s) for s in self.shards], self.labels, self._shard_of, self.offsets, self.sizes)

    def close(self) -> None:
        """Close the shards' file descriptors (reading again reopens them)."""
        with self._lock:
            _close_fds(self._fds)


def _close_fds(fds: list[int | None]) -> None:
    for k, fd in enumerate(fds):
        if fd is not None:
            fds[k] = None
            try:
                os.close(fd)
            except OSError:
                pass


def _sanitize(stem: str) -> str:
    # A key runs to the first dot of the file name (WebDataset), so dots inside it must go.
    return re.sub(r"[.\s]", "_", stem)


def write_shards(samples: Sequence[tuple[str, int]], out_dir: str | os.PathLike, *, prefix: str = "shard",
                 samples_per_shard: int = 1000, max_bytes: int = 1 << 30,
                 names: Sequence[str] | None = None) -> list[str]:
    """Pack ``samples`` ((path, label) pairs, e.g. ``ImageFolder.samples``) into uncompressed
    tar shards ``<out_dir>/<prefix>-NNNNNN.tar`` in the given order, WebDataset's layout:
    ``<key>.<ext>`` (the file's bytes as they are) and ``<key>.cls`` (the label as text); keys
    are ``names[i]`` (default: the class folder and file stem). A shard closes at
    ``samples_per_shard`` samples or ``max_bytes``. Each shard is indexed as it is written
    (NOTE [shard index]). Returns the shard paths."""
    if samples_per_shard <= 0 or max_bytes <= 0:
        raise ValueError("samples_per_shard and max_bytes must be positive")
    if not samples:
        raise ValueError("samples: nothing to pack")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    seen: set[str] = set()
    tf = None
    count = size = 0

    def add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
        tar.addfile(info, io.BytesIO(data))

    def finish() -> None:
        tf.close()
        load_index(written[-1])

    for i, (path, lab) in enumerate(samples):
        if tf is None or count >= samples_per_shard or size >= max_bytes:
            if tf is not None:
                finish()
            written.append(str(out / f"{prefix}-{len(written):06d}.tar"))
            tf = tarfile.open(written[-1], "w", format=tarfile.PAX_FORMAT)
            count = size = 0
        p = Path(path)
        ext = p.suffix.lower().lstrip(".")
        if not ext:
            raise ValueError(f"samples[{i}]: {path} has no extension to name its format by")
        key = names[i] if names is not None else f"{p.parent.name}/{_sanitize(p.stem)}"
        if key in seen:
            key = f"{key}_{i}"
        seen.add(key)
        data = p.read_bytes()
        mtime = p.stat().st_mtime
        add(tf, f"{key}.{ext}", data, mtime)
        add(tf, f"{key}.cls", str(int(lab)).encode(), mtime)
        count += 1
        size += len(data)
    finish()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m terrapipe.pipeline.shards",
                                description="Tar shards in WebDataset's layout.")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="pack an ImageFolder (root/<class>/<file>) into shards")
    w.add_argument("root", help="ImageFolder root")
    w.add_argument("out", help="output folder")
    w.add_argument("--prefix", default="shard")
    w.add_argument("--samples-per-shard", type=int, default=1000)
    w.add_argument("--max-bytes", type=int, default=1 << 30)
    ix = sub.add_parser("index", help="build (or check) the index of each shard")
    ix.add_argument("urls", nargs="+")
    ix.add_argument("--label", default="cls")
    args = p.parse_args(argv)
    if args.cmd == "write":
        from .sources import ImageFolder

        folder = ImageFolder(args.root)
        shards = write_shards(folder.samples, args.out, prefix=args.prefix,
                              samples_per_shard=args.samples_per_shard, max_bytes=args.max_bytes)
        with open(Path(args.out) / f"{args.prefix}-classes.json", "w") as f:
            json.dump(folder.classes, f)
        print(f"{len(folder)} samples of {len(folder.classes)} classes in {len(shards)} shards: "
              f"{shards[0]} .. {shards[-1]}")
    else:
        ds = TarShards(args.urls, label=args.label)
        print(f"{len(ds)} samples in {len(ds.shards)} shards, indexed")
        ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
