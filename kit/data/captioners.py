"""Captions from a tagger or a captioning model, written through the safe bulk-edit path.

A folder with no captions has nothing for the caption editor to start from. A captioner fills it:
`wd14` (a WD14-style tagger run by onnxruntime: comma-separated tags for anime and illustration
data), `blip` and `florence2` (vision-language models run by transformers: a sentence for photos
and for the families that read natural language). Their output is planned as a `Change` per
caption file, exactly like `kit.data.captions.plan_edit`: nothing is written until
`apply_captions`, which backs the caption folder up first, and `restore_backup` (`kit captions
--restore`) undoes it, removing the caption files it created. By default only images without a
caption (or with an empty one) are captioned, so hand-written captions are never lost.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from kit.config import Config, DataConfig
from kit.data import video
from kit.data.augment import split_tags
from kit.data.captions import Change, apply_edit, diff_text
from kit.data.datasets import views
from kit.data.images import open_rgb
from kit.data.scan import caption_path, scan
from kit.data.sources import describe, elsewhere
from kit.errors import DataError, KitError
from kit.families import get_family


@dataclass
class CaptionOptions:
    """How captions are made and which images get one."""

    prefix: str = ""
    """Put first in every caption (e.g. the trigger word; several as `zorb, 1girl`), once."""
    general_threshold: float = 0.35
    """Tagger: the least probability a general tag needs to be written."""
    character_threshold: float = 0.85
    """Tagger: the least probability a character tag needs (higher: a wrong name is costly)."""
    max_tags: int = 0
    """Tagger: at most this many tags per image, the most likely first; 0 writes all."""
    exclude_tags: list[str] = field(default_factory=list)
    """Tagger: tags never written (`simple background`, or with underscores as in the tag list)."""
    escape_parens: bool = False
    """Tagger: write `(` `)` as `\\(` `\\)`, for prompt front ends that read them as weights."""
    overwrite: bool = False
    """Caption every image; by default only images without a caption or with an empty one."""
    batch_size: int = 8
    """Images per forward pass of the captioner."""
    max_new_tokens: int = 75
    """Captioning models: the longest caption, in tokens."""
    task: str = "<DETAILED_CAPTION>"
    """Florence-2: the task prompt (`<CAPTION>`, `<DETAILED_CAPTION>`, `<MORE_DETAILED_CAPTION>`)."""

    def __post_init__(self) -> None:
        for name in ("general_threshold", "character_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise KitError(f"{name}: {value} must be a probability between 0 and 1")
        if self.max_tags < 0:
            raise KitError(f"max_tags: {self.max_tags} must be 0 (all) or more")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise KitError("batch_size and max_new_tokens must be at least 1")
        self.prefix = ", ".join(t.strip() for t in split_tags(self.prefix) if t.strip())


class Captioner(Protocol):
    """A loaded captioner: images in, one caption each out."""

    name: str
    model: str

    def caption(self, images: Sequence[Image.Image]) -> list[str]: ...


# ------------------------------------------------------------------ WD14 tagger

RATING, GENERAL, CHARACTER = 9, 0, 4
"""The tag categories of a WD14 `selected_tags.csv`."""

_WORDLIKE = re.compile(r"[^\W_]{2}")


def tag_text(raw: str, escape_parens: bool = False) -> str:
    """A tag as captions write it: underscores become spaces, except in kaomoji (`^_^`, `o_o`).

    A kaomoji has no two letters or digits in a row, where a name (`long_hair`) has.
    """
    text = raw.replace("_", " ") if _WORDLIKE.search(raw) else raw
    return text.replace("(", r"\(").replace(")", r"\)") if escape_parens else text


def _tag_key(tag: str) -> str:
    """How tags are compared: case, underscores, escapes and extra spaces do not count."""
    return " ".join(tag.replace("\\", "").replace("_", " ").lower().split())


@dataclass
class WD14Tagger:
    """A WD14-style tagger: `model.onnx` (NHWC BGR 0..255 in, a probability per tag out) and
    `selected_tags.csv` (one row per output: `name`, `category`)."""

    model: str
    session: Any
    tags: list[tuple[str, int]]
    """(name, category) per model output, in the csv's order."""
    options: CaptionOptions
    size: int
    fixed_batch: int = 0
    name: str = "wd14"

    @classmethod
    def load(cls, model: str | None, device: str | None, options: CaptionOptions) -> WD14Tagger:
        model = model or DEFAULT_MODELS["wd14"]
        how = (
            "give a WD14 tagger's hub id (e.g. SmilingWolf/wd-vit-tagger-v3, downloaded once; "
            "offline it must be in the Hugging Face cache) or a local folder holding model.onnx "
            "and selected_tags.csv"
        )
        try:
            import onnxruntime as ort
        except ImportError:
            raise KitError(
                f"captioner wd14 ({model}) runs on onnxruntime, which is not installed: "
                "pip install onnxruntime (or onnxruntime-gpu on a CUDA machine)"
            ) from None
        onnx_file, csv_file = (_model_file(model, name, how) for name in _WD14_FILES)
        tags = _read_tags(csv_file)
        providers = ["CPUExecutionProvider"]
        if _device(device) == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            session = ort.InferenceSession(str(onnx_file), providers=providers)
        except Exception as e:  # onnxruntime raises its own classes for every kind of bad file
            raise KitError(f"captioner wd14: cannot load {onnx_file} ({model}): {e}; {how}") from e
        shape = session.get_inputs()[0].shape
        if len(shape) != 4 or shape[3] != 3:
            raise KitError(
                f"captioner wd14: {onnx_file} takes input of shape {shape}; a WD14 tagger takes "
                "(batch, height, width, 3) images"
            )
        outputs = session.get_outputs()[0].shape[-1]
        if isinstance(outputs, int) and outputs != len(tags):
            raise KitError(
                f"captioner wd14: {onnx_file} gives {outputs} probabilities but {csv_file} "
                f"lists {len(tags)} tags; they must come from the same model"
            )
        size = shape[1] if isinstance(shape[1], int) and shape[1] > 0 else 448
        batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else 0
        return cls(str(model), session, tags, options, size, batch)

    def scores(self, images: Sequence[Image.Image]) -> Any:
        """The probability of every tag for every image: an (images, tags) array."""
        import numpy as np

        x = np.stack([_tagger_pixels(im, self.size) for im in images])
        step = self.fixed_batch or len(x)
        name = self.session.get_inputs()[0].name
        out = [self.session.run(None, {name: x[i : i + step]})[0] for i in range(0, len(x), step)]
        return np.concatenate(out)

    def caption(self, images: Sequence[Image.Image]) -> list[str]:
        """Comma-separated tags per image: character tags first, each kind most likely first."""
        o = self.options
        excluded = {_tag_key(t) for t in o.exclude_tags}
        out = []
        for probs in self.scores(images):
            picked = []
            for (tag, category), p in zip(self.tags, probs, strict=True):
                if category == RATING or _tag_key(tag) in excluded:
                    continue
                is_character = category == CHARACTER
                if p >= (o.character_threshold if is_character else o.general_threshold):
                    picked.append((not is_character, -float(p), tag))
            picked.sort()
            names = [tag_text(t, o.escape_parens) for _, _, t in picked]
            out.append(", ".join(names[: o.max_tags] if o.max_tags else names))
        return out


