"""Data pipeline speed, as ratios measured in one run.

1. scanning a folder of images: `kit.data.scan.scan` (sizes from headers, captions, checks) vs. two
   baselines, in images/s: PIL reading bare headers (the floor) and opening and fully decoding
   every image (what a scanner that loads pixels costs);
2. building the latent and text cache of the example dataset (hashing, encoding, atomic
   writes) vs. a plain loop that only encodes the same images and captions, in images/s; and a
   rebuild with every entry present;
3. training from the cache vs. encoding images and captions every step (from bench_train);
4. `kit buckets --json` on the same folder, as a process from start to exit, vs. a process that
   only reads each image's header and its caption (the least any such command can do): the
   command's fixed costs (imports, config) show up here, not in the in-process scan above.

Usage: python benchmarks/bench_data.py [--images N] [--steps N] [--repeats N] [--skip-cache]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from kit.config import DataConfig
from kit.data.scan import scan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_images(folder: Path, n: int) -> None:
    """`n` small images (PNG and JPEG, a few shapes) with one caption file each."""
    shapes = [(256, 256), (320, 192), (192, 320), (384, 256)]
    tiles = {s: Image.new("RGB", s, (40 + 20 * i, 90, 160)) for i, s in enumerate(shapes)}
    for i in range(n):
        ext = ".png" if i % 2 else ".jpg"
        tiles[shapes[i % len(shapes)]].save(folder / f"img_{i:05d}{ext}")
        (folder / f"img_{i:05d}.txt").write_text(f"image {i}, a test pattern")


def decode_all(folder: Path) -> int:
    """The baseline: open and fully decode every image, as a naive scanner would."""
    n = 0
    for p in sorted(folder.iterdir()):
        if p.suffix in (".png", ".jpg"):
            with Image.open(p) as im:
                im.load()
            n += 1
    return n


def headers_only(folder: Path) -> int:
    """The floor: PIL reads each image's header and nothing else."""
    n = 0
    for p in sorted(folder.iterdir()):
        if p.suffix in (".png", ".jpg"):
            with Image.open(p) as im:
                im.size  # noqa: B018
            n += 1
    return n


BARE_READ = """
import os, sys
from PIL import Image
folder = sys.argv[1]
for name in sorted(os.listdir(folder)):
    stem, ext = os.path.splitext(name)
    if ext in (".png", ".jpg"):
        with Image.open(os.path.join(folder, name)) as im:
            im.size
        with open(os.path.join(folder, stem + ".txt"), encoding="utf-8") as f:
            f.read()
"""
"""The baseline process: every image's size from its header and every caption read, nothing else."""


def process_seconds(cmd: list[str]) -> tuple[float, float]:
    """Wall time and CPU time (user + system) of one process from start to exit, its output
    discarded. On a busy machine the CPU time is the steadier of the two."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def buckets_vs_bare_read(folder: Path, repeats: int) -> dict[str, float]:
    """`kit buckets --json` against the bare header-and-caption read, each a fresh process
    (both pay the interpreter's start), alternated A B A B; the fastest of each is kept."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({"image_dir": str(folder)}))
        kit = [sys.executable, "-m", "kit", "buckets", str(config), "--json"]
        bare = [sys.executable, "-c", BARE_READ, str(folder)]
        times: dict[str, list[tuple[float, float]]] = {"kit": [], "bare": []}
        for _ in range(repeats):
            times["kit"].append(process_seconds(kit))
            times["bare"].append(process_seconds(bare))
    kit_s, bare_s = (min(w for w, _ in times[k]) for k in ("kit", "bare"))
    kit_cpu, bare_cpu = (min(c for _, c in times[k]) for k in ("kit", "bare"))
    return {
        "kit_buckets_s": round(kit_s, 2),
        "bare_read_s": round(bare_s, 2),
        "kit_buckets_vs_bare_read": round(kit_s / bare_s, 2),
        "kit_buckets_cpu_s": round(kit_cpu, 2),
        "bare_read_cpu_s": round(bare_cpu, 2),
        "kit_buckets_vs_bare_read_cpu": round(kit_cpu / bare_cpu, 2),
    }


def cache_build(resolution: int = 128) -> dict[str, float]:
    """Images/s of `kit.data.cache.build_cache` (cold, then warm) and of a plain encode-only loop."""
    import torch

    from kit.config import from_dict
    from kit.data.buckets import plan_dataset
    from kit.data.cache import build_cache
    from kit.data.pixels import load_pixels
    from kit.families import get_family

    family = get_family("sd15")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        base = family.make_tiny(Path(tmp) / "tiny")
        cfg = from_dict(
            {
                "pretrained_model": str(base),
                "image_dir": str(ROOT / "datasets_example/images"),
                "cache_dir": str(Path(tmp) / "cache"),
                "resolution": resolution,
                "bucket_step": 32,
            }
        )
        comps = family.load(str(base))
        samples, plan = plan_dataset(cfg)

        def plain() -> int:
            with torch.no_grad():
                for s, p in zip(samples, plan.placements, strict=True):
                    family.encode_images(comps, load_pixels(s.image, p).unsqueeze(0))
                    family.encode_text(comps, [s.caption])
            return len(samples)

        plain()  # warm-up: first calls pay for allocation and file reads
        n, plain_s = timed(plain)
        _, cold_s = timed(lambda: build_cache(cfg, family, comps, progress=False))
        _, warm_s = timed(lambda: build_cache(cfg, family, comps, progress=False))
    return {
        "cache_images": n,
        "cache_build_images_per_s": round(n / cold_s, 1),
        "plain_encode_images_per_s": round(n / plain_s, 1),
        "cache_build_vs_plain_encode": round(plain_s / cold_s, 2),
        "cache_rebuild_all_present_images_per_s": round(n / warm_s, 1),
    }


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each process timed")
    parser.add_argument(
        "--skip-cache", action="store_true", help="only the scan and `kit buckets` benchmarks"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_images(folder, args.images)
        decode_all(folder)  # warm the file cache, so both sides read from memory
        report, scan_s = timed(lambda: scan(DataConfig(image_dir=str(folder))))
        assert len(report.samples) == args.images, report.problems()
        _, decode_s = timed(lambda: decode_all(folder))
        _, header_s = timed(lambda: headers_only(folder))
        processes = buckets_vs_bare_read(folder, args.repeats)
    result: dict[str, float] = {
        "images": args.images,
        "scan_images_per_s": round(args.images / scan_s),
        "decode_images_per_s": round(args.images / decode_s),
        "header_images_per_s": round(args.images / header_s),
        "scan_speedup_vs_decoding": round(decode_s / scan_s, 2),
        "scan_speed_vs_bare_headers": round(header_s / scan_s, 2),
        **processes,
    }
    if not args.skip_cache:
        result.update(cache_build())
        train = measure(args.steps, 128, checkpointing=False)
        result["cached_steps_per_s"] = train["cached_steps_per_s"]
        result["encoded_steps_per_s"] = train["encoded_steps_per_s"]
        result["cache_speedup"] = train["cache_speedup_vs_encoding_each_step"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
