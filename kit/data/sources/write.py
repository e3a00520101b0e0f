"""Writing a dataset in the shapes the sources read: WebDataset tar shards and parquet (for the
tests, the benchmark, and a user moving a folder of images into shards)."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path


def control_names(n: int) -> list[str]:
    """The names of a pair's `n` controls, as members (`KEY.control.png`) or columns: `control`,
    then `control_1`, `control_2`..."""
    return [f"control_{i}" if i else "control" for i in range(n)]


def write_shards(
    records: Iterable[tuple[str, str, bytes, str]],
    folder: str | Path,
    per_shard: int = 1000,
    controls: dict[str, list[tuple[str, bytes]]] | None = None,
) -> str:
    """Write (key, image extension, image bytes, caption) records as plain tar shards of
    `per_shard` samples (`train-000000.tar`...), each written to a temporary name then renamed;
    returns the shards' brace pattern. `controls`: an edit dataset's control images per key,
    (extension, bytes) each, written as `KEY.control.EXT`, `KEY.control_1.EXT`..."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shard, count, tar, tmp = -1, 0, None, None

    def close() -> None:
        if tar is not None:
            tar.close()
            os.replace(tmp, folder / f"train-{shard:06d}.tar")

    for key, ext, data, caption in records:
        if tar is None or count == per_shard:
            close()
            shard, count = shard + 1, 0
            tmp = folder / f".train-{shard:06d}.tar.part"
            tar = tarfile.open(tmp, "w")  # pax, as WebDataset's writer
        mine = (controls or {}).get(key, [])
        named = [
            (f"{key}.{c}.{e}", b) for c, (e, b) in zip(control_names(len(mine)), mine, strict=True)
        ]
        for name, payload in [(f"{key}.{ext}", data), *named, (f"{key}.txt", caption.encode())]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(payload), 0, 0o644
            tar.addfile(info, io.BytesIO(payload))
        count += 1
    close()
    last = max(shard, 0)
    return str(folder / f"train-{{000000..{last:06d}}}.tar")


def write_parquet(
    records: Iterable[tuple[str, str, bytes, str]],
    path: str | Path,
    controls: dict[str, list[tuple[str, bytes]]] | None = None,
) -> Path:
    """Write the records as one parquet file with an `image` (Image) and a `text` column, as
    `datasets` writes an image dataset; `controls` (per key, as for `write_shards`) add an
    Image column per control (`control`, `control_1`...; empty where a key has none)."""
    import datasets

    rows = list(records)
    columns = {
        "image": [{"bytes": data, "path": f"{key}.{ext}"} for key, ext, data, _ in rows],
        "text": [caption for *_, caption in rows],
    }
    spec = {"image": datasets.Image(), "text": datasets.Value("string")}
    most = max((len(c) for c in (controls or {}).values()), default=0)
    for i, name in enumerate(control_names(most) if most else []):
        mine = [(controls or {}).get(key, []) for key, *_ in rows]
        columns[name] = [
            {"bytes": c[i][1], "path": f"{key}.{name}.{c[i][0]}"} if i < len(c) else None
            for (key, *_), c in zip(rows, mine, strict=True)
        ]
        spec[name] = datasets.Image()
    ds = datasets.Dataset.from_dict(columns, features=datasets.Features(spec))
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    ds.to_parquet(str(tmp))
    os.replace(tmp, path)
    return path


def folder_records(image_dir: str | Path, caption_extension: str = ".txt") -> list[tuple]:
    """A folder's captioned images as records (key: the path without its extension)."""
    root = Path(image_dir)
    out = []
    for p in sorted(root.rglob("*")):
        cap = p.with_suffix(caption_extension)
        if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".bmp") and cap.is_file():
            key = p.relative_to(root).with_suffix("").as_posix()
            out.append((key, p.suffix[1:].lower(), p.read_bytes(), cap.read_text().strip()))
    return out
