"""What a fine-tune learned, in numbers: three prompt groups drawn before and after, scored by the judge.

- **memorization**: training captions. Does the adapter reproduce what it saw?
- **generalization**: the trigger word in contexts no training caption had. Did it learn a concept?
- **unrelated**: base-world prompts without the trigger. Is the base model's prior intact?

Each group is drawn with the adapter at scale 0 (the base model alone) and 1, with the same seeds,
and `learning_report` writes the scores to `learning_report.json` in the run folder.

Pass rates hide drift (a red circle turned salmon is still red), so the report also measures it
as distances (`kit.toy.drift`), on the same prompts and seeds as `scripts/score_toy.py`, drawn
by plain pipeline calls: the two agree.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from kit.families.base import ImageSpec
from kit.io import write_json
from kit.sample.validate import draw_in_batches, load_trained, run_validation
from kit.toy import world as toyworld
from kit.toy.drift import DRIFT_SEEDS, accuracy, drift_measures, drift_scenes, prompt_of
from kit.toy.judge import judge, score

GROUPS = ("memorization", "generalization", "unrelated")
REPORT_BATCH = 32
"""Images per pipeline call: the toy world's images are small, so a call's own cost (the text
encoder, the scheduler's steps in Python) outweighs the images' and batching pays."""
"""The prompt groups, in the order they are drawn and shown."""
_CAPTION = re.compile(
    r"^a (?P<size>\w+) (?P<color>\S+) (?P<shape>\S+) on a (?P<background>\w+) background, "
    r"(?:on the|in the) (?P<position>\w+)$"
)


def parse_caption(text: str) -> dict[str, str] | None:
    """The scene a toy-world caption names (None when it does not follow the grammar)."""
    m = _CAPTION.match(text.strip())
    return m.groupdict() if m else None


def concept_of(captions: list[str], trigger: str) -> tuple[str, str]:
    """The slot the trigger word fills in toy captions ("color" or "shape") and the judge's name for it.

    A trigger that is itself a toy-world concept (`zorbic`, `zorbstar`) names that concept; any
    other trigger (such as a textual-inversion token) stands for the first concept of its slot.
    """
    slots = {"color": tuple(toyworld.CONCEPT_COLORS), "shape": toyworld.CONCEPT_SHAPES}
    for slot, names in slots.items():
        if trigger in names:
            return slot, trigger
    for text in captions:
        scene = parse_caption(text) or {}
        for slot, names in slots.items():
            if scene.get(slot) == trigger:
                return slot, names[0]
    return "color", slots["color"][0]


def prompt_groups(
    captions: list[str], trigger: str = toyworld.TRIGGER_WORD, per_group: int = 8, seed: int = 0
) -> dict[str, list[str]]:
    """Prompts of the three groups: training captions, new trigger contexts, unrelated base prompts."""
    seen = list(dict.fromkeys(c.strip() for c in captions if parse_caption(c)))
    # Only captions with the trigger: a dataset may also hold images of what must not change.
    memorization = [c for c in seen if trigger in c.split(" ")][:per_group]
    slot, concept = concept_of(seen, trigger)
    fresh = []
    for s in toyworld.sample_scenes(64, seed + 1000, **{f"{slot}s": (concept,)}):
        # Whole words only, so the concept's name never matches inside another word.
        words = toyworld.caption(s).split(" ")
        text = " ".join(trigger if w == concept else w for w in words)
        if text not in seen and text not in fresh:
            fresh.append(text)
    unrelated = [toyworld.caption(s) for s in toyworld.sample_scenes(per_group, seed + 2000)]
    return {
        "memorization": memorization,
        "generalization": fresh[:per_group],
        "unrelated": unrelated,
    }


def _scores(
    images: list[Any], prompts: list[str], trigger: str, slot: str, concept: str
) -> dict[str, Any]:
    """Judge accuracy against each prompt's scene, and how often the concept appears."""
    expected = []
    for p in prompts:
        scene = parse_caption(p) or {}
        if scene.get(slot) == trigger:
            scene[slot] = concept  # the trigger word asks for the concept, whatever the word is
        expected.append(scene)
    result = score(images, expected)
    verdicts = result.pop("verdicts")
    result["concept_rate"] = sum(v[slot] == concept for v in verdicts) / len(verdicts)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def learning_report(
    run_dir: str | Path,
    seeds: int = 32,
    checkpoint: str | Path | None = None,
    per_group: int = 8,
    drift_seeds: int = DRIFT_SEEDS,
) -> dict[str, Any]:
    """Draw the three groups at adapter scale 0 and 1, score them, write `learning_report.json`.

    `seeds` images per group and scale, spread over `per_group` prompts; the drift measures on
    `drift_seeds` prompts per group (0 leaves them out).
    """
    run, cfg, family, comps, source = load_trained(run_dir, checkpoint)
    pipe = family.pipeline(comps)
    trigger = (cfg.data.trigger_words or [toyworld.TRIGGER_WORD])[0]
    captions = [r["caption"] for r in json.loads(run.manifest.read_text())]
    groups = prompt_groups(captions, trigger, per_group)
    slot, concept = concept_of(captions, trigger)
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    cols = max(1, seeds // per_group)
    report: dict[str, Any] = {
        "checkpoint": str(source),
        "seeds": cols * per_group,
        "trigger": trigger,
        "concept": {slot: concept},
        "groups": {},
    }
    for name, prompts in groups.items():
        if not prompts:
            # e.g. memorization when no training caption follows the grammar with the trigger
            report.setdefault("skipped", {})[name] = f"no toy-world caption with '{trigger}'"
            continue
        entry: dict[str, Any] = {"prompts": prompts}
        for label, scale in (("before", 0.0), ("after", 1.0)):
            specs = [
                ImageSpec(
                    p,
                    v.validation_negative_prompt,
                    s,
                    family.inference_steps(),
                    family.guidance_scale(),
                    side,
                    side,
                    adapter_scale=scale,
                )
                for p in prompts
                for s in range(cols)
            ]
            out = run.validation / "learning" / f"{name}-{label}"
            grid = run_validation(
                family,
                pipe,
                specs,
                out,
                cols,
                {"base_model": cfg.model.pretrained_model},
                batch=REPORT_BATCH,
            )
            images = [
                _load(out / f"{i // cols:02d}_seed{spec.seed}.png") for i, spec in enumerate(specs)
            ]
            entry[label] = _scores(images, [s.prompt for s in specs], trigger, slot, concept)
            entry[f"{label}_grid"] = str(grid)
        report["groups"][name] = entry
    if drift_seeds:
        steps = v.validation_num_inference_steps
        report["drift"] = drift(family, pipe, trigger, concept, side, steps, drift_seeds)
    report["summary"] = summary(report)
    write_json(run.root / "learning_report.json", report)
    return report


def run_drift(run_dir: str | Path, n: int = DRIFT_SEEDS, checkpoint: str | Path | None = None):
    """The drift measures of a run's checkpoint alone (the latest by default), without the
    prompt groups: what `scripts/preservation_table.py` compares settings by."""
    run, cfg, family, comps, _ = load_trained(run_dir, checkpoint)
    trigger = (cfg.data.trigger_words or [toyworld.TRIGGER_WORD])[0]
    captions = [r["caption"] for r in json.loads(run.manifest.read_text())]
    _, concept = concept_of(captions, trigger)
    v = cfg.validation
    side = v.validation_resolution or cfg.data.resolution
    pipe = family.pipeline(comps)
    return drift(family, pipe, trigger, concept, side, v.validation_num_inference_steps, n)


def drift(
    family: Any, pipe: Any, trigger: str, concept: str, side: int, steps: int, n: int = DRIFT_SEEDS
) -> dict[str, Any]:
    """The drift measures (`kit.toy.drift`) on the independent check's prompts and seeds:
    prompt i drawn with seed i by a plain pipeline call, the adapter at scale 0 and 1."""
    scenes = drift_scenes(concept, n)
    pipe.set_progress_bar_config(disable=True)
    verdicts: dict[str, list[dict[str, Any]]] = {}
    for label, scale in (("before", 0.0), ("after", 1.0)):
        for name, group in scenes.items():
            specs = [
                ImageSpec(
                    prompt_of(sc, concept, trigger),
                    "",
                    i,
                    steps,
                    family.guidance_scale(),
                    side,
                    side,
                    adapter_scale=scale,
                )
                for i, sc in enumerate(group)
            ]
            drawn = draw_in_batches(family, pipe, specs, REPORT_BATCH)
            verdicts[f"{name}_{label}"] = [judge(frames[0]) for frames, _ in drawn]
    slot = "color" if concept in toyworld.CONCEPT_COLORS else "shape"
    out = drift_measures(
        verdicts["unrelated_before"],
        verdicts["unrelated_after"],
        scenes["unrelated"],
        verdicts["trigger_after"],
        concept,
    )
    out["n"] = n
    if concept in toyworld.CONCEPT_COLORS and getattr(pipe, "vae", None) is not None:
        out["concept_color_floor"] = vae_color_floor(pipe.vae, scenes["trigger"], concept, side)
    for label in ("before", "after"):
        trig = verdicts[f"trigger_{label}"]
        out[f"concept_rate_{label}"] = round(sum(v[slot] == concept for v in trig) / n, 4)
        for attr in ("color", "shape"):
            out[f"unrelated_{attr}_{label}"] = accuracy(
                verdicts[f"unrelated_{label}"], scenes["unrelated"], attr
            )
    return out


def vae_color_floor(vae: Any, scenes: list[toyworld.Scene], concept: str, side: int) -> float:
    """How near the base's own VAE brings the concept's color back: the median distance of the
    color in each scene's encoded-and-decoded image to the data's. An adapter trained toward
    those latents aims at this color; the learned color's distance is to be read against it."""
    import numpy as np
    import torch

    target = toyworld.CONCEPT_COLORS[concept]
    images = [toyworld.render(sc, side, side) for sc in scenes]
    param = next(vae.parameters())
    x = torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2)
    x = (x.to(param.device, torch.float32) / 127.5 - 1).to(param.dtype)
    with torch.no_grad():
        out = vae.decode(vae.encode(x).latent_dist.mode()).sample.float()
    pixels = ((out.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    rgbs = [judge(p.cpu().numpy())["rgb"] for p in pixels]
    distances = [
        sum((a - b) ** 2 for a, b in zip(c, target, strict=True)) ** 0.5 for c in rgbs if c
    ]
    return round(statistics.median(distances), 1) if distances else None


def _load(path: Path) -> Any:
    """An image file fully read (so the file handle closes at once)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def summary(report: dict[str, Any]) -> dict[str, float]:
    """The headline numbers: concept rate on trigger prompts, judge accuracy on unrelated ones."""
    g = report["groups"]
    out = {}
    for label in ("before", "after"):
        out[f"concept_rate_{label}"] = g["generalization"][label]["concept_rate"]
        un = g["unrelated"][label]
        out[f"unrelated_accuracy_{label}"] = round((un["color"] + un["shape"]) / 2, 4)
    out["unrelated_drop_points"] = round(
        100 * (out["unrelated_accuracy_before"] - out["unrelated_accuracy_after"]), 1
    )
    d = report.get("drift")
    if d:
        for key in (
            "color_drift",
            "shape_agreement",
            "position_agreement",
            "color_error_before",
            "color_error_after",
            "concept_color_distance",
            "concept_color_floor",
        ):
            if key in d:
                out[key] = d[key]
    return out


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per group and scale: the judge's scores, for a notebook table."""
    rows = []
    for name, entry in report["groups"].items():
        for label in ("before", "after"):
            s = entry[label]
            rows.append(
                {
                    "group": name,
                    "adapter": label,
                    "concept": s["concept_rate"],
                    **{k: s.get(k) for k in ("color", "shape", "position", "background")},
                }
            )
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The table of `table_rows` as plain text."""
    head = ("group", "adapter", "concept", "color", "shape", "position", "background")
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for row in table_rows(report):
        cells = [f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h]) for h in head]
        lines.append("  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)
