"""The sharded cache (`cache_format: shards`): few files for many images, reuse without encoding,
one entry re-encoded per change, damaged shards rebuilt and never read, resumable builds, the
same training as with one file per entry, and every process building its share."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from kit.config import load_config
from kit.data import store as store_module
from kit.data.cache import build_cache, plan_cache
from kit.data.store import FileStore, ShardStore
from kit.errors import DataError
from kit.run import checkpoint as ckpt
from kit.sample.embedded import prompt_texts
from kit.sample.validate import default_prompts, image_specs


def cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def write_images(folder: Path, n: int, size: int = 32) -> Path:
    """`n` distinct small images with distinct captions."""
    folder.mkdir(parents=True)
    for i in range(n):
        color = (i % 256, (i // 256) * 29 % 256, 128)
        im = Image.new("RGB", (size, size), color)
        im.putpixel((0, 0), (i % 7, i % 11, i % 13))
        im.save(folder / f"img_{i:04d}.png", compress_level=1)
        (folder / f"img_{i:04d}.txt").write_text(f"zorbstar number {i}")
    return folder


@pytest.fixture()
def setup(make_config, tmp_path):
    """`setup(n, **fields)`: a config on `n` small images, the tiny SD1.5 loaded."""
    from kit.families.loading import load_base

    def make(n: int = 6, **fields):
        data = write_images(tmp_path / f"data{n}", n)
        cfg = load_config(make_config(image_dir=str(data), resolution=32, bucket_step=32, **fields))
        family, comps = load_base(cfg)
        return cfg, family, comps, data

    return make


def quick_encoders(monkeypatch, family) -> dict[str, int]:
    """Cheap stand-ins for the VAE and text encoder (a function of their input), counted."""
    calls = {"images": 0, "text": 0}

    def images(comps, pixels, **_):
        calls["images"] += 1
        return torch.nn.functional.avg_pool2d(pixels, 8).repeat(1, 2, 1, 1)[:, :4]

    def text(comps, texts):
        calls["text"] += len(texts)
        seeds = [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) for t in texts]
        return {"prompt_embeds": torch.stack([torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in seeds])}  # fmt: skip

    monkeypatch.setattr(family, "encode_images", images)
    monkeypatch.setattr(family, "encode_text", text)
    return calls


@pytest.mark.slow
def test_2000_images_fit_in_14_files_and_a_second_plan_encodes_nothing(setup, monkeypatch):
    cfg, family, comps, _ = setup(2000, cache_format="shards")
    calls = quick_encoders(monkeypatch, family)
    first = build_cache(cfg, family, comps, progress=False)
    assert first.stats["latents_encoded"] == 2000 and first.stats["text_encoded"] == 2000
    files = cache_files(Path(cfg.data.cache_dir))
    # 4 latent shards and 4 text shards of 500, one index per folder.
    assert len(files) <= 14, [f.name for f in files]
    assert sum(f.name == "index.json" for f in files) == 2

    calls.update(images=0, text=0)
    again = build_cache(cfg, family, comps, progress=False)
    assert again.stats == {
        "latents_encoded": 0,
        "latents_reused": 2000,
        "text_encoded": 0,
        "text_reused": 2000,
    }
    assert calls == {"images": 0, "text": 0}
    assert cache_files(Path(cfg.data.cache_dir)) == files  # nothing written
    batch, ref = again.load_batch([0, 1999]), first.load_batch([0, 1999])
    assert all(torch.equal(batch[k], ref[k]) for k in ref)


def test_changed_image_or_caption_reencodes_only_its_entry_and_matches_files(setup):
    cfg, family, comps, data = setup(6, cache_format="shards", cache_compression="zlib")
    first = build_cache(cfg, family, comps, progress=False)
    assert first.stats["latents_encoded"] == 6 and first.stats["text_encoded"] == 6
    # The same tensors as one file per entry (compressed or not, bit for bit).
    files = build_cache(
        cfg.replace(cache_format="files", cache_dir=str(Path(cfg.data.cache_dir) / "f")),
        family,
        comps,
        progress=False,
    )
    ours, theirs = first.load_batch(list(range(6))), files.load_batch(list(range(6)))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    (data / "img_0002.txt").write_text("zorbstar, now with another caption")
    im = Image.open(data / "img_0004.png").convert("RGB")
    im.putpixel((5, 5), (1, 2, 3))
    im.save(data / "img_0004.png")
    again = build_cache(cfg, family, comps, progress=False)
    assert again.stats == {
        "latents_encoded": 1,
        "latents_reused": 5,
        "text_encoded": 1,
        "text_reused": 5,
    }


def test_a_damaged_shard_is_reported_rebuilt_and_never_read(setup):
    cfg, family, comps, _ = setup(6, cache_format="shards")
    first = build_cache(cfg, family, comps, progress=False)
    good = first.load_batch(list(range(6)))
    shard = next(first.latent_files[0].parent.glob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-20:-10] = bytes(255 - b for b in raw[-20:-10])  # flip bytes inside the tensor data
    shard.write_bytes(raw)

    with pytest.warns(UserWarning, match=rf"cache shard .*{shard.name} is damaged"):
        planned = plan_cache(cfg, comps.identity, torch.float32)
        assert planned.missing() == {"latents": 6, "text": 0}
    assert not shard.exists()  # removed, with its index entry
    rebuilt = build_cache(cfg, family, comps, progress=False)
    assert rebuilt.stats["latents_encoded"] == 6 and rebuilt.stats["text_encoded"] == 0
    batch = rebuilt.load_batch(list(range(6)))
    assert all(torch.equal(batch[k], good[k]) for k in good)

    # Damage done after the shard was checked (it is open, memory-mapped) stops the read.
    reader = plan_cache(cfg, comps.identity, torch.float32)
    assert reader.missing()["latents"] == 0
    key = reader.latent_files[0].stem
    folder = reader.store.folders[reader.latent_files[0].parent]
    name = folder.where[key]
    offset = folder.open[name].entries[key]["latents"][2]
    with open(folder.dir / name, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DataError, match="failed its checksum"):
            reader.load_batch([0])
    assert not (folder.dir / name).exists()


def test_a_build_stopped_midway_resumes_with_only_the_rest(setup, monkeypatch):
    monkeypatch.setattr(store_module, "SHARD_ENTRIES", 4)
    cfg, family, comps, _ = setup(10, cache_format="shards")
    real, calls = family.encode_images, {"n": 0}

    def flaky(c, pixels, **kw):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real(c, pixels, **kw)

    monkeypatch.setattr(family, "encode_images", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, family, comps, progress=False)
    # One full shard of 4, and the 2 encoded after it, written out as the build stopped.
    folder = Path(cfg.data.cache_dir) / "latents"
    assert len(list(folder.rglob("shard-*"))) == 2
    assert not [p for p in cache_files(folder) if p.name.startswith(".")]  # no partial file
    monkeypatch.setattr(family, "encode_images", real)
    done = build_cache(cfg, family, comps, progress=False)
    assert done.stats["latents_reused"] == 6 and done.stats["latents_encoded"] == 4


def test_a_crash_before_an_index_leaves_the_complete_shards(tmp_path):
    folder = tmp_path / "latents" / "v"
    keys = [folder / f"{i:032x}.safetensors" for i in range(7)]
    s = ShardStore(shard_entries=3)
    s.put_many((k, {"latents": torch.full((2,), float(i))}) for i, k in enumerate(keys))
    # Killed here: 6 entries in two shards and a writer index, one entry lost with the process.
    again = ShardStore()
    assert [again.has(k) for k in keys] == [True] * 6 + [False]
    assert again.get(keys[4])["latents"].tolist() == [4.0, 4.0]
    again.put(keys[6], {"latents": torch.zeros(2)})
    again.flush()  # the writers' indexes fold into one
    assert sorted(p.name for p in folder.glob("*.json")) == ["index.json"]
    assert all(ShardStore().has(k) for k in keys)
    assert FileStore().has(keys[0]) is False  # the file layout is a different place


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt.checkpoint_dir(run, step) / ckpt.ADAPTER_FILE))


@pytest.mark.slow
def test_training_on_shards_equals_training_on_files(make_config, tmp_path):
    from kit.train.loop import train

    data = write_images(tmp_path / "imgs", 6)
    runs = {}
    for fmt, compression in (("files", "none"), ("shards", "zlib")):
        cfg = make_config(
            f"{fmt}.json",
            image_dir=str(data),
            resolution=32,
            bucket_step=32,
            max_train_steps=2,
            checkpointing_steps=2,
            caption_dropout=0.5,
            output_dir=str(tmp_path / fmt),
            cache_dir=str(tmp_path / f"cache-{fmt}"),
            cache_format=fmt,
            cache_compression=compression,
        )
        train(load_config(cfg))
        runs[fmt] = weights(tmp_path / fmt, 2)
    assert runs["files"].keys() == runs["shards"].keys()
    assert all(torch.equal(runs["files"][k], runs["shards"][k]) for k in runs["files"])


LAUNCHED = """
import json, os, sys
from pathlib import Path
from kit.config import load_config
from kit.train.loop import train

