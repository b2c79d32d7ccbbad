"""Kernel throughput next to the NumPy / Pillow equivalent and the machine's copy bandwidth.

    python -m benchmarks.kernels [--quick] [--mib 256] [--photos DIR] [--samples 200]

``--photos DIR``: the per-sample chain on real photographs (JPEGs under DIR, e.g. a public
one-image-per-class ImageNet sample), each with a RandomResizedCrop box: our crop + antialiased
bilinear resize to 224 + flip + normalize into a float32 CHW slot (one call of
``kernels.image.resize_crop_bilinear_region``, on the RGBX pixels the loader's region decoder
yields) against Pillow(-SIMD) doing the same work (``resize`` of the box, ``FLIP_LEFT_RIGHT``,
``asarray``, then our normalize table), one thread, the two alternating every round; and the
resampling alone (uint8 out) against Pillow's ``resize`` alone. Without it, one synthetic
500x375 image stands in.

Bandwidth is memory traffic per second: bytes read plus bytes written (a copy of N bytes moves
2N, ``dst += src`` moves 3N). The ceiling, ``np.copyto`` of a large array, is measured in the
same run, interleaved with the kernels. Image kernels are reported in images per second.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from terrapipe.kernels import image, reduce, resample_ir, rng

from .common import format_table, interleave, save, stats


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def memory_cases(n_bytes: int) -> tuple[dict, dict]:
    """(cases, traffic bytes per call) for the reduction kernels and their NumPy equivalents."""
    n = n_bytes // 4
    g = np.random.default_rng(0)
    a32 = g.standard_normal(n).astype(np.float32)
    b32 = g.standard_normal(n).astype(np.float32)
    c32 = np.empty_like(a32)
    two32 = np.stack([a32, b32])
    h = n_bytes // 2  # 16-bit arrays of the same byte size
    a16 = g.standard_normal(h).astype(np.float16)
    b16 = g.standard_normal(h).astype(np.float16)
    abf = _bf16(g.standard_normal(h))
    bbf = _bf16(g.standard_normal(h))
    two16 = np.stack([a16, b16])
    out16 = np.empty(h, np.float16)
    two_bf = np.stack([abf, bbf])
    out_bf = np.empty(h, np.uint16)
    acc = np.empty(reduce.TILE, np.float32)
    a16u, b16u = a16.view(np.uint16), b16.view(np.uint16)
    two16u, out16u = two16.view(np.uint16), out16.view(np.uint16)
    R = reduce

    def np_half_sum():
        # What a NumPy user writes for half precision: accumulate in float32, round once.
        np.add(a16, b16, out=a16, dtype=np.float32)

    def np_bf16_sum():
        x = (abf.astype(np.uint32) << 16).view(np.float32)
        y = (bbf.astype(np.uint32) << 16).view(np.float32)
        abf[:] = _bf16(x + y)

    cases = {
        "memcpy (np.copyto)": (lambda: np.copyto(c32, a32), 2 * n_bytes),
        "sum f32 dst+=src [ours]": (lambda: R.reduce_native(a32, b32, R.SUM, 0, n), 3 * n_bytes),
        "sum f32 dst+=src [numpy]": (lambda: np.add(a32, b32, out=a32), 3 * n_bytes),
        "max f32 dst=max(dst,src) [ours]": (lambda: R.reduce_native(a32, b32, R.MAX, 0, n), 3 * n_bytes),
        "max f32 dst=max(dst,src) [numpy]": (lambda: np.maximum(a32, b32, out=a32), 3 * n_bytes),
        "sum f32 2 sources->dst [ours]": (lambda: R.reduce_many_native(c32, two32, R.SUM, 0, n), 3 * n_bytes),
        "sum f32 2 sources->dst [numpy]": (lambda: np.sum(two32, axis=0, out=c32), 3 * n_bytes),
        "sum f16 dst+=src [ours]": (lambda: R.reduce_16(a16u, b16u, R.SUM, 0, h, 1), 3 * n_bytes),
        "sum f16 dst+=src [numpy]": (np_half_sum, 3 * n_bytes),
        "sum bf16 dst+=src [ours]": (lambda: R.reduce_16(abf, bbf, R.SUM, 0, h, 2), 3 * n_bytes),
        "sum bf16 dst+=src [numpy]": (np_bf16_sum, 3 * n_bytes),
        "sum f16 2 sources->dst [ours]": (
            lambda: R.reduce_many_16(out16u, two16u, R.SUM, 0, h, 1, acc), 3 * n_bytes),
        "sum bf16 2 sources->dst [ours]": (
            lambda: R.reduce_many_16(out_bf, two_bf, R.SUM, 0, h, 2, acc), 3 * n_bytes),
        "avg f32 dst/=n [ours]": (lambda: R.divide_float(a32, 2.0, 0, n), 2 * n_bytes),
        "avg f32 dst/=n [numpy]": (lambda: np.divide(a32, np.float32(2), out=a32), 2 * n_bytes),
    }
    return {k: v[0] for k, v in cases.items()}, {k: v[1] for k, v in cases.items()}


def image_cases() -> dict:
    """Per-sample image work at ImageNet sizes: a 500x375 source to a 224x224 training crop."""
    from PIL import Image

    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:375, 0:500]
    src = np.clip((np.sin(xx / 23.0) * 60 + np.cos(yy / 17.0) * 50 + 128)[..., None]
                  + g.normal(0, 12, (375, 500, 3)), 0, 255).astype(np.uint8)
    box = (40.0, 25.0, 430.0, 340.0)
    lut = image.build_normalize_lut((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    out_f = np.empty((3, 224, 224), np.float32)
    scratch = image.alloc_resize_scratch(375, 500, 224, 224, 3)
    pil = Image.fromarray(src)
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    hwc = np.ascontiguousarray(src[:224, :224])
    chw8 = np.empty((3, 224, 224), np.uint8)
    flipped = np.empty_like(hwc)

    def pillow_numpy_chain():
        # What a Pillow + NumPy pipeline does: resize the box, flip, to float CHW, normalize.
        r = pil.resize((224, 224), Image.BILINEAR, box=box).transpose(Image.FLIP_LEFT_RIGHT)
        out_f[:] = (np.asarray(r, np.float32).transpose(2, 0, 1) / 255 - mean) / std

    return {
        "crop+resize+flip+normalize->CHW f32 [ours]": lambda: image.resize_crop_bilinear(
            src, *box, out_f, lut, True, *scratch),
        "crop+resize+flip+normalize->CHW f32 [pillow+numpy]": pillow_numpy_chain,
        "crop+resize 224 uint8 [pillow]": lambda: pil.resize((224, 224), Image.BILINEAR, box=box),
        "hflip 224x224x3 [ours]": lambda: image.hflip(hwc, flipped),
        "hflip 224x224x3 [numpy]": lambda: np.copyto(flipped, hwc[:, ::-1]),
        "hwc->chw uint8 [ours]": lambda: image.hwc_to_chw(hwc, chw8),
        "hwc->chw uint8 [numpy]": lambda: np.copyto(chw8, hwc.transpose(2, 0, 1)),
        "normalize lut->CHW f32 [ours]": lambda: image.normalize_lut(hwc, lut, out_f),
        "normalize->CHW f32 [numpy]": lambda: np.copyto(
            out_f, (hwc.transpose(2, 0, 1).astype(np.float32) / 255 - mean) / std),
    }


def photo_cases(photos: Path, samples: int) -> dict:
    """Per-sample chains over real photographs, one RandomResizedCrop box each (seeded)."""
    from PIL import Image

    files = sorted(p for p in photos.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise SystemExit(f"--photos: no JPEG files under {photos}")
    files = files[:: max(1, len(files) // samples)][:samples]
    g = np.random.default_rng(0)
    work = []
    for f in files:
        with Image.open(f) as im:
            pil = im.convert("RGB")
        w, h = pil.size
        box = (0.0, 0.0, float(w), float(h))
        for _ in range(10):  # torchvision's RandomResizedCrop(scale=(0.08, 1), ratio=(3/4, 4/3))
            area = w * h * g.uniform(0.08, 1.0)
            aspect = np.exp(g.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw, ch = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                x0, y0 = int(g.integers(0, w - cw + 1)), int(g.integers(0, h - ch + 1))
                box = (float(x0), float(y0), float(x0 + cw), float(y0 + ch))
                break
        rgbx = np.asarray(pil.convert("RGBA")).copy()  # the region decoder's pixel layout
        work.append((pil, rgbx, box, bool(g.integers(0, 2))))
    big_h = max(a.shape[0] for _, a, _, _ in work)
    big_w = max(a.shape[1] for _, a, _, _ in work)
    lut = image.build_normalize_lut((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    ident = image.identity_lut(3)
    out_f = np.empty((3, 224, 224), np.float32)
    out_u8 = np.empty((3, 224, 224), np.uint8)
    scratch = image.alloc_resize_scratch(big_h, big_w, 224, 224, 4)
    narrow = bool(scratch[-1][resample_ir.P_NARROW])
    # The arithmetic this CPU does not default to (NOTE [a kernel generated for the machine at
    # hand] 6 in kernels/resample_ir.py), for the record of which one wins where.
    other = image.alloc_resize_scratch(big_h, big_w, 224, 224, 4, narrow=not narrow)
    n = len(work)

    def ours_chain():
        for _, a, box, flip in work:
            image.resize_crop_bilinear_region(a, 0, 0, a.shape[1], a.shape[0], *box, out_f, lut, flip,
                                              *scratch)

    def pillow_chain():
        for pil, _, box, flip in work:
            r = pil.resize((224, 224), Image.BILINEAR, box=box)
            if flip:
                r = r.transpose(Image.FLIP_LEFT_RIGHT)
            image.normalize_lut(np.asarray(r), lut, out_f)

    def ours_resize():
        for _, a, box, _ in work:
            image.resize_crop_bilinear_region(a, 0, 0, a.shape[1], a.shape[0], *box, out_u8, ident, False,
                                              *scratch)

    def ours_resize_other():
        for _, a, box, _ in work:
            image.resize_crop_bilinear_region(a, 0, 0, a.shape[1], a.shape[0], *box, out_u8, ident, False,
                                              *other)

    def pillow_resize():
        for pil, _, box, _ in work:
            pil.resize((224, 224), Image.BILINEAR, box=box)

    # Each case runs the whole set; the report divides by its size (seconds per sample).
    return {
        "photo: crop+resize+flip+normalize->CHW f32 [ours]": (ours_chain, n),
        "photo: crop+resize+flip+normalize->CHW f32 [pillow+lut]": (pillow_chain, n),
        "photo: crop+resize 224 uint8 [ours]": (ours_resize, n),
        "photo: crop+resize 224 uint8 [pillow]": (pillow_resize, n),
        f"photo: crop+resize 224 uint8 [ours, {'exact 32-bit' if narrow else '16-bit'} arithmetic]":
            (ours_resize_other, n),
    }


def rng_cases() -> dict:
    out = np.empty(1 << 20, np.float64)
    gen = np.random.Generator(np.random.Philox(0))
    return {
        "philox uniform fill 1M [ours]": lambda: rng.fill_uniform(1, 2, 3, 4, out),
        "philox uniform fill 1M [numpy]": lambda: gen.random(out=out),
    }


def run(mib: int = 256, rounds: int = 7, photos: Path | None = None, samples: int = 200) -> dict:
    mem, traffic = memory_cases(mib << 20)
    mem_s = interleave(mem, rounds=rounds, min_seconds=0.2)
    img_s = interleave(image_cases(), rounds=rounds, min_seconds=0.1)
    photo_info = {}
    if photos is not None:
        chains = photo_cases(photos, samples)
        per_set = interleave({k: fn for k, (fn, _) in chains.items()}, rounds=rounds, min_seconds=0.5)
        size = next(iter(chains.values()))[1]
        img_s.update({k: [t / size for t in v] for k, v in per_set.items()})
        photo_info = {"photos": str(photos), "photo_samples": size}
    rng_s = interleave(rng_cases(), rounds=rounds, min_seconds=0.05)
    copy_bw = traffic["memcpy (np.copyto)"] / stats(mem_s["memcpy (np.copyto)"])["median"] / 1e9
    rows, records = [], []
    for name, samples in mem_s.items():
        st = stats(samples)
        gbs = traffic[name] / st["median"] / 1e9
        rows.append([name, f"{gbs:.2f}", f"{traffic[name] / st['max'] / 1e9:.2f}",
                     f"{traffic[name] / st['min'] / 1e9:.2f}", f"{100 * gbs / copy_bw:.0f}%"])
        records.append({"case": name, "unit": "GB/s", "median": gbs, "samples_s": samples,
                        "fraction_of_copy": gbs / copy_bw})
    img_rows = []
    for group in (img_s, rng_s):
        for name, samples in group.items():
            st = stats(samples)
            img_rows.append([name, f"{st['median'] * 1e6:.1f}", f"{st['min'] * 1e6:.1f}",
                             f"{st['max'] * 1e6:.1f}", f"{1 / st['median']:.0f}"])
            records.append({"case": name, "unit": "s/call", **st, "samples_s": samples})
    print(f"Memory-bound kernels on {mib} MiB arrays (traffic = bytes read + written), "
          f"median of {rounds} interleaved rounds:")
    print(format_table(["kernel", "GB/s", "min", "max", "of memcpy"], rows))
    print()
    print("Per-call kernels (500x375 RGB source, 224x224 output; photo: per real photograph, "
          "one RandomResizedCrop box each):")
    print(format_table(["kernel", "us median", "us min", "us max", "calls/s"], img_rows))
    # The CPU the generated kernels were compiled for: this one's, or Numba's target where
    # NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set one (resample_ir.target), e.g. AVX2 code timed on
    # an AVX-512 machine.
    from numba.core import config as numba_config

    target = {"cpu": resample_ir.target()[0],
              "features": "this machine's" if numba_config.CPU_FEATURES is None else
              f"NUMBA_CPU_FEATURES={numba_config.CPU_FEATURES}"}
    if photo_info:
        med = {r["case"]: r["median"] for r in records if r["unit"] == "s/call"}
        chain = "photo: crop+resize+flip+normalize->CHW f32 "
        resize = "photo: crop+resize 224 uint8 "
        photo_info["chain_ours_over_pillow"] = med[chain + "[ours]"] / med[chain + "[pillow+lut]"]
        photo_info["resize_ours_over_pillow"] = med[resize + "[ours]"] / med[resize + "[pillow]"]
        print(f"\nper sample, ours / Pillow: chain {photo_info['chain_ours_over_pillow']:.2f}, "
              f"resampling alone {photo_info['resize_ours_over_pillow']:.2f} (below 1: ours is faster); "
              f"vector lanes: {resample_ir.vector_lanes()} x int32, "
              f"{'16-bit' if resample_ir.narrow_default() else 'exact 32-bit'} arithmetic, "
              f"compiled for {target['cpu']}"
              f"{'' if numba_config.CPU_FEATURES is None else ' (features: NUMBA_CPU_FEATURES)'}")
    import PIL

    # Pillow-SIMD installs under Pillow's name: its version ("...post..") tells the two apart.
    return {"mib": mib, "rounds": rounds, "copy_gbs": copy_bw, "vector_lanes": resample_ir.vector_lanes(),
            "narrow_arithmetic": resample_ir.narrow_default(), "kernel_target": target,
            "image_library": f"Pillow {PIL.__version__}", **photo_info, "records": records}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="array size for the memory-bound kernels")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="64 MiB, 5 rounds")
    p.add_argument("--photos", type=Path, default=None, help="a folder of real JPEG photographs")
    p.add_argument("--samples", type=int, default=200, help="photographs used from --photos")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = 64, 5
    result = run(args.mib, args.rounds, args.photos, args.samples)

    def plot():
        import matplotlib.pyplot as plt

        recs = [r for r in result["records"] if r["unit"] == "GB/s"]
        fig, ax = plt.subplots(figsize=(9, 5))
        ax.barh([r["case"] for r in recs], [r["median"] for r in recs],
                color=["tab:orange" if "[ours]" in r["case"] else "tab:gray" for r in recs])
        ax.axvline(result["copy_gbs"], color="k", linestyle="--", label="memcpy")
        ax.set_xlabel("GB/s (bytes read + written)")
        ax.invert_yaxis()
        ax.legend()
        return fig

    for f in save("kernels", result, plot):
        print(f"wrote {f}")


if __name__ == "__main__":
    main()
