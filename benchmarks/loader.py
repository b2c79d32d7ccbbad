"""FastLoader vs torch DataLoader (+ Pillow transforms) vs decode alone, on the same JPEGs.

    python -m benchmarks.loader [--source folder|shards] [--data DIR | --photos DIR] [--images N]
                                [--batch 256] [--batches B] [--rounds 3]

``--photos DIR``: real photographs, JPEG files under DIR in class folders or flat (a flat file's
class is its name up to the first ``_``, as in a one-image-per-class ImageNet sample named
``<wnid>_<name>.JPEG``); they are linked into class folders under ``data_cache/``. Otherwise, if
``--data`` DIR has no images, an ImageNet-like set is generated there first (benchmarks/data.py),
whose synthetic images decode unlike photographs. The cases share one epoch: ``--batches`` x
``--batch`` files of DIR, in a fixed mixed-class order. Every case is warmed up (compilation,
worker start-up, each of FastLoader's batch slots written once); then each round times one whole
epoch of every case at every thread count, interleaved. A whole epoch ends with every pipeline
empty, so no case leaves prefetching work running into the next case's timing (a DataLoader's
persistent workers keep building ``prefetch_factor`` batches per worker after a partial pass; on 2
cores that halved the decode-only rate measured after it). A DataLoader builds each batch in one
worker, so the epoch has 4 batches per worker by default. The report gives the median img/s per
case and the ratios FastLoader / each DataLoader and FastLoader / decode-only at the same thread
count.

Cases, all producing float32 NCHW 224x224 normalized batches from the same files:
* fastloader: RandomResizedCrop(224) + RandomHorizontalFlip + Normalize, ``num_threads=N``
  (JPEGs decoded by the libjpeg-turbo region decoder when built; ``TERRAPIPE_JPEG=pillow`` in
  the environment measures the Pillow path instead);
* dataloader: ``torch.utils.data.DataLoader(num_workers=N, persistent_workers=True)`` with the
  torchvision-equivalent chain (torchvision's transforms if importable, else the same steps on
  Pillow + torch): the strongest plain-DataLoader set-up, and the ratio's baseline;
* dataloader-defaults: the same with DataLoader's defaults, as most scripts write it: workers
  are started again every epoch, and that start-up is part of the epoch's time;
* dali-cpu: NVIDIA DALI's CPU pipeline, when ``nvidia-dali`` is installed, as its ResNet-50
  examples build it (``readers.file`` shuffling the same files, ``decoders.image_random_crop``
  with the same scale and ratio ranges, ``resize`` to 224x224, ``crop_mirror_normalize`` with a
  random mirror to float32 CHW) on ``num_threads=N`` with ``device_id=None``, read through its
  PyTorch iterator (``DALIGenericIterator``), as a training script would;
* decode: Pillow decoding each file at full resolution on N threads, nothing else (the ceiling
  of a loader that decodes whole images: no crop, resize, copy or collation).

``--source shards`` packs the same images, in the same order, into WebDataset-layout tar shards
(``terrapipe.pipeline.write_shards``, 16 shards, cached beside DIR) and measures:
* fastloader: FastLoader on ``TarShards`` (one ``pread`` per sample);
* fastloader-folder: FastLoader on the same files as a folder (the "at least as fast" target);
* dataloader / dataloader-defaults: the DataLoader reading the same shards as WebDataset reads
  them (each worker streams whole shards, a 1000-sample shuffle buffer, Pillow decode, the same
  transforms, batches built in the workers) when the ``webdataset`` package is installed; else
  the folder DataLoader above;
* decode: as above, on the files.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from terrapipe import FastLoader
from terrapipe.pipeline import (
    ImageFolder,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    TarShards,
    write_shards,
)

from .common import format_table, save
from .data import make_image_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEFAULT_DATA = Path(__file__).resolve().parent / "data_cache" / "imagenet_like"


def _torchvision_transform():
    try:
        from torchvision import transforms as T

        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(MEAN, STD)]), "torchvision"
    except Exception:
        return _PillowChain(), "pillow+torch"


class _PillowChain:
    """torchvision's RandomResizedCrop + flip + ToTensor + Normalize, step for step."""

    def __init__(self) -> None:
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __call__(self, im: Image.Image) -> torch.Tensor:
        w, h = im.size
        area = w * h
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                i, j = random.randint(0, h - ch), random.randint(0, w - cw)
                break
        else:
            cw, ch, i, j = w, h, 0, 0
        im = im.resize((224, 224), Image.BILINEAR, box=(j, i, j + cw, i + ch))
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std