_WD14_FILES = ("model.onnx", "selected_tags.csv")


def _tagger_pixels(image: Image.Image, size: int) -> Any:
    """An image as WD14 taggers were trained on it: padded square on white, resized, BGR, 0..255."""
    import numpy as np

    image = image.convert("RGB")
    side = max(image.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    if side != size:
        square = square.resize((size, size), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(square, dtype=np.float32)[:, :, ::-1])


def _read_tags(path: Path) -> list[tuple[str, int]]:
    """(name, category) per row of a `selected_tags.csv`."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        return [(r["name"], int(r["category"])) for r in rows]
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise KitError(
            f"captioner wd14: {path} is not a tag list (columns tag_id,name,category,count "
            f"with a numeric category): {e!r}"
        ) from None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _model_file(model: str, filename: str, how: str) -> Path:
    """A file of a model: from a local folder, or downloaded from the hub (cached)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / filename
        if not path.is_file():
            raise KitError(f"captioner model folder {folder} has no {filename}; {how}")
        return path
    if folder.exists() or not _HUB_ID.match(model):
        raise KitError(f"captioner model {model!r}: no such folder; {how}")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model, filename))
    except Exception as e:  # not found, offline, gated: the hub client has a class for each
        raise KitError(
            f"captioner model {model}: cannot get {filename} from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {how}"
        ) from None


