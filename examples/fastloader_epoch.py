"""One training-style epoch over an image folder with FastLoader, printing throughput.

    python examples/fastloader_epoch.py DATA_DIR [--batch-size 256] [--threads N]

DATA_DIR is class-per-folder (``DATA_DIR/<class>/<image>``), like torchvision's ImageFolder.
"""

import argparse
import time

from terrapipe import FastLoader
from terrapipe.pipeline import ImageFolder, Normalize, RandomHorizontalFlip, RandomResizedCrop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("data")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()

    ds = ImageFolder(args.data)
    transforms = [RandomResizedCrop(224), RandomHorizontalFlip(),
                  Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    with FastLoader(ds, transforms, batch_size=args.batch_size, shuffle=True,
                    num_threads=args.threads) as loader:
        start = time.perf_counter()
        seen = 0
        for images, _labels in loader:
            seen += images.shape[0]
            print(f"\r{seen}/{len(ds)} images  {seen / (time.perf_counter() - start):.0f} img/s  "
                  f"batch {tuple(images.shape)} {images.dtype}", end="", flush=True)
        print(f"\n{len(ds.classes)} classes; skipped samples: {len(loader.skipped)}")


if __name__ == "__main__":
    main()