class _TorchDataset(torch.utils.data.Dataset):
    def __init__(self, samples, transform) -> None:
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as im:
            return self.transform(im.convert("RGB")), label


class _Subset:
    """The samples of ``ds`` at ``order``, in that order: a terrapipe source over the files."""

    def __init__(self, ds: ImageFolder, order: list[int]) -> None:
        self.ds, self.order = ds, order

    def __len__(self) -> int:
        return len(self.order)

    def read(self, i: int):
        return self.ds.read(self.order[i])

    def describe(self, i: int) -> str:
        return self.ds.describe(self.order[i])

    def file_table(self):
        # The files at ``order``: FastLoader reads them a chunk per compiled call, as it does
        # an ImageFolder's (NOTE [one compiled call per chunk] in pipeline/compiled_fill.py).
        table = self.ds.file_table()
        return None if table is None else table.take(self.order)


def _shards_of(data: Path, picked: list[tuple[str, int]], n_shards: int = 16) -> list[str]:
    """``picked`` packed into ``n_shards`` tar shards (cached: rebuilt only if the list changes)."""
    out = data.parent / f"{data.name}-shards-{len(picked)}"
    manifest = out / "manifest.txt"
    want = "\n".join(f"{p}\t{label}" for p, label in picked)
    paths = sorted(str(p) for p in out.glob("bench-*.tar"))
    if manifest.exists() and manifest.read_text() == want and paths:
        return paths
    for p in out.glob("bench-*"):
        p.unlink()
    paths = write_shards(picked, out, prefix="bench", samples_per_shard=math.ceil(len(picked) / n_shards))
    manifest.write_text(want)
    return paths


def _webdataset_loader(shards: list[str], transform, batch: int, workers: int, persistent: bool):
    """The DataLoader as WebDataset's documentation sets it up, or None without webdataset."""
    try:
        import webdataset as wds
    except ImportError:
        return None
    ds = (wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
          .shuffle(1000).decode("pil").to_tuple("jpg;jpeg;png", "cls")
          .map_tuple(transform, int).batched(batch, partial=True))
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                       persistent_workers=persistent and workers > 0)


def _photo_folder(photos: Path) -> Path:
    """``photos`` as class folders: itself if it has them, else a tree of links under data_cache/
    (a flat file's class: its name up to the first ``_``)."""
    if any(p.is_dir() for p in photos.iterdir()):
        return photos
    out = Path(__file__).resolve().parent / "data_cache" / f"photos-{photos.name}"
    for f in sorted(photos.iterdir()):
        if f.suffix.lower() in (".jpg", ".jpeg"):
            link = out / f.name.split("_")[0] / f.name
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f.resolve())
    return out


def _dali_loader(files: list[str], labels: list[int], batch: int, threads: int):
    """DALI's CPU pipeline over ``files`` behind its PyTorch iterator, or None without DALI.

    ``fresh()`` builds a new pipeline for each epoch, outside the timed region, and the epoch
    deletes it when done: a DALI pipeline prefetches ahead on its own threads, and one left
    alive would decode the next epoch's first batches while the other cases are being timed
    (stealing their cores, and handing DALI work done off the clock)."""
    try:
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali import types as dtypes
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError:
        return None

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None, seed=0)
    def pipe():
        jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=dtypes.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(images, dtype=dtypes.FLOAT, output_layout="CHW",
                                          mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
                                          mirror=fn.random.coin_flip())
        return images, label

    class _Epoch:
        def __init__(self) -> None:
            p = pipe()
            p.build()
            self.it = DALIGenericIterator([p], ["images", "labels"], reader_name="reader",
                                          last_batch_policy=LastBatchPolicy.PARTIAL)

        def __iter__(self):
            for out in self.it:
                yield out[0]["images"], out[0]["labels"]
            del self.it  # the pipeline and its threads go with it

    class _Loader:
        fresh = _Epoch

    return _Loader()


