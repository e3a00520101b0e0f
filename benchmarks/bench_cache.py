"""Cache storage: one file per entry (`cache_format: files`) vs. shards (`shards`, with and without
zlib), measured in one run.

For N synthetic entries shaped like SD1.5 at 512 px (a 4x64x64 fp32 latent and a 77x768 text
embedding each) it reports, per layout: the files written, the bytes on disk, the write time,
the first check of every entry (`has`: for shards, reading each shard through once and checking
its CRCs), and the time to read random batches as `CachedDataset.load_batch` does (one latent
and one text entry per sample, stacked), as a ratio to the one-file layout. The OS page cache is
warm for every layout alike (each is read once before timing).

Usage: python benchmarks/bench_cache.py [--entries N] [--batch B] [--batches K]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from kit.data.store import FileStore, ShardStore


def entries(n: int, seed: int = 0) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    # Latents as a VAE gives them (smooth-ish, so compression has something to find): a noisy
    # upsampled field; text embeddings as half-precision values widened to fp32.
    out = []
    for _ in range(n):
        coarse = torch.randn(1, 4, 16, 16, generator=g)
        lat = torch.nn.functional.interpolate(coarse, size=(64, 64), mode="bilinear")[0]
        lat = lat + 0.05 * torch.randn(4, 64, 64, generator=g)
        text = torch.randn(77, 768, generator=g).half().float()
        out.append(({"latents": lat.contiguous()}, {"prompt_embeds": text}))
    return out


def measure(kind: str, root: Path, data: list, batch: int, batches: int) -> dict[str, float]:
    lat_dir, text_dir = root / "latents" / "v", root / "text" / "t"
    keys = [(lat_dir / f"{i:032x}.safetensors", text_dir / f"{i:032x}.safetensors") for i in range(len(data))]  # fmt: skip
    store = FileStore() if kind == "files" else ShardStore(compression=kind.split("+")[-1])
    t = time.perf_counter()
    for (lk, tk), (lat, text) in zip(keys, data, strict=True):
        store.put(lk, lat)
        store.put(tk, text)
    store.flush()
    write_s = time.perf_counter() - t
    files = [p for p in root.rglob("*") if p.is_file()]

    reader = FileStore() if kind == "files" else ShardStore()
    t = time.perf_counter()
    assert all(reader.has(lk) and reader.has(tk) for lk, tk in keys)
    check_s = time.perf_counter() - t

    def read(indices: list[int]) -> None:
        lat = torch.stack([reader.get(keys[i][0])["latents"] for i in indices])
        text = torch.stack([reader.get(keys[i][1])["prompt_embeds"] for i in indices])
        assert lat.shape[0] == text.shape[0]

    rng = random.Random(0)
    read(list(range(len(keys))))  # warm the page cache and open every shard
    t = time.perf_counter()
    for _ in range(batches):
        read(rng.sample(range(len(keys)), batch))
    read_s = (time.perf_counter() - t) / batches
    return {
        "files": len(files),
        "mib_on_disk": sum(p.stat().st_size for p in files) / 2**20,
        "write_s": write_s,
        "check_s": check_s,
        "batch_read_ms": read_s * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=300)
    args = ap.parse_args()
    data = entries(args.entries)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("files", "shards+none", "shards+zlib"):
            results[kind] = measure(kind, Path(tmp) / kind, data, args.batch, args.batches)
    base = results["files"]["batch_read_ms"]
    for r in results.values():
        r["read_vs_files"] = r["batch_read_ms"] / base
    print(json.dumps({"entries": args.entries, "batch": args.batch, **results}, indent=1))


if __name__ == "__main__":
    main()
