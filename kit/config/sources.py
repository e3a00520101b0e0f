"""Where a dataset entry's images are when they are not a local folder: a Hugging Face dataset or
WebDataset tar shards (a folder may also be an fsspec URL such as `s3://bucket/prefix`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kit.errors import ConfigError

URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
"""A location that is a URL (`s3://bucket/prefix`, `file://...`): kept as written, not a path."""
MAX_SHARDS = 1_000_000
"""The most shards one pattern may name: several times the largest public WebDataset sets; a
range past it is a typo (`{000000..99999999}`), and its names alone would fill the memory."""
_BRACES = re.compile(r"\{([^{}]*)\}")


def pattern_count(pattern: str) -> int:
    """How many names a shard pattern spells (brace ranges and lists), without spelling them."""
    count = 1
    for body in _BRACES.findall(pattern):
        rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
        if rng:
            count *= max(int(rng.group(2)) - int(rng.group(1)) + 1, 0)
        elif "," in body:
            count *= len(body.split(","))
    return count


def check_pattern(pattern: str) -> None:
    """Refuse a shard pattern that names more than `MAX_SHARDS` shards, before any is named."""
    n = pattern_count(pattern)
    if n > MAX_SHARDS:
        raise ConfigError(
            f"shards: {pattern} names {n:,} shards, more than the {MAX_SHARDS:,} one entry may "
            "read; check the range's ends (a digit too many?)"
        )


HUB_OR_PATH = {"path": "hub_or_path"}  # metadata: a local path (made absolute) or a hub id
SHARDS = {"path": True}  # a path pattern, made absolute from the config's folder (URLs stay)


@dataclass
class SourceFields:
    """The fields of a `datasets` entry that name a source other than `image_dir`."""

    hf_dataset: str = field(default="", metadata=HUB_OR_PATH)
    """A Hugging Face dataset: a hub id (`user/name`), a folder written by `save_to_disk`, parquet
    file(s), or a folder `load_dataset` reads; empty: none. Images are read from it lazily."""
    split: str = "train"
    """`hf_dataset`: the split trained on."""
    image_column: str = "image"
    """`hf_dataset`: the column of images (an Image column, bytes, or a path/URL per row)."""
    caption_column: str = "text"
    """`hf_dataset`: the column of captions (with `caption_strategy` textfile)."""
    streaming: bool = False
    """`hf_dataset`: read it as a stream (a hub dataset too large to download whole): nothing
    is downloaded whole or written as Arrow; the stream is read once to scan it and once to
    cache its latents, and training draws from the cache. A killed read resumes where it was."""
    mask_column: str = ""
    """`hf_dataset`: a column of loss masks for `masked_loss` (white = learn), each the size of
    its image; empty: the images' alpha channel."""
    control_column: list[str] = field(default_factory=list)
    """Edit models: where each target's control (reference) images are, one name per control.
    `hf_dataset`: a column of images (an edit dataset's input-image column). `shards`: a
    member of each key (`control` reads `KEY.control.png` or any image extension; a second
    control is often `control_1`). A row or key without one is named and skipped."""
    shards: str = field(default="", metadata=SHARDS)
    """WebDataset tar shards, a path or URL pattern (`data/train-{000000..000099}.tar`,
    `s3://bucket/train-{0000..0999}.tar`): per key an image and a caption (.txt, .caption, or
    .json with a `caption` or `text` field); empty: none."""

    def check_source(self) -> None:
        """One source per entry: a folder (`image_dir`), `hf_dataset` or `shards`."""
        given = [k for k in ("image_dir", "hf_dataset", "shards") if getattr(self, k, "")]
        if not given:
            raise ConfigError(
                "image_dir: every dataset needs its images: image_dir (a folder or URL), "
                "hf_dataset or shards"
            )
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)}: give a dataset one source, not several")
        generate = getattr(self, "generate", None)
        folder = getattr(self, "image_dir", "")
        if generate is not None and generate.count and (not folder or URL.match(folder)):
            raise ConfigError(
                "generate: class images are drawn into a local image_dir; give the entry one"
            )
        if self.control_column and not (self.hf_dataset or self.shards):
            raise ConfigError(
                "control_column: names an hf_dataset's column or a shard member; a folder's "
                "controls are given by control_dir"
            )
        if getattr(self, "control_dir", None) and (
            self.hf_dataset or self.shards or URL.match(folder)
        ):
            raise ConfigError(
                "control_dir: pairs the images of a local image_dir; for an hf_dataset or "
                "shards, name the controls' column or member with control_column"
            )
        if len(set(self.control_column)) != len(self.control_column) or not all(
            c.strip() for c in self.control_column
        ):
            raise ConfigError(
                f"control_column: {self.control_column} repeats or holds an empty name"
            )
        if self.shards:
            check_pattern(self.shards)
        if self.mask_column and not self.hf_dataset:
            raise ConfigError("mask_column: masks are read from an hf_dataset's column")
        if self.streaming and not self.hf_dataset:
            raise ConfigError(
                "streaming: only an hf_dataset is streamed (shards and URLs are read in place "
                "already); set it false"
            )
        if self.streaming and self.control_column:
            raise ConfigError(
                "control_column: control images are not read from a stream; set streaming false "
                "(the dataset is then downloaded once) for an edit dataset"
            )
        if self.streaming and (self.mask_column or getattr(self, "masked_loss", None)):
            key = "mask_column" if self.mask_column else "masked_loss"
            raise ConfigError(
                f"{key}: masks are not read from a stream; set streaming false (the dataset is "
                "then downloaded once) or train this dataset without masks"
            )
        if self.hf_dataset and not (self.image_column and self.caption_column and self.split):
            raise ConfigError("hf_dataset: split, image_column and caption_column must be set")

    def source_name(self) -> str:
        """The source's own name (its folder's, dataset's or shards' last part), for reports."""
        where = getattr(self, "image_dir", "") or self.hf_dataset or self.shards
        return where.rstrip("/").rsplit("/", 1)[-1].split("{", 1)[0].rstrip("-_.") or where


@dataclass
class RemoteFields:
    """The data section's settings for reads from a URL (`s3://`, `https://`)."""

    remote_timeout: float = 60.0
    """Seconds a request may wait for an answer before it is tried again: a store's (S3, HTTP,
    read through fsspec), an `hf_dataset`'s, streamed or downloaded (`datasets`' download config
    and filesystem options), and the hub's (huggingface_hub's `HF_HUB_ETAG_TIMEOUT` and
    `HF_HUB_DOWNLOAD_TIMEOUT`, whole seconds: base models too). A server that accepts a
    connection and never answers is then named within minutes."""
    remote_retries: int = 3
    """How many times a request that got no answer in `remote_timeout` is tried again (each
    wait is said on stderr) before the run stops, naming what it waited for; for `datasets`,
    its download config's `max_retries` and its streaming reads' retries."""

    def check_remote(self) -> None:
        """A positive, finite timeout and a retry count of 0 or more."""
        if not 0 < self.remote_timeout < float("inf"):
            raise ConfigError(f"remote_timeout: {self.remote_timeout} must be a positive number")
        if self.remote_retries < 0:
            raise ConfigError(f"remote_retries: {self.remote_retries} must be 0 or more")


SOURCE_FIELDS = (
    "hf_dataset",
    "split",
    "image_column",
    "caption_column",
    "mask_column",
    "control_column",
    "shards",
    "streaming",
)
"""The entry fields above: not data-section settings, so a view does not take them over."""
