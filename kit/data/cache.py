"""The latent and text-embedding cache: safetensors entries keyed by everything that shapes them.

Latents are keyed by the image's bytes, its placement (bucket, crop, flip, frames), the VAE and
the dtype; text embeddings by the text, the encoders and tokenizers, and the dtype. Entries are
written atomically, so an interrupted build resumes and never leaves half a file; where they are
kept (one file each, or shards with an index) is the store's business (`kit.data.store`).
"""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kit.config import Config
from kit.data import sound, video
from kit.data.augment import augmentation_enabled, caption_variants
from kit.data.blob import Blob, use_remote
from kit.data.buckets import BucketPlan, plan_dataset, with_mirrored
from kit.data.datasets import views, weighted
from kit.data.images import BadImage
from kit.data.masks import MaskSource, bucket_mask, latent_mask, plan_masks
from kit.data.masks import masked as any_masked
from kit.data.pairs import check_batchable, control_image, control_pixels, controls_of
from kit.data.paths import default_cache_dir
from kit.data.pixels import sample_pixels
from kit.data.scan import Sample, ScanReport
from kit.data.shard_reads import in_read_order, process_share
from kit.data.store import EntryStore, FileStore, auto_format, open_store
from kit.errors import DataError


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (of a frame folder: its frames' names and bytes)."""
    h = hashlib.sha256()
    files = video.frame_files(path) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _key(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@dataclass
class CachedDataset:
    """Samples with their cache files; batches are read from disk on demand."""

    samples: list[Sample]
    plan: BucketPlan
    latent_files: list[Path]
    text_files: list[Path]
    """Per sample, the embedding of its first caption variant: with one variant, the caption
    trained on (augmented, when augmentation is on), as the live-text path encodes it."""
    digests: list[str]
    stats: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Images dropped before or while encoding (an unusable mask, pixels that failed to
    decode), with why."""
    variant_texts: list[list[str]] = field(default_factory=list)
    """Per sample, the caption variants trained on (one unless augmented `caption_variants`)."""
    variant_files: list[list[Path]] = field(default_factory=list)
    """Per sample, the embedding file of each caption variant."""
    empty_text_file: Path | None = None
    """The empty caption's embedding (used by caption dropout), when wanted."""
    loss_weights: list[float] = field(default_factory=list)
    """Per sample, its dataset's `loss_weight`; empty when every weight is 1."""
    names: list[str] = field(default_factory=list)
    """The datasets' names, by `Sample.dataset` (empty for a single folder)."""
    roles: list[str] = field(default_factory=list)
    """The datasets' roles (`instance`, `prior`), by `Sample.dataset`."""
    masks: list[MaskSource] = field(default_factory=list)
    """Per sample, where its loss mask comes from (`masked_loss`); empty without masks."""
    preserve_texts: list[list[str]] = field(default_factory=list)
    """Per sample and caption variant, its preservation prompt (`preservation`); else empty."""
    preserve_files: list[list[Path]] = field(default_factory=list)
    """The embedding file of each preservation prompt, as `variant_files`."""
    base_targets: list[bool] = field(default_factory=list)
    """Per sample, whether it trains toward the base model's prediction; empty when none does."""
    store: EntryStore = field(default_factory=FileStore)
    """Where the entries are kept (`cache_format`): the entry paths above address it."""
    text_path: Callable[[str], Path] | None = None
    """A text's embedding file (keyed as every caption's)."""
    prompt_files: dict[str, Path] = field(default_factory=dict)
    """Texts that no sample trains on, cached with the captions: a slider's prompts, and the
    validation prompts (`add_prompts`) → their embedding file."""
    control_files: list[list[Path]] = field(default_factory=list)
    """Edit models: per sample, the latent entry of each of its control images; empty
    without `control_dir`."""
    text_controls: dict[Path, tuple[Sample, Any]] = field(default_factory=dict)
    """A family whose prompts depend on the controls (`Family.prompt_controls`): each text entry
    encoded with a pair's controls → that sample and its placement; empty otherwise."""

    def kept(self) -> list[Sample]:
        """The samples trained on, once each (a mirrored twin is the same sample)."""
        return self.samples[: self.plan.size]

    @property
    def variants(self) -> int:
        """Caption variants per sample (the trainer draws one per sample and step)."""
        return len(self.variant_files[0]) if self.variant_files else 1

    def text_entries(self) -> list[Path]:
        """Every distinct text-embedding file the dataset uses."""
        files = {f for fs in self.variant_files for f in fs} | set(self.text_files)
        files |= {f for fs in self.preserve_files for f in fs} | set(self.prompt_files.values())
        if self.empty_text_file is not None:
            files.add(self.empty_text_file)
        return sorted(files)

    def add_prompts(self, texts: list[str]) -> None:
        """Cache these texts too: the validation prompts and negative prompts, so that the
        grids can be drawn from their embeddings once the text encoders are gone."""
        if self.text_path is None:
            raise DataError("this cache plan has no text keys to add prompts with")
        self.prompt_files.update((t, self.text_path(t)) for t in texts)

    def prompt_text(self, text: str) -> dict[str, torch.Tensor]:
        """A cached prompt's embedding (unbatched), as `encode_text` gave it."""
        if text not in self.prompt_files:
            raise DataError(f"the prompt {text!r} was not cached with the captions")
        return self.store.get(self.prompt_files[text])

    def missing(self) -> dict[str, int]:
        """Cache entries not yet written: latents and (distinct) text embeddings."""
        return {
            "latents": sum(not self.store.has(f) for f in self.latent_files)
            + sum(not self.store.has(f) for fs in self.control_files for f in fs),
            "text": sum(not self.store.has(f) for f in self.text_entries()),
        }

    def load_batch(
        self, indices: list[int], variants: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Stack the cached tensors of these samples, with each one's size and crop (h, w order).

        `variants` picks each sample's caption variant (default: the first, the one the live-text
        path encodes too).
        """
        out: dict[str, list[torch.Tensor]] = defaultdict(list)
        for j, i in enumerate(indices):
            entry = self.store.get(self.latent_files[i])
            for k, v in entry.items():  # the latents, a loss mask, `pixel_conditioning`'s
                out[k].append(v)
            for r, f in enumerate(self.control_files[i] if self.control_files else ()):
                # One key per reference (tensors only, as every batch key): `control_latents_0`...
                out[f"control_latents_{r}"].append(self.store.get(f)["latents"])
            text = self.variant_files[i][variants[j] if variants else 0]
            for k, v in self.store.get(text).items():
                out[k].append(v)
            p = self.plan.placements[i]
            out["original_size"].append(torch.tensor([p.original[1], p.original[0]]))
            out["crop_top_left"].append(torch.tensor(list(p.crop)))
            out["target_size"].append(torch.tensor([p.bucket[1], p.bucket[0]]))
        if self.loss_weights:
            out["loss_weight"] = [torch.tensor(self.loss_weights[i]) for i in indices]
        for j, i in enumerate(indices):
            if self.preserve_files:  # as `preserve.<key>`: the training loss takes them out
                kept = self.preserve_files[i][variants[j] if variants else 0]
                for k, v in self.store.get(kept).items():
                    out[f"preserve.{k}"].append(v)
            if self.base_targets:
                out["base_target"].append(torch.tensor(self.base_targets[i]))
        for k, v in out.items():
            if k.startswith("control_latents_") and len({t.shape for t in v}) > 1:
                files = ", ".join(str(self.samples[i].controls[0]) for i in indices)
                raise DataError(
                    f"the controls of one batch resize to different sizes ({files}): give the "
                    "controls of a bucket the aspect ratio of their targets, or train batch_size 1"
                )
        return {k: torch.stack(v) for k, v in out.items()}

    def draw_variants(self, n: int, generator: torch.Generator) -> list[int] | None:
        """One caption variant per sample, from the batch's generator; None (no draw) for one."""
        if self.variants <= 1:
            return None  # no draw: the random stream stays as without variants
        return torch.randint(self.variants, (n,), generator=generator).tolist()

    def empty_text(self) -> dict[str, torch.Tensor]:
        """The empty caption's cached embedding (caption dropout)."""
        if self.empty_text_file is None:
            raise DataError("the empty caption was not cached (build the cache with empty=True)")
        return self.store.get(self.empty_text_file)

    def manifest(self) -> list[dict[str, Any]]:
        """Per-sample record of what was trained on (file, hash, caption, bucket, crop); a sample
        that also trains mirrored gives its twin's crop as `mirrored_crop`."""
        n, placements = self.plan.size, self.plan.placements
        rows = []
        for i, (s, p, d) in enumerate(zip(self.kept(), placements, self.digests, strict=False)):
            name = s.blob.name if s.blob is not None else str(s.image)  # a URL keeps its //
            row = {"image": name, "sha256": d, "caption": s.caption}
            if self.names:
                row.update(
                    dataset=self.names[s.dataset],
                    role=self.roles[s.dataset],
                    repeats=self.plan.dataset_repeats[s.dataset],
                )
            row.update({k: list(v) if isinstance(v, tuple) else v for k, v in p.record().items()})
            if self.plan.flip_twins:
                row["mirrored_crop"] = list(placements[i + n].crop)
            if self.masks:
                m = self.masks[i]
                row["mask"] = str(m.file) if m.file is not None else "alpha"
                row["mask_sha256"] = m.digest if m.file is not None else d
            rows.append(row)
        return rows


def plan_cache(
    cfg: Config,
    identity: dict[str, str],
    dtype: torch.dtype,
    *,
    num_processes: int = 1,
    empty: bool = False,
    family: Any = None,
    scanned: ScanReport | None = None,
) -> CachedDataset:
    """The dataset and the cache file of every entry it needs, without encoding anything.

    Latents are keyed by the image's bytes, its placement (bucket, crop, flip, frames), the VAE's
    identity and the dtype; text embeddings by the text, the encoders' and tokenizers' identity
    and the dtype. A changed image or caption therefore misses exactly its own entries.
    With `random_flip` every sample has a mirrored twin (its own entry, after the samples) and
    each epoch trains one of the two. `family` and `scanned` go to `plan_dataset`, so that
    neither is built twice. With `masked_loss`, masks are checked first (an image with an
    unusable mask is left out, in `skipped`), and each latent entry is keyed by its mask too.
    """
    masked = plan_masks(cfg, family, scanned) if any_masked(cfg.data) else None
    if masked is not None:
        family, scanned = masked.family, masked.scanned
    samples, plan = plan_dataset(cfg, num_processes, family=family, scanned=scanned)
    masks = masked.for_samples(samples) if masked is not None else []
    if masked is not None:
        plan.dropped = plan.dropped + masked.refused
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    latent_dir = root / "latents" / identity["vae"]
    text_dir = root / "text" / identity["text"]
    # A sample from a dataset, shard or bucket was digested by its scan (`Sample.blob`).
    digests = [s.blob.digest if s.blob is not None else file_digest(s.image) for s in samples]
    twins = 2 if cfg.data.random_flip else 1
    if twins == 2:
        plan = with_mirrored(plan)
        samples, digests, masks = plan.samples, digests * 2, masks * 2
    # A posterior sample is a seeded draw: the mode and the seed key it (the mean's keys stay).
    drawn = () if cfg.data.latent_sampling == "mean" else ("sample", cfg.train.seed)
    # Without masks the keys stay as they were; with them, the mask's digest joins the key.
    mask_keys = [m.key() for m in masks] if masks else [()] * len(digests)
    latent_files = [
        latent_dir / f"{_key(d, p.record(), str(LATENT_DTYPE), *drawn, *m)}.safetensors"
        for d, p, m in zip(digests, plan.placements, mask_keys, strict=True)
    ]
    seen = views(cfg.data)
    augment = [augmentation_enabled(v.data) for v in seen]
    # A twin trains on its sample's captions: the same entries, encoded once.
    texts = [
        caption_variants(s.caption, seen[s.dataset].data, cfg.train.seed)
        if augment[s.dataset]
        else [s.caption]
        for s in samples[: plan.size]
    ] * twins
    weights = [seen[s.dataset].loss_weight for s in samples] if weighted(cfg.data) else []
    keep, slider = cfg.objective.preservation, cfg.objective.slider
    kept = [[keep.prompt_for(t) for t in ts] for ts in texts] if keep is not None else []
    toward_base = [seen[s.dataset].target == "base_prediction" for s in samples]

    text_file = functools.partial(_text_path, text_dir, str(dtype))

    # A family whose text encoder also sees the controls (Qwen-Image-Edit's vision-language
    # prompt) keys a sample's texts by its controls as well: their bytes and the target's
    # placement (a mirrored twin's controls are mirrored), so an edited control misses them too.
    prompt_keys = [
        ("controls", *(_digest(c) for c in controls_of(s)), p.record()) if s.controls else ()
        for s, p in zip(samples, plan.placements, strict=True)
    ]
    if not getattr(family, "prompt_controls", False):
        prompt_keys = [()] * len(samples)
    variant_files = [
        [text_file(t, *k) for t in ts] for ts, k in zip(texts, prompt_keys, strict=True)
    ]
    preserve_files = [
        [text_file(t, *k) for t in ts] for ts, k in zip(kept, prompt_keys[: len(kept)], strict=True)
    ]
    text_controls = {
        f: (samples[i % len(samples)], plan.placements[i % len(samples)])
        for i, fs in enumerate([*variant_files, *preserve_files])
        for f in fs
        if prompt_keys[i % len(samples)]
    }
    # A control is keyed like its target: its bytes, the target's placement (its crop and mirror
    # are the control's) and the family whose pipeline rule resizes it; an edited control misses
    # its own entry only. Never a posterior sample: the pipelines encode controls to the mode.
    rule = ("control", cfg.model.model_family, str(LATENT_DTYPE))
    control_files = [
        [latent_dir / f"{_key(_digest(c), p.record(), *rule)}.safetensors" for c in controls_of(s)]
        for s, p in zip(samples, plan.placements, strict=True)
    ]
    batched = cfg.train.train_batch_size > 1  # a bucket's samples must be able to share a batch
    check_batchable(samples, plan.placements, family, cfg, batched, controls=any(control_files))
    return CachedDataset(
        samples,
        plan,
        latent_files,
        [fs[0] for fs in variant_files],
        digests,
        variant_texts=texts,
        variant_files=variant_files,
        empty_text_file=text_file("") if empty else None,
        loss_weights=weights,
        preserve_texts=kept,
        preserve_files=preserve_files,
        base_targets=toward_base if any(toward_base) else [],
        prompt_files={p: text_file(p) for p in slider.prompts()} if slider is not None else {},
        names=[v.name for v in seen] if cfg.data.datasets else [],
        roles=[v.role for v in seen] if cfg.data.datasets else [],
        skipped=list(masked.refused) if masked is not None else [],
        masks=masks,
        store=open_store(
            auto_format(
                cfg.data.cache_format, plan.size, latent_files[0] if latent_files else None
            ),
            cfg.data.cache_compression,
        ),
        text_path=text_file,
        control_files=control_files if any(control_files) else [],
        text_controls=text_controls,
    )


def _digest(control: Path | Blob) -> str:
    """What keys a control: its bytes' SHA-256, taken by its source's scan or read from its file
    (equal for the same image either way, so a pair moved into a dataset keeps its entries)."""
    return control.digest if isinstance(control, Blob) else file_digest(control)


def _text_path(text_dir: Path, dtype: str, text: str, *extra: Any) -> Path:
    """A text's embedding file: keyed by the text, the dtype and what else the encoders see
    (`extra`: a pair's controls), under the encoders' folder."""
    return text_dir / f"{_key(text, dtype, *extra)}.safetensors"


def posterior_draw(cfg: Config, entry: Path) -> dict[str, torch.Generator]:
    """`encode_images` arguments for a cache entry: none for the posterior mean, else a
    generator seeded by the entry's key (which holds the image, its placement and the seed)."""
    if cfg.data.latent_sampling == "mean":
        return {}
    return {"generator": torch.Generator().manual_seed(int(entry.stem[:15], 16))}


LATENT_DTYPE = torch.float32
"""The VAE encodes the cache in fp32 whatever the training dtype: each image is encoded once, so
this costs little, and in half precision some VAEs (SDXL's, whose config says `force_upcast`)
overflow into inf and NaN. Following only `force_upcast` would miss VAEs that never set it."""


def fill_cache(
    data: CachedDataset,
    cfg: Config,
    family: Any,
    comps: Any,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    *,
    share: tuple[int, int] = (0, 1),
) -> CachedDataset:
    """Encode the entries not yet cached, then write out whatever the store still buffers
    (shards), also when encoding stops on an error, so that a resumed build redoes none of it.

    `share=(index, count)` encodes only this process's share of the missing entries: of the
    dataset's entries in plan order (text: in key order), every `count`-th from `index`; of tar
    shards' members, one run in shard and byte order each (`shard_reads.process_share`); of a
    streamed row's latents, those of every `count`-th block of its stream (see `_owner`). The
    shares are disjoint and do not depend on what is cached, so `count` processes building at
    once never encode an entry twice. A share leaves undecodable images in; the whole pass that
    follows (after every process finished its share) finds and drops them on every process
    alike, and encodes anything a share left missing.
    """
    use_remote(cfg.data.remote_timeout, cfg.data.remote_retries)
    try:
        return _encode_missing(data, cfg, family, comps, device, progress, share)
    finally:
        data.store.flush()


def _encode_missing(
    data: CachedDataset,
    cfg: Config,
    family: Any,
    comps: Any,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    share: tuple[int, int] = (0, 1),
) -> CachedDataset:
    """Encode the entries not yet cached, one at a time, each written atomically: interrupted,
    it resumes where it stopped, reusing what is written. Memory holds one image, or 16 captions,
    at a time. `progress` None shows a bar on a terminal."""
    import sys

    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    stats = {"latents_encoded": 0, "latents_reused": 0, "text_encoded": 0, "text_reused": 0}
    todo = [i for i, f in enumerate(data.latent_files) if not data.store.has(f)]
    stats["latents_reused"] = len(data.latent_files) - len(todo)
    if share[1] > 1:  # this process's share
        mine = process_share(data.samples, share)
        todo = [i for i in todo if _owner(data.samples[i], i, share, mine)]
    todo.sort(key=lambda i: _read_order(data.samples[i], i))
    bad: dict[int, str] = {}
    vae_dtype = comps.vae.dtype if todo else None
    if todo:
        comps.vae.to(dtype=LATENT_DTYPE)  # back to its dtype once the latents are cached
    seen = views(cfg.data)
    # Shards are read front to back, once each, where enough of their members are missing.
    reads = in_read_order(data.samples, todo)
    for i, raw in tqdm(reads, "cache latents", len(todo), unit="img", disable=not show or not todo):
        s, p, f = data.samples[i], data.plan.placements[i], data.latent_files[i]
        try:
            pixels = sample_pixels(s, p, seen[s.dataset].data, raw, family.image_alpha)
            mask = bucket_mask(data.masks[i], p) if data.masks else None
        except BadImage as e:  # a file whose header read fine but whose pixels do not
            bad[i] = str(e)
            continue
        if family.video and pixels.ndim == 3:
            pixels = pixels.unsqueeze(1)  # a still image is a one-frame clip to a video model
        pixels = pixels.unsqueeze(0).to(device)
        draw = posterior_draw(cfg, f)
        lat = family.encode_images(comps, pixels, **draw)[0].float().cpu().contiguous()
        if not torch.isfinite(lat).all():
            comps.vae.to(dtype=vae_dtype)
            raise DataError(
                f"{s.image}: the VAE encoded this image to non-finite latents (inf or NaN); "
                "nothing was cached for it. Check the file, or the VAE's weights"
            )
        entry = {"latents": lat}
        if mask is not None:
            entry["loss_mask"] = latent_mask(mask, lat.shape)
        # The pixels' conditioning (image-to-video's frame), the sound: cached; loss masks multiply.
        heard = sound.clip_sound(family, comps, s, p.frames, raw)  # `Family.audio` families only
        for k, v in {**family.pixel_conditioning(comps, pixels), **heard}.items():
            v = v.float().cpu().contiguous()
            entry[k] = v * entry[k] if k in entry else v
        data.store.put(f, entry)
        stats["latents_encoded"] += 1
    todo_controls = [
        (i, r)
        for i, fs in enumerate(data.control_files)
        for r, f in enumerate(fs)
        if i % share[1] == share[0] and i not in bad and not data.store.has(f)
    ]
    if todo_controls and not todo:
        vae_dtype = comps.vae.dtype
        comps.vae.to(dtype=LATENT_DTYPE)
    for i, r in tqdm(todo_controls, desc="cache controls", unit="img", disable=not show):
        s, p, f = data.samples[i], data.plan.placements[i], data.control_files[i][r]
        d = seen[s.dataset].data
        try:
            image = control_image(controls_of(s)[r], p, d.alpha_background, d.max_image_pixels)
        except BadImage as e:
            bad[i] = str(e)
            continue
        pixels = control_pixels(family, image, controls_of(s)[r]).unsqueeze(0).to(device)
        # The posterior's mean, whatever `latent_sampling`: the pipelines encode a control
        # with `sample_mode="argmax"`, and training should see what inference feeds.
        lat = family.encode_images(comps, pixels)[0]
        data.store.put(f, {"latents": lat.float().cpu().contiguous()})
        stats["latents_encoded"] += 1
    if todo or todo_controls:
        comps.vae.to(dtype=vae_dtype)
    undecodable = {data.samples[i].image for i in bad}
    if bad and share[1] == 1:
        _drop_undecodable(data, bad)
    wanted: dict[Path, str] = {}
    for ts, fs in zip(data.variant_texts, data.variant_files, strict=True):
        wanted.update(zip(fs, ts, strict=True))
    for ts, fs in zip(data.preserve_texts, data.preserve_files, strict=True):
        wanted.update(zip(fs, ts, strict=True))
    if data.empty_text_file is not None:
        wanted[data.empty_text_file] = ""
    wanted.update((f, t) for t, f in data.prompt_files.items())
    missing = [(f, t) for f, t in sorted(wanted.items()) if not data.store.has(f)]
    stats["text_reused"] = len(wanted) - len(missing)
    mine = set(sorted(wanted)[share[0] :: share[1]])  # this process's share
    missing = [(f, t) for f, t in missing if f in mine]
    bar = tqdm(
        total=len(missing), desc="cache text", unit="caption", disable=not show or not missing
    )
    # Texts encoded with a pair's controls (`text_controls`) go in chunks of their own; those
    # of a pair whose control failed to decode are left out with it.
    paired = [m for m in missing if m[0] in data.text_controls]
    paired = [m for m in paired if data.text_controls[m[0]][0].image not in undecodable]
    plain = [m for m in missing if m[0] not in data.text_controls]
    chunks = [g[i : i + 16] for g in (plain, paired) for i in range(0, len(g), 16)]
    for chunk in chunks:
        with torch.no_grad():
            enc = _encode_texts(data, family, comps, chunk, seen)
        for j, (path, _) in enumerate(chunk):
            tensors = {k: v[j].float().cpu().contiguous() for k, v in enc.items()}
            data.store.put(path, tensors)
            stats["text_encoded"] += 1
        bar.update(len(chunk))
    bar.close()
    data.stats = stats
    return data


def _owner(sample: Sample, i: int, share: tuple[int, int], mine: set[int]) -> bool:
    """Whether process `share[0]` of `share[1]` encodes entry `i`: a streamed row, if the
    process owns its block of the stream (so that each reads only its own blocks); any other
    entry, if `process_share` gave it to the process (`mine`)."""
    block = sample.blob.stream_block if sample.blob is not None else None
    return i in mine if block is None else block % share[1] == share[0]


def _read_order(sample: Sample, i: int) -> tuple[Any, ...]:
    """Entries in plan order, but a stream's rows (twins beside) in the order their blocks
    give them, so that the stream is read front to back once."""
    blob = sample.blob
    if blob is None or blob.stream_block is None or blob.table is None:
        return ((), i)
    return (blob.table[:3], blob.stream_block, blob.start)


def _encode_texts(
    data: CachedDataset,
    family: Any,
    comps: Any,
    chunk: list[tuple[Path, str]],
    seen: list[Any],
) -> dict[str, torch.Tensor]:
    """`encode_text` of a chunk of texts; texts keyed by a pair's controls (`text_controls`)
    are encoded with those controls as placed, and are never in one chunk with others."""
    owners = [data.text_controls.get(f) for f, _ in chunk]
    if all(o is None for o in owners):
        return family.encode_text(comps, [t for _, t in chunk])
    controls = []
    for s, p in owners:
        d = seen[s.dataset].data
        controls.append(
            [control_image(c, p, d.alpha_background, d.max_image_pixels) for c in controls_of(s)]
        )
    return family.encode_text(comps, [t for _, t in chunk], controls=controls)


def _drop_undecodable(data: CachedDataset, bad: dict[int, str]) -> None:
    """Leave out samples whose pixels (or mask) failed to decode, recording why."""
    undecodable = [(data.samples[i].image, why) for i, why in bad.items()]
    data.skipped = data.skipped + undecodable
    keep = [i for i in range(len(data.samples)) if i not in bad]
    if not keep:
        raise DataError(f"no usable images: every image failed to decode ({undecodable[0][1]})")
    names = ("samples", "digests", "latent_files", "text_files", "variant_texts", "variant_files")
    for extra in ("loss_weights", "preserve_texts", "preserve_files", "base_targets"):
        if getattr(data, extra):
            names += (extra,)
    if data.masks:
        names += ("masks",)
    if data.control_files:
        names += ("control_files",)
    for name in names:
        setattr(data, name, [getattr(data, name)[i] for i in keep])
    plan = data.plan
    plan.dropped = plan.dropped + undecodable
    plan.samples = data.samples
    plan.placements = [plan.placements[i] for i in keep]


def build_cache(
    cfg: Config,
    family: Any,
    comps: Any,
    device: torch.device | str = "cpu",
    *,
    num_processes: int = 1,
    empty: bool = False,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
) -> CachedDataset:
    """Scan, bucket and encode the dataset, reusing cache entries made by earlier runs.

    `dtype` keys the text embeddings, the text encoders' (default: the VAE's; latents are always
    encoded in `LATENT_DTYPE`); `empty` also caches the empty caption.
    """
    if dtype is None:
        dtype = comps.vae.dtype if comps.vae is not None else torch.float32
    data = plan_cache(cfg, comps.identity, dtype, num_processes=num_processes, empty=empty)
    return fill_cache(data, cfg, family, comps, device, progress)
