"""The model card (README.md) a pushed run carries: hub metadata, then how to use the files.

The front matter is what the hub indexes and shows: the base model (by hub id only: a local
folder's name would be a broken link), tags, the license, the trigger words and sample images
as widgets. The prose says what the files are, how to load them in diffusers and where to put
them for the clients each file's export check passed (ComfyUI, AUTOMATIC1111 / Forge), and what
the run was trained with. Everything in it is a
name, a number or a prompt: never a local path, and never a token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.export.edits import EditExample
from kit.export.resize import RESIZE_RECORD
from kit.families import Family, get_family
from kit.families.identity import public_name
from kit.methods import get_method
from kit.methods.base import Method
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir

PROJECT = "diffusion-tuning-kit"

BASE_LICENSES: dict[str, dict[str, str]] = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": {"license": "creativeml-openrail-m"},
    "stabilityai/stable-diffusion-xl-base-1.0": {"license": "openrail++"},
    "stabilityai/stable-diffusion-3.5-medium": {
        "license": "other",
        "license_name": "stabilityai-ai-community",
        "license_link": "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/blob/main/LICENSE.md",
    },
    "black-forest-labs/FLUX.1-dev": {
        "license": "other",
        "license_name": "flux-1-dev-non-commercial-license",
        "license_link": "https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/LICENSE.md",
    },
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {"license": "apache-2.0"},
}
"""The licenses of the base models the kit ships configs for, as their hub pages state them.
An adapter trained on one is bound by it, so the card carries it unless `--license` says
otherwise."""


def hub_base(cfg: Config) -> str | None:
    """The base model's hub id, or None for a local model that has none (a bare folder)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name = public_name(cfg.model.pretrained_model)
    if "/" not in name:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def license_fields(cfg: Config, license: str | None) -> dict[str, str]:
    """`license` (and `license_name` / `license_link` for "other") of the front matter."""
    if license:
        return {"license": license}
    return dict(BASE_LICENSES.get(hub_base(cfg) or "", {"license": "other"}))


def method_tags(method: Method) -> list[str]:
    """The hub tags that say what kind of file this is."""
    return list(method.hub_tags)


def _yaml(value: dict | list, indent: int = 0) -> list[str]:
    """A small YAML writer for strings, numbers, lists and dicts: every scalar is written as
    JSON, which YAML reads back unchanged (a JSON string is a double-quoted YAML scalar)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}{k}:")
                lines += _yaml(v, indent + 2)
            else:
                lines.append(f"{pad}{k}: {json.dumps(v, ensure_ascii=False)}")
        return lines
    for item in value:
        if isinstance(item, dict | list) and item:
            sub = _yaml(item, indent + 2)
            lines.append(f"{pad}- {sub[0].lstrip()}")
            lines += sub[1:]
        else:
            lines.append(f"{pad}- {json.dumps(item, ensure_ascii=False)}")
    return lines


def front_matter(
    cfg: Config,
    family: Family,
    method: Method,
    samples: Sequence[tuple[str, str]],
    license: str | None,
) -> dict[str, Any]:
    """The card's YAML metadata as data."""
    pipeline_tag = "text-to-video" if family.video else "text-to-image"
    meta: dict[str, Any] = {}
    base = hub_base(cfg)
    if base:
        meta["base_model"] = base
    meta.update(license_fields(cfg, license))
    meta["library_name"] = "diffusers"
    meta["pipeline_tag"] = pipeline_tag
    tags = [*method_tags(method), "diffusers", pipeline_tag, family.name, PROJECT]
    meta["tags"] = list(dict.fromkeys(tags))
    trigger = trigger_words(cfg, method)
    if trigger:
        meta["instance_prompt"] = ", ".join(trigger)
    if samples:
        meta["widget"] = [{"text": p, "output": {"url": url}} for p, url in samples]
    return meta


def trigger_words(cfg: Config, method: Method) -> list[str]:
    """What a prompt must contain: the placeholder tokens of textual inversion, else the
    trigger words (or the instance prompt)."""
    if method.embeddings:
        return list(cfg.network.placeholder_tokens)
    if cfg.data.trigger_words:
        return list(cfg.data.trigger_words)
    return [cfg.data.instance_prompt] if cfg.data.instance_prompt else []


def _first(files: dict[str, list[str]], fmt: str) -> str | None:
    return (files.get(fmt) or [None])[0]