# ------------------------------------------------------------------ captioning models


@dataclass
class TransformersCaptioner:
    """A captioning model through transformers: BLIP or Florence-2 (no remote code)."""

    name: str
    model: str
    net: Any
    processor: Any
    options: CaptionOptions
    device: str

    @classmethod
    def load(
        cls, name: str, model: str | None, device: str | None, options: CaptionOptions
    ) -> TransformersCaptioner:
        model = model or DEFAULT_MODELS[name]
        how = (
            f"give a {_KINDS[name]} model's hub id (e.g. {DEFAULT_MODELS[name]}, downloaded once; "
            "offline it must be in the Hugging Face cache) or a folder written by save_pretrained "
            "(config.json, the weights, preprocessor_config.json and the tokenizer files)"
        )
        if not Path(model).expanduser().is_dir() and not _HUB_ID.match(model):
            raise KitError(f"captioner {name}: model {model!r}: no such folder; {how}")
        import torch
        import transformers

        net_class, processor_class = _CLASSES[name]
        dev = _device(device)
        try:
            processor = getattr(transformers, processor_class).from_pretrained(model)
            net = getattr(transformers, net_class).from_pretrained(
                model, dtype=torch.float16 if dev == "cuda" else torch.float32
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise KitError(f"captioner {name}: cannot load {model} ({first}); {how}") from None
        return cls(name, str(model), net.to(dev).eval(), processor, options, dev)

    def caption(self, images: Sequence[Image.Image]) -> list[str]:
        """One sentence per image."""
        import torch

        rgb = [im.convert("RGB") for im in images]
        kwargs: dict[str, Any] = {"images": rgb, "return_tensors": "pt"}
        if self.name == "florence2":
            kwargs["text"] = [self.options.task] * len(rgb)
        inputs = self.processor(**kwargs).to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.net.dtype)
        with torch.inference_mode():
            ids = self.net.generate(**inputs, max_new_tokens=self.options.max_new_tokens)
        texts = self.processor.batch_decode(ids, skip_special_tokens=True)
        return [" ".join(t.split()) for t in texts]


_KINDS = {"blip": "BLIP captioning", "florence2": "Florence-2"}
_CLASSES = {
    "blip": ("BlipForConditionalGeneration", "BlipProcessor"),
    "florence2": ("Florence2ForConditionalGeneration", "AutoProcessor"),
}

DEFAULT_MODELS = {
    "wd14": "SmilingWolf/wd-vit-tagger-v3",
    "blip": "Salesforce/blip-image-captioning-large",
    "florence2": "florence-community/Florence-2-base",
}
"""The model each captioner loads when none is given."""

CAPTIONERS: dict[str, Callable[[str | None, str | None, CaptionOptions], Captioner]] = {
    "wd14": WD14Tagger.load,
    "blip": lambda model, device, o: TransformersCaptioner.load("blip", model, device, o),
    "florence2": lambda model, device, o: TransformersCaptioner.load("florence2", model, device, o),
}
"""Captioner name → loader(model, device, options)."""