def on_event(event):
    if event["kind"] == "start":
        Path(f"{sys.argv[2]}-{os.environ['RANK']}.json").write_text(json.dumps(event["data"]))

train(load_config(sys.argv[1]), callbacks=[on_event])
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["shards", "files"])
def test_two_processes_each_cache_their_half(tmp_path, make_config, fmt):
    import os
    import subprocess
    import sys

    from kit.families.loading import load_base

    cfg_path = make_config(max_train_steps=1, checkpointing_steps=0, cache_format=fmt)
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    out = subprocess.run(
        [*cmd, str(script), str(cfg_path), str(tmp_path / "stats")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    stats = [json.loads((tmp_path / f"stats-{r}.json").read_text()) for r in (0, 1)]

    cfg = load_config(cfg_path)
    family, comps = load_base(cfg)
    built = plan_cache(cfg, comps.identity, torch.float32)
    # Training caches the grid's prompts with the captions (kit.sample.embedded).
    specs = image_specs(cfg, family, default_prompts(cfg, []))
    built.add_prompts(prompt_texts(family, specs))
    assert built.missing() == {"latents": 0, "text": 0}
    n, texts = len(built.latent_files), len(built.text_entries())
    distinct = len(set(built.latent_files))  # two samples of the same image share an entry
    split = [s["latents_encoded"] for s in stats]
    # Each encodes its half; an entry two samples share may be encoded by both processes (or,
    # written as a file already, by one).
    assert distinct <= sum(split) <= n and abs(split[0] - split[1]) <= n - distinct + 1, split
    assert sum(s["text_encoded"] for s in stats) == texts and all(s["text_encoded"] for s in stats)
    # The same entries as one process builds alone.
    alone = build_cache(cfg.replace(cache_dir=str(tmp_path / "alone")), family, comps)
    assert alone.stats["latents_encoded"] + alone.stats["latents_reused"] == n
    indices = list(range(len(alone.samples)))
    ours, ref = built.load_batch(indices), alone.load_batch(indices)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