def _epoch_rate(batches) -> float:
    """img/s over one whole epoch, from ``iter()`` to exhaustion (what a training epoch pays)."""
    t = time.perf_counter()
    n = 0
    for x, _ in batches:
        n += x.shape[0]
    return n / (time.perf_counter() - t)


def run(data: Path, images: int, batch: int, n_batches: int, rounds: int, threads: list[int],
        source: str = "folder", photos: Path | None = None) -> dict:
    if photos is not None:
        data = _photo_folder(photos)
    else:
        make_image_folder(data, images)
    folder = ImageFolder(data)
    need = n_batches * batch
    if len(folder) < need:
        raise SystemExit(f"--data has {len(folder)} images; {need} needed for --batches {n_batches}")
    ds = _Subset(folder, random.Random(0).sample(range(len(folder)), need))
    picked = [folder.samples[i] for i in ds.order]
    files = [p for p, _ in picked]
    transform, baseline_kind = _torchvision_transform()
    tds = _TorchDataset(picked, transform)
    shards = _shards_of(data, picked) if source == "shards" else None
    baseline_source = "folder"

    loaders, folder_loaders, dls, fresh, pools, dalis = {}, {}, {}, {}, {}, {}
    # DataLoader workers are forked first: forked after the FastLoaders' batch buffers exist,
    # they would share those pages copy-on-write, and FastLoader's next pass would pay a page
    # copy per 4 KiB it writes (a third of its rate in the first round, seen on 2 cores).
    for n in threads:
        wds_dl = _webdataset_loader(shards, transform, batch, n, True) if shards else None
        if wds_dl is not None:
            baseline_source = "shards (webdataset)"
            dls[n] = wds_dl
            fresh[n] = _webdataset_loader(shards, transform, batch, n, False)
        else:
            dls[n] = torch.utils.data.DataLoader(tds, batch_size=batch, shuffle=True, num_workers=n,
                                                 persistent_workers=True, prefetch_factor=2)
            # What most training scripts write: workers started (forked) again every epoch.
            fresh[n] = torch.utils.data.DataLoader(tds, batch_size=batch, shuffle=True, num_workers=n)
        _epoch_rate(dls[n])  # warm-up (starts the workers), untimed
    tf = [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(MEAN, STD)]
    for n in threads:
        loaders[n] = FastLoader(TarShards(shards) if shards else ds, tf, batch_size=batch, shuffle=True,
                                num_threads=n, prefetch=3)
        if shards:
            folder_loaders[n] = FastLoader(ds, tf, batch_size=batch, shuffle=True, num_threads=n, prefetch=3)
        pools[n] = ThreadPoolExecutor(n)
        dali = _dali_loader(files, [label for _, label in picked], batch, n)
        if dali is not None:
            dalis[n] = dali

    def decode_batches(n):
        def one(path):
            # Decode only: full-resolution pixels into Pillow's memory, no copy, no transform.
            with Image.open(path) as im:
                im.load()
                return im.size

        order = list(range(len(files)))
        random.shuffle(order)
        for b in range(math.ceil(len(order) / batch)):
            arrs = list(pools[n].map(one, [files[i] for i in order[b * batch:(b + 1) * batch]]))
            yield torch.empty(len(arrs)), None

    def cases(n):
        both = (("fastloader", lambda: loaders[n]),)
        if shards:
            both += (("fastloader-folder", lambda: folder_loaders[n]),)
        both += (("dataloader", lambda: dls[n]), ("dataloader-defaults", lambda: fresh[n]))
        if n in dalis:
            both += (("dali-cpu", lambda: dalis[n].fresh()),)
        return both + (("decode", lambda: decode_batches(n)),)
    names = tuple(c for c, _ in cases(threads[0]))

    def settle(case: str, make) -> None:
        # Each sample starts from an empty pipeline: the next epoch's first batches, which
        # FastLoader begins during an epoch's last ones, would be decoded while another case
        # is timed (credited to FastLoader, taken from that case's cores).
        if case.startswith("fastloader"):
            make().cancel_ahead()

    def warm_epochs(case: str, make) -> int:
        # A FastLoader writes batch b of its run into slot b % (prefetch + 2) (NOTE [batch buffer
        # ownership]): warm-up runs until every slot has been written once. One epoch of two
        # batches left three of five slots untouched, and their first touch (page faults; on a
        # virtual machine's fresh memory, 0.35 GB/s against 6.5 GB/s for reused pages) fell in
        # the timed rounds: the demo's FastLoader at 0.95x DataLoader, 2.0x once warmed.
        if not case.startswith("fastloader"):
            return 1
        loader = make()
        return math.ceil((loader.prefetch + 2) / len(loader))

    for n in threads:
        for case, make in cases(n):
            if case not in ("dataloader", "dataloader-defaults"):
                for _ in range(warm_epochs(case, make)):
                    _epoch_rate(make())  # warm-up (compilation, every slot's first touch), untimed
                settle(case, make)
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for n in threads:
            for case, make in cases(n):
                if case.startswith("fastloader"):
                    make().set_epoch(r)
                rate = _epoch_rate(make())
                settle(case, make)
                samples.setdefault((case, n), []).append(rate)
                print(f"round {r + 1}/{rounds} threads={n} {case:19s} {rate:7.0f} img/s", flush=True)
    for n in threads:
        loaders[n].close()
        if shards:
            folder_loaders[n].close()
        pools[n].shutdown()
        del dls[n], fresh[n]
        dalis.pop(n, None)

    rows, records = [], []
    for n in threads:
        med = {c: statistics.median(samples[(c, n)]) for c in names}
        for c in names:
            s = samples[(c, n)]
            ratio = "" if c == "fastloader" or c == "decode" else f"{med['fastloader'] / med[c]:.2f}x"
            rows.append([c, n, med[c], min(s), max(s), ratio,
                         f"{100 * med['fastloader'] / med['decode']:.0f}%" if c == "decode" else ""])
            records.append({"case": c, "threads": n, "img_per_s": s, "median": med[c]})
    print()
    print(f"{len(ds)} of the JPEGs in {data} per epoch, batch {batch}, one epoch per sample, "
          f"{rounds} interleaved rounds; source: {source}; DataLoader reads: {baseline_source}; "
          f"baseline transforms: {baseline_kind}")
    print(format_table(["case", "threads", "img/s median", "min", "max", "fast/this", "fast/decode"], rows))
    return {"data": str(photos or data), "real_photographs": photos is not None, "images": len(ds),
            "batch": batch, "batches": n_batches, "source": source, "dataloader_reads": baseline_source,
            "baseline": baseline_kind, "records": records, "threads": threads}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=("folder", "shards"), default="folder",
                   help="what FastLoader reads: the files, or the same images packed as tar shards")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--photos", type=Path, default=None,
                   help="real JPEG photographs (class folders or flat <class>_<name>.JPEG files)")
    p.add_argument("--images", type=int, default=None,
                   help="images to generate if --data is empty (default: enough for --batches, >= 3000)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=None, help="batches per epoch (one timed sample)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help="thread counts (default: 1 .. cores available)")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or sorted({1, cores})
    batches = args.batches or max(6, 4 * max(threads))
    images = args.images or max(3000, batches * args.batch)
    result = run(args.data, images, args.batch, batches, args.rounds, threads, args.source, args.photos)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for case in sorted({r["case"] for r in result["records"]}):
            ys = [next(r["median"] for r in result["records"] if r["case"] == case and r["threads"] == n)
                  for n in threads]
            ax.plot(threads, ys, marker="o", label=case)
        ax.set_xlabel("threads / workers")
        ax.set_ylabel("images / s")
        ax.set_xticks(threads)
        ax.legend()
        ax.grid(alpha=0.3)
        return fig

    name = "loader" if args.source == "folder" else "loader_shards"
    for f in save(name + ("_photos" if args.photos else ""), result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