def load_captioner(
    name: str,
    model: str | None = None,
    device: str | None = None,
    options: CaptionOptions | None = None,
) -> Captioner:
    """A captioner by name (see `CAPTIONERS`); a KitError that says how to get it if it won't load."""
    return CAPTIONERS[_known(name)](model, device, options or CaptionOptions())


def _known(name: str) -> str:
    if name not in CAPTIONERS:
        raise KitError(f"captioner: unknown {name!r}; choose one of {', '.join(CAPTIONERS)}")
    return name


def _device(device: str | None) -> str:
    """`cuda` when asked for or (by default) when there is one; else `cpu`."""
    if device and device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ planning


@dataclass
class Target:
    """An image to caption, and the caption file it gets."""

    image: Path
    path: Path
    old: str | None
    """The caption file's text now; None when there is no caption file."""
    frames: int = 0
    """For a clip: how many frames it has (its middle frame is captioned); 0 for an image."""


@dataclass
class CaptionPlan:
    """One dataset's planned captions."""

    name: str
    data: DataConfig
    targets: list[Target]
    changes: list[Change] = field(default_factory=list)
    blank: list[Path] = field(default_factory=list)
    """Images the captioner gave nothing for (e.g. no tag above the threshold): left as they are."""
    kept: int = 0
    """Images whose caption is kept (it has one, and `overwrite` is off)."""


def find_targets(cfg: Config | DataConfig, overwrite: bool = False) -> list[CaptionPlan]:
    """Per dataset, the images to caption: those without a caption or with an empty one, or
    (with `overwrite`) all that train; unreadable or skipped images are left out."""
    family = get_family(cfg.model.model_family, cfg) if isinstance(cfg, Config) else None
    plans = []
    for view in views(cfg.data if isinstance(cfg, Config) else cfg):
        name, data = view.name, view.data
        if elsewhere(view):
            raise KitError(f"{view.where or 'image_dir'}: {refused_source(view)}")
        if data.caption_strategy != "textfile":
            raise KitError(
                f"caption_strategy: captioners write caption files, but dataset {name} has "
                f"'{data.caption_strategy}'; set it to 'textfile'"
            )
        rep = scan(data, family)
        targets = [Target(p, caption_path(p, data), None, _frames(p)) for p in rep.missing_captions]
        kept = 0
        for s in rep.samples:
            if overwrite or not s.caption:
                path = caption_path(s.image, data)
                old = _read(path)
                targets.append(Target(s.image, path, old, s.total_frames if s.clip else 0))
            else:
                kept += 1
        targets.sort(key=lambda t: str(t.image))
        plans.append(CaptionPlan(name, data, targets, kept=kept))
    return plans


def refused_source(view: Any) -> str:
    """Why a dataset that is no local folder cannot be captioned here, and what to do instead."""
    entry = view.entry
    where = describe(view)
    if entry is not None and entry.hf_dataset:
        instead = f"put the captions in its caption column ({entry.caption_column})"
    elif entry is not None and entry.shards:
        instead = "put each caption in its key's .txt member"
    else:
        instead = "write the caption files beside its images there"
    return (
        f"{where}: captioners write a caption file beside each image, which a dataset's rows, "
        f"a shard's members or a bucket's objects cannot take; caption a local folder before "
        f"moving it into the source, or {instead}"
    )