def diffusers_usage(
    family: Family, method: Method, files: dict[str, list[str]], repo: str, base: str, prompt: str
) -> str:
    """How to draw with the pushed files in plain diffusers (a paragraph and a code block)."""
    cls = family.pipeline_class
    head = ["import torch", f"from diffusers import {cls}"]
    load = f'pipe = {cls}.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda")'
    if method.whole_denoiser:
        load = f'pipe = {cls}.from_pretrained("{repo}", torch_dtype=torch.bfloat16).to("cuda")'
        body = []
    elif method.embeddings:
        body = _embedding_lines(family, method, files, repo)
        if len(family.embedding_names) > 1:
            head += [
                "from huggingface_hub import hf_hub_download",
                "from safetensors.torch import load_file",
            ]
    elif _first(files, "diffusers"):
        body = []
        for name in files["diffusers"]:  # one file per model of the denoiser (`_<part>`)
            part = Path(name).stem.removeprefix("pytorch_lora_weights").removeprefix("_")
            extra = "".join(f", {k}={v!r}" for k, v in family.lora_load_kwargs(part).items())
            body.append(f'pipe.load_lora_weights("{repo}", weight_name="{name}"{extra})')
    else:
        return (
            "diffusers' `load_lora_weights` does not read this run's LoHa or LoKr weights; "
            "the clients below load its kohya-layout file."
        )
    if family.video:
        draw = [
            f"frames = pipe({json.dumps(prompt)}).frames[0]",
            "",
            "from diffusers.utils import export_to_video",
            'export_to_video(frames, "sample.mp4", fps=16)',
        ]
    else:
        draw = [f"image = pipe({json.dumps(prompt)}).images[0]", 'image.save("sample.png")']
    code = "\n".join([*head, "", load, *body, *draw])
    return f"```python\n{code}\n```"


def _embedding_lines(
    family: Family, method: Method, files: dict[str, list[str]], repo: str
) -> list[str]:
    tokens = list(method.cfg.network.placeholder_tokens)
    paths = files.get("embedding", [])
    names = family.embedding_names
    lines = []
    for token, path in zip(tokens, paths, strict=False):
        if len(names) <= 1:
            lines.append(
                f'pipe.load_textual_inversion("{repo}", weight_name="{path}", token="{token}")'
            )
            continue
        lines.append(f'state = load_file(hf_hub_download("{repo}", "{path}"))')
        for name, sub in zip(names, family.text_subfolders, strict=False):
            tok = sub.replace("text_encoder", "tokenizer")
            lines.append(
                f'pipe.load_textual_inversion(state["{name}"], token="{token}", '
                f"text_encoder=pipe.{sub}, tokenizer=pipe.{tok})"
            )
    return lines


FORMAT_USE = {
    "diffusers": "diffusers (`pipe.load_lora_weights`)",
    "embedding": "ComfyUI, AUTOMATIC1111 / Forge, diffusers (`load_textual_inversion`)",
    "peft": "peft (`PeftModel.from_pretrained`)",
}
"""Which clients a file of each format is for, where its export left no record of its checks
(a kohya file's clients are only those its check passed: none without one)."""


def file_record(run: RunDir, fmt: str, path: str) -> dict[str, Any]:
    """What the file's export recorded (its verify.json), {} where there is none."""
    record = run.exports / fmt / f"{Path(path).stem}.verify.json"
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_use(run: RunDir, fmt: str, path: str) -> str:
    """Which clients the file is for: what its export's check recorded (`use_in` of its
    verify.json, the clients whose rules it passed), else the format's usual clients; a file
    that changes nothing says so first."""
    record = file_record(run, fmt, path)
    use = "; ".join(str(u) for u in record.get("use_in") or [])
    if not use:
        use = FORMAT_USE.get(fmt, f"not checked (export {fmt} again with its check)")
    return f"UNTRAINED, changes nothing: {use}" if record.get("untrained") else use


