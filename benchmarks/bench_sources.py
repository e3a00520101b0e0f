"""Reading data where it lives, at scale: the same N synthetic small images as a folder, as a
parquet file (`hf_dataset`) and as WebDataset tar shards (`shards`), each scanned and decoded by
the kit, against reading the same bytes bare (the floor). Ratios are measured in one run, and the
rates are projected to 1.4 M images on 8 processes.

1. scan: `kit.data.scan.scan` (sizes from headers, captions, content digests; for shards and
   parquet the first pass, then a second run reading the saved scans) vs. the floor: the source's bytes read
   plainly (every file; the parquet's image column; every shard front to back);
2. decode: what the cache build does per image before the VAE (read its bytes from the source,
   decode, fit to the bucket) on the first `--decode` samples, vs. the floor: the same bytes read.

CI never runs it. Usage: python benchmarks/bench_sources.py [--n 100000] [--decode 5000]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from PIL import Image

from kit.config import from_dict
from kit.data.blob import open_dataset
from kit.data.buckets import plan_buckets
from kit.data.pixels import sample_pixels
from kit.data.scan import scan
from kit.data.sources.write import write_parquet, write_shards

TARGET_IMAGES, TARGET_PROCESSES = 1_400_000, 8


def records(n: int, seed: int = 0):
    """`n` small JPEGs (64-128 px sides, a few shapes and colours) with a caption each."""
    rng = random.Random(seed)
    shapes = [(64, 64), (96, 64), (64, 96), (128, 96), (96, 128)]
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        im = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
        im.paste(tuple(rng.randrange(256) for _ in range(3)), (w // 4, h // 4, w // 2, h // 2))
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        yield f"{i:07d}", "jpg", buf.getvalue(), f"a picture number {i}, a square on a field"


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def floor_folder(folder: Path) -> int:
    total = 0
    for p in sorted(folder.iterdir()):
        with open(p, "rb") as f:
            total += len(f.read())
    return total


def floor_parquet(path: Path) -> int:
    col = pq.read_table(path, columns=["image"], memory_map=True).column("image")
    return sum(len(b.as_buffer()) for chunk in col.chunks for b in chunk.field("bytes"))


def floor_shards(pattern_dir: Path) -> int:
    total = 0
    for p in sorted(pattern_dir.glob("*.tar")):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def decode(cfg, n: int) -> float:
    """Seconds to read, decode and fit the first `n` samples, as the cache build does."""
    rep = scan(cfg.data)
    plan = plan_buckets(rep.samples[:n], cfg.data, step=32, seed=0)
    sample_pixels(plan.samples[0], plan.placements[0], cfg.data)  # imports torch: not timed
    t = time.perf_counter()
    for s, p in zip(plan.samples, plan.placements, strict=True):
        sample_pixels(s, p, cfg.data)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="synthetic images (default 100,000)")
    ap.add_argument("--decode", type=int, default=5000, help="samples decoded per source")
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--keep", help="build the data here and keep it (default: a temp folder)")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-sources-"))
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # saved shard scans
    import datasets

    datasets.config.HF_DATASETS_CACHE = root / "hf-cache"
    datasets.disable_progress_bars()
    folder = root / "folder"
    t0 = time.perf_counter()
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for key, ext, data, caption in records(args.n):
            (folder / f"{key}.{ext}").write_bytes(data)
            (folder / f"{key}.txt").write_text(caption)
    recs = list(records(args.n))
    parquet = root / "data.parquet"
    if not parquet.is_file():
        write_parquet(recs, parquet)
    pattern = write_shards(recs, root / "shards", per_shard=args.per_shard)
    del recs
    print(f"built {args.n:,} images in {time.perf_counter() - t0:.0f} s under {root}")
    base = {"resolution": 64, "bucket_step": 32}
    cfgs = {
        "folder": from_dict({**base, "image_dir": str(folder)}),
        "parquet": from_dict({**base, "datasets": [{"hf_dataset": str(parquet)}]}),
        "shards": from_dict({**base, "datasets": [{"shards": pattern}]}),
    }
    floors = {
        "folder": lambda: floor_folder(folder),
        "parquet": lambda: floor_parquet(parquet),
        "shards": lambda: floor_shards(root / "shards"),
    }
    rows = []
    for name, cfg in cfgs.items():
        if name == "parquet":  # `datasets` prepares the parquet once (Arrow): not timed
            open_dataset(str(parquet), "train")
        shutil.rmtree(root / "cache", ignore_errors=True)  # no saved scans: a first run
        floor_s, nbytes = timed(floors[name])
        scan_s, rep = timed(lambda cfg=cfg: scan(cfg.data))
        assert len(rep.samples) == args.n, rep.summary()
        again_s = timed(lambda cfg=cfg: scan(cfg.data))[0] if name != "folder" else None
        k = min(args.decode, args.n)
        dec_s = decode(cfg, k)
        dec_floor = floor_s * k / args.n
        rows.append((name, args.n / floor_s, args.n / scan_s, again_s, k / dec_s, dec_floor, dec_s))
        print(f"{name}: {nbytes / 1e6:.0f} MB", flush=True)
    print(f"\nn = {args.n:,} images ({args.per_shard} per shard), decode on {k:,} of them\n")
    print(
        "| source | floor (bytes read bare) img/s | scan img/s | scan / floor | rescan img/s "
        "| decode+fit img/s | decode / floor |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, floor, rate, again, dec, dec_floor, dec_s in rows:
        re_rate = f"{args.n / again:,.0f}" if again else "-"
        print(
            f"| {name} | {floor:,.0f} | {rate:,.0f} | {rate / floor:.2f}× | {re_rate} | "
            f"{dec:,.0f} | {dec_floor / dec_s:.3f}× |"
        )
    print(
        f"\nprojection to {TARGET_IMAGES:,} images on {TARGET_PROCESSES} processes "
        "(from the rates above, one core per process, VAE time not included):"
    )
    for name, _floor, rate, again, dec, _df, _ds in rows:
        share = TARGET_PROCESSES if name != "folder" else 1  # shards' and rows' scans are shared
        scan_min = TARGET_IMAGES / rate / share / 60
        dec_min = TARGET_IMAGES / (dec * TARGET_PROCESSES) / 60
        line = f"- {name}: first scan {scan_min:.1f} min"
        line += " (split between the processes)" if share > 1 else " (every process)"
        if again:
            line += f", a later run's {TARGET_IMAGES / (args.n / again) / 60:.1f} min"
        print(line + f"; reading and decoding for the cache {dec_min:.1f} min (each process 1/8)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