def plan_captions(
    plans: list[CaptionPlan],
    captioner: Captioner,
    options: CaptionOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[CaptionPlan]:
    """Caption every target (in batches) into each plan's `changes`; nothing is written."""
    o = options or CaptionOptions()
    total = sum(len(p.targets) for p in plans)
    done = 0
    for plan in plans:
        plan.changes, plan.blank = [], []
        for i in range(0, len(plan.targets), o.batch_size):
            batch = plan.targets[i : i + o.batch_size]
            images = [_picture(t, plan.data) for t in batch]
            for t, text in zip(batch, captioner.caption(images), strict=True):
                text = with_prefix(text.strip(), o.prefix) if text.strip() else ""
                if not text:
                    plan.blank.append(t.image)
                    continue
                ending = "\r\n" if t.old and t.old.endswith("\r\n") else "\n"
                new = text + ending
                if new != t.old:
                    plan.changes.append(Change(t.path, t.old or "", new, created=t.old is None))
            done += len(batch)
            if progress is not None:
                progress(done, total)
    return plans


def with_prefix(caption: str, prefix: str) -> str:
    """`prefix`'s tags first, then the caption's other tags: a trigger word stands once."""
    if not prefix:
        return caption
    first = [t.strip() for t in split_tags(prefix)]
    keys = {_tag_key(t) for t in first}
    rest = [t.strip() for t in split_tags(caption) if t.strip() and _tag_key(t) not in keys]
    return ", ".join(first + rest)


def apply_captions(plans: list[CaptionPlan]) -> list[Path]:
    """Write the planned captions, each dataset's after a backup of its caption folder; return
    the backups (`kit captions CONFIG --restore BACKUP` puts one back)."""
    return [apply_edit(p.data, p.changes) for p in plans if p.changes]


def diff(plans: list[CaptionPlan]) -> str:
    """A unified diff of every planned caption: exactly what `apply_captions` writes."""
    return diff_text([c for p in plans for c in p.changes])


@dataclass
class CaptionRun:
    """What `caption_dataset` planned, and (with `apply`) where the old captions went."""

    captioner: str
    model: str
    plans: list[CaptionPlan]
    backups: list[Path] = field(default_factory=list)

    def diff(self) -> str:
        return diff(self.plans)

    def summary(self) -> str:
        """A few lines: per dataset, what changes and what is left alone; then what to do next."""
        lines = []
        for p in self.plans:
            made = sum(c.created for c in p.changes)
            line = (
                f"{p.name}: {made} new caption(s), {len(p.changes) - made} replaced, {p.kept} kept"
            )
            if p.blank:
                line += f", {len(p.blank)} left without one (first: {p.blank[0]})"
            lines.append(line)
        n = sum(len(p.changes) for p in self.plans)
        if not n:
            lines.append("no caption file would change")
        elif self.backups:
            where = ", ".join(str(b) for b in self.backups)
            lines.append(f"wrote {n} caption file(s) with {self.model}; backed up in {where}")
        else:
            lines.append(
                f"{n} caption file(s) would be written (dry run); add --apply to write them"
            )
        return "\n".join(lines)


def caption_dataset(
    cfg: Config | DataConfig,
    captioner: str,
    model: str | None = None,
    options: CaptionOptions | None = None,
    device: str | None = None,
    apply: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CaptionRun:
    """Caption the dataset's images with a captioner; write them (after a backup) only if `apply`.

    The captioner is loaded only when some image needs a caption, so a captioned folder needs
    no model.
    """
    _known(captioner)
    o = options or CaptionOptions()
    plans = find_targets(cfg, o.overwrite)
    name = model or DEFAULT_MODELS[captioner]
    if any(p.targets for p in plans):
        loaded = load_captioner(captioner, model, device, o)
        plan_captions(plans, loaded, o, progress)
        name = loaded.model
    run = CaptionRun(captioner, name, plans)
    if apply:
        run.backups = apply_captions(plans)
    return run


def _picture(target: Target, data: DataConfig) -> Image.Image:
    """What the captioner sees: the image as it trains (RGB), or a clip's middle frame."""
    try:
        if target.frames:
            return video.read_frames(target.image, [target.frames // 2])[0]
        return open_rgb(target.image, data.alpha_background, data.max_image_pixels)
    except (OSError, ValueError, DataError) as e:
        raise DataError(f"cannot read {target.image} to caption it: {e}") from None


def _frames(path: Path) -> int:
    """A clip's frame count (0 for an image), for finding its middle frame."""
    return video.clip_info(path)[2] if video.is_clip(path) else 0


def _read(path: Path) -> str:
    """A caption file's text as `plan_edit` reads it (line endings kept, bad bytes replaced)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()