def client_usage(
    run: RunDir, family: Family, method: Method, files: dict[str, list[str]]
) -> tuple[str, str]:
    """The section on the single-file clients, as (its title, its text): which file goes
    where, for the clients its export's check passed only (`use_in`), each file on the model
    it is for where the denoiser is several."""
    if files.get("embedding"):
        rows = [
            f"- `{p}`: into `ComfyUI/models/embeddings/` (write `embedding:{Path(p).stem}` in "
            f"the prompt) or `stable-diffusion-webui/embeddings/` (write `{Path(p).stem}`)."
            for p in files.get("embedding", [])
        ]
        return "Use it in ComfyUI or AUTOMATIC1111", "\n".join(rows)
    kohya = files.get("kohya") or []
    if not kohya:
        return "Use it in other clients", (
            "This run has no single-file export for ComfyUI or AUTOMATIC1111; the files above "
            "load in diffusers."
        )
    rows, named = [], set()
    for path in kohya:
        record = file_record(run, "kohya", path)
        use = [str(u) for u in record.get("use_in") or []]
        part = str(record.get("part") or "")
        where = []
        if any(u.startswith("ComfyUI") for u in use):
            named.add("ComfyUI")
            on = f" on the model of {family.part_title(part)}" if part else ""
            label = family.client_label("ComfyUI")
            since = f"; it needs {label}" if label != "ComfyUI" else ""
            where.append(
                f"into `ComfyUI/models/loras/` and load it with a LoRA loader node{on}{since}"
            )
        if any(u.startswith("A1111") for u in use):
            named.add("AUTOMATIC1111")
            where.append(
                f"into `stable-diffusion-webui/models/Lora/` and write "
                f"`<lora:{Path(path).stem}:1>` in the prompt (AUTOMATIC1111 and Forge)"
            )
        text = f"- `{path}`: " + (
            ", or ".join(where) + "."
            if where
            else "no client check backs it (exported without one, or none passed): export it "
            "again with its check to learn where it loads."
        )
        if record.get("untrained"):
            text += f" It is UNTRAINED: {record['untrained']}."
        rows.append(text)
    notes = []  # paragraphs after the list
    if len(kohya) > 1:
        notes.append(
            "Each file goes on the model it names: on the other one it adapts weights it was "
            "not trained for."
        )
    notes += [f"{c}: {gap}." for c, gap in method.client_gaps().items() if c in _clients(run)]
    if _first(files, "diffusers"):
        notes.append("The files in the diffusers layout above hold the same adapter.")
    title = "Use it in " + (" or ".join(sorted(named)) if named else "other clients")
    return title, "\n\n".join(["\n".join(rows), *notes])


