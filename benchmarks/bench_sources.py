"""Reading data where it lives, at scale: the same N synthetic small images as a folder, as a
parquet file (`hf_dataset`) and as WebDataset tar shards (`shards`), each scanned and decoded by
the kit, against reading the same bytes bare (the floor). Ratios are measured in one run, and the
rates are projected to 1.4 M images on 8 processes.

1. scan: `kit.data.scan.scan` (sizes from headers, captions, content digests; for shards and
   parquet the first pass, then a second run reading the saved scans) vs. the floor: the source's bytes read
   plainly (every file; the parquet's image column; every shard front to back);
2. decode: what the cache build does per image before the VAE (read its bytes from the source,
   shards front to back, decode, fit to the bucket) on the first `--decode` samples, vs. the
   floor: the same bytes read.
3. shard reads: the cache build's reading from shards (bytes to decoded, fitted images) on the
   first `--decode` samples, each image by its own range request against each shard read front
   to back once (`kit.data.shard_reads`), from local files and from an S3 server on loopback
   (moto's; skipped without `moto` and `s3fs`): ratios of the same run. `--reads-only` skips
   1 and 2 (and the folder and parquet copies).

CI never runs it. Usage: python benchmarks/bench_sources.py [--n 100000] [--decode 5000] [--reads-only]
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
from kit.data.blob import expand_braces, open_dataset
from kit.data.buckets import plan_buckets
from kit.data.pixels import sample_pixels
from kit.data.scan import scan
from kit.data.shard_reads import in_read_order
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
    samples, places = plan.samples, plan.placements
    sample_pixels(samples[0], places[0], cfg.data)  # imports torch: not timed
    t = time.perf_counter()
    for i, raw in in_read_order(samples, range(len(samples))):  # shards: front to back
        sample_pixels(samples[i], places[i], cfg.data, raw)
    return time.perf_counter() - t


def shard_reads(cfg, k: int, repeat: int = 3) -> dict[str, float]:
    """Seconds to read the first `k` samples' bytes, and to read, decode and fit them, each image
    by its range vs. each shard front to back (a scan first, not timed); the best of `repeat`."""
    rep = scan(cfg.data)
    plan = plan_buckets(rep.samples[:k], cfg.data, step=32, seed=0)
    samples, places = plan.samples, plan.placements
    sample_pixels(samples[0], places[0], cfg.data)  # imports torch: not timed

    def read_ranged():
        for s in samples:
            s.blob.read()

    def read_streamed():
        for _ in in_read_order(samples, range(len(samples))):
            pass

    def ranged():
        for s, p in zip(samples, places, strict=True):
            sample_pixels(s, p, cfg.data)

    def streamed():
        for i, raw in in_read_order(samples, range(len(samples))):
            sample_pixels(samples[i], places[i], cfg.data, raw)

    runs = {
        "read, ranges": read_ranged,
        "read, front to back": read_streamed,
        "decode, ranges": ranged,
        "decode, front to back": streamed,
    }
    out = {name: float("inf") for name in runs}
    for _ in range(repeat):  # interleaved, the best of each: a shared machine's noise
        for name, fn in runs.items():
            out[name] = min(out[name], timed(fn)[0])
    return out


def s3_server(shards: list[Path]):
    """An S3 server on a loopback port (moto's) holding the shards; (stop, URL pattern), or None
    without moto and s3fs."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    fs = s3fs.S3FileSystem()
    fs.mkdir("bench-shards")
    for shard in shards:
        fs.put(str(shard), f"bench-shards/{shard.name}")
    last = len(shards) - 1
    return server.stop, f"s3://bench-shards/train-{{000000..{last:06d}}}.tar"


def print_reads(n_images: int, k: int, per_shard: int, results: dict[str, dict[str, float]]):
    print(f"\nshard reads: the first {k:,} of {n_images:,} images ({per_shard} per shard)\n")
    print(
        "| shards | read: ranges img/s | read: front to back img/s | ratio "
        "| read+decode+fit: ranges img/s | front to back img/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for where, t in results.items():
        rr, rs = k / t["read, ranges"], k / t["read, front to back"]
        dr, ds = k / t["decode, ranges"], k / t["decode, front to back"]
        print(
            f"| {where} | {rr:,.0f} | {rs:,.0f} | {rs / rr:.1f}× | {dr:,.0f} | {ds:,.0f} "
            f"| {ds / dr:.2f}× |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="synthetic images (default 100,000)")
    ap.add_argument("--decode", type=int, default=5000, help="samples decoded per source")
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--keep", help="build the data here and keep it (default: a temp folder)")
    ap.add_argument("--reads-only", action="store_true", help="only the shard reads (part 3)")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-sources-"))
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # saved shard scans
    import datasets

    datasets.config.HF_DATASETS_CACHE = root / "hf-cache"
    datasets.disable_progress_bars()
    folder = root / "folder"
    t0 = time.perf_counter()
    if args.reads_only:
        pattern = write_shards(records(args.n), root / "shards", per_shard=args.per_shard)
        print(f"built {args.n:,} images in {time.perf_counter() - t0:.0f} s under {root}")
        run_reads(args, root, pattern)
        return
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
    run_reads(args, root, pattern)


def run_reads(args, root: Path, pattern: str) -> None:
    """Part 3, on the local shards and on an S3 server holding them; then the data is removed
    unless kept."""
    base = {"resolution": 64, "bucket_step": 32}
    k = min(args.decode, args.n)
    used = expand_braces(pattern)[: -(-k // args.per_shard)]  # the shards holding the first k
    local = pattern.rsplit("{", 1)[0] + f"{{000000..{len(used) - 1:06d}}}.tar"
    results = {"local files": shard_reads(from_dict({**base, "datasets": [{"shards": local}]}), k)}
    server = s3_server([Path(p) for p in used])
    if server is None:
        print("S3: skipped (pip install moto s3fs)")
    else:
        stop, url = server
        try:
            cfg = from_dict({**base, "datasets": [{"shards": url}]})
            results["S3 on loopback (moto)"] = shard_reads(cfg, k)
        finally:
            stop()
    print_reads(args.n, k, args.per_shard, results)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