def _clients(run: RunDir) -> set[str]:
    """The clients the run's kohya exports were checked with."""
    found = set()
    for record in sorted((run.exports / "kohya").glob("*.verify.json")):
        try:
            found |= {c["client"] for c in json.loads(record.read_text())["clients"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def settings_rows(
    cfg: Config, method: Method, step: int, images: int, resized: dict[str, Any] | None
) -> list[tuple[str, str]]:
    """The training settings table: what someone repeating the run would need."""
    net, train = cfg.network, cfg.train
    kind = method.title
    if method.low_rank:
        kind += f", rank {net.lora_rank}, alpha {method.alpha():g}"
    rows = [
        ("network", kind),
        ("steps", str(step)),
        ("learning rate", f"{train.learning_rate:g} ({train.optimizer}, {train.lr_scheduler})"),
        (
            "batch",
            f"{train.train_batch_size} × {train.gradient_accumulation_steps} accumulation",
        ),
        ("resolution", str(cfg.data.resolution)),
        ("training images", str(images)),
        ("precision", "fp32" if train.mixed_precision == "no" else str(train.mixed_precision)),
        ("seed", str(train.seed)),
    ]
    if resized:
        rows.append(
            (
                "resized",
                f"from a {resized['source_method']} of rank {resized['trained_rank']} by SVD; "
                f"kept energy mean {resized['mean_energy']:.4f}, min {resized['min_energy']:.4f}",
            )
        )
    return rows


def model_card(
    run: RunDir,
    cfg: Config,
    files: dict[str, list[str]],
    grid: str | None,
    *,
    samples: Sequence[tuple[str, str]] = (),
    repo: str = "<user>/<repo>",
    step: int | None = None,
    license: str | None = None,
    edits: Sequence[EditExample] = (),
    edit_image: str | None = None,
    videos: dict[str, str] | None = None,
) -> str:
    """README.md of a pushed run.

    `files`: export format → the pushed files' paths in the repository (embeddings in the
    order of the placeholder tokens); `grid` and `samples`
    ((prompt, path) each): the sample images' paths there (a clip's: its animated WebP);
    `videos`: a clip's WebP path → its MP4's; `step`: the exported checkpoint's (default: the
    latest); `edits` and `edit_image`: an edit run's examples (`edit_examples`) and their
    figure's path there (`edit_figure`).
    """
    family = get_family(cfg.model.model_family, cfg)
    method = get_method(cfg, family)
    if step is None:
        latest = ckpt.resolve_resume(run.root, "latest")
        step = json.loads((latest / ckpt.PROGRESS_FILE).read_text())["step"] if latest else 0
    images = len(json.loads(run.manifest.read_text())) if run.manifest.is_file() else 0
    record = run.root / RESIZE_RECORD
    resized = json.loads(record.read_text()) if record.is_file() else None
    meta = front_matter(cfg, family, method, samples, license)
    base = hub_base(cfg)
    base_text = (
        f"[{base}](https://huggingface.co/{base})"
        if base
        else (f"the local base model `{public_name(cfg.model.pretrained_model)}`")
    )
    trigger = trigger_words(cfg, method)
    prompt = samples[0][0] if samples else (", ".join(trigger) or "a photo")
    title = repo.rsplit("/", 1)[-1]
    out = ["---", *_yaml(meta), "---", "", f"# {title}", ""]
    out.append(
        f"{method.title} on {base_text} (model family `{family.name}`), trained with {PROJECT}: "
        f"{step} steps on {images} images."
    )
    if meta.get("license") == "other" and "license_name" not in meta:
        out += ["", "No license was chosen for this model; using it is bound by the base "
                "model's license."]  # fmt: skip
    elif not license and base in BASE_LICENSES:
        out += [
            "",
            f"The license is the base model's ({meta.get('license_name', meta['license'])}).",
        ]
    out += ["", "## Trigger words", ""]
    out.append(
        "Use " + ", ".join(f"`{w}`" for w in trigger) + " in the prompt."
        if trigger
        else "None: the training captions named no trigger word."
    )
    listed = [
        f"| `{p}` | {fmt} | {file_use(run, fmt, p)} |"
        for fmt, paths in files.items()
        for p in paths
    ]
    out += ["", "## Files", "", "| file | format | load it in |", "| --- | --- | --- |", *listed]
    out += ["", "## Use it in diffusers", ""]
    out.append(diffusers_usage(family, method, files, repo, base or "<base model>", prompt))
    if not base:
        out += ["", "Put the path of your copy of the base model in place of `<base model>`."]
    title, usage = client_usage(run, family, method, files)
    out += ["", f"## {title}", "", usage]
    out += ["", "## Training settings", "", "| setting | value |", "| --- | --- |"]
    out += [f"| {k} | {v} |" for k, v in settings_rows(cfg, method, step, images, resized)]
    clips = [(p, url) for p, url in samples if url.endswith(".webp")]
    if grid or clips:
        out += ["", "## Samples"]
    if clips:
        out += ["", *clip_lines(clips, videos or {}, step)]
    if grid:
        what = "frame strips" if clips else "images"
        out += ["", f"![validation {what} at step {step}]({grid})"]
        prompts = list(dict.fromkeys(p for p, _ in samples))
        if prompts:
            out += ["", "Prompts, one per row: " + "; ".join(f"`{p}`" for p in prompts) + "."]
    if edit_image:
        out += ["", *edit_section(edits, edit_image)]
    return "\n".join(out) + "\n"


def edit_section(edits: Sequence[EditExample], image: str) -> list[str]:
    """An edit run's examples: control → base → result, and the instructions drawn."""
    base = any(e.base is not None for e in edits)
    lines = [
        "## Edits",
        "",
        "Each row is one instruction: its control image(s), then "
        + ("the base model's result (the adapter off), then " if base else "")
        + "this adapter's result, drawn with the same seed.",
        "",
        f"![control → {'base → ' if base else ''}result]({image})",
        "",
        "Instructions, one per row: " + "; ".join(f"`{e.prompt}`" for e in edits) + ".",
    ]
    if not base:
        lines += [
            "",
            "The base model's result is not shown: notebook 05 draws it "
            "(`draw_checkpoint(run, scales=[0, 1])`) before the run is pushed.",
        ]
    return lines


def clip_lines(clips: Sequence[tuple[str, str]], videos: dict[str, str], step: int) -> list[str]:
    """The validation clips as the hub shows them: each animated WebP inline (it plays like a
    GIF, in the page and in the widget gallery), under its prompt, with a link to its MP4."""
    lines = [f"The validation clips at step {step}, looping:", ""]
    for prompt, url in clips:
        mp4 = f" ([MP4]({videos[url]}))" if url in videos else ""
        alt = prompt.replace("[", "(").replace("]", ")")  # a bracket would end the alt text
        lines += [f"![{alt}]({url})", "", f"`{prompt}`{mp4}", ""]
    return lines[:-1]


__all__ = [
    "BASE_LICENSES",
    "PROJECT",
    "front_matter",
    "hub_base",
    "license_fields",
    "method_tags",
    "model_card",
    "trigger_words",
]
