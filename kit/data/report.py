"""The bucket report: what training will do with the dataset, counted as the trainer counts it."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.data.buckets import epoch_batches, group_name, plan_dataset
from kit.data.datasets import views
from kit.data.masks import has_alpha, masked, plan_masks
from kit.data.pairs import controls_of, resized_control, unpaired
from kit.data.scan import check_dataset
from kit.data.sound import sound_counts
from kit.families import family_class, family_info


def bucket_report(cfg: Config, num_processes: int = 1) -> dict[str, Any]:
    """Buckets, dropped images, aspect histogram and batches / steps / epochs of a run.

    `batches_per_epoch` is what each process's loader yields in one epoch (the trainer's own
    `epoch_batches`), `steps_per_epoch` those divided by the gradient accumulation.
    """
    t = cfg.train
    # With masks, an image whose mask is unusable is left out before bucketing, as in training.
    refused = plan_masks(cfg) if masked(cfg.data) else None
    family = refused.family if refused else family_info(cfg.model.model_family)
    scanned = refused.scanned if refused else check_dataset(cfg.data, family)
    samples, plan = plan_dataset(cfg, num_processes, family=family, scanned=scanned)
    if refused is not None:
        plan.dropped = plan.dropped + refused.refused
    # Edit models: the targets without their control and the controls without their target.
    plan.dropped = plan.dropped + unpaired(scanned)
    video = any(p.frames for p in plan.placements)
    buckets = []
    for key, idx in sorted(plan.groups().items()):
        w, h, frames = key
        row: dict[str, Any] = {"bucket": group_name(key), "width": w, "height": h}
        if video:
            row["frames"] = frames
        row.update(
            aspect=round(w / h, 3),
            count=len(idx),
            images=len(idx),  # the name earlier versions of `kit buckets --json` used
            repeats=plan.repeats.get(key, 1),
            per_epoch=plan.occurrences(idx) * plan.repeats.get(key, 1),
            files=[_shown(samples[i]) for i in idx],
        )
        if any(samples[i].controls for i in idx):  # an edit model's pairs: each file's controls
            row["controls"] = [[str(c) for c in samples[i].controls] for i in idx]
            # ... and the size each control trains at: the target's crop, the pipeline's resize.
            sizer = _control_sizer(cfg, family)
            row["control_sizes"] = [
                [
                    _wxh(resized_control(c, plan.placements[i], sizer, cfg.data))
                    for c in controls_of(samples[i])
                ]
                for i in idx
            ]
        if family.image_alpha:  # a VAE that reads RGBA: which images train with their alpha
            row["alpha"] = [_shown(samples[i]) for i in idx if _carries_alpha(samples[i])]
        if video:  # a clip's windows are samples of their own: `count` counts windows
            row["clips"] = len({samples[i].image for i in idx if samples[i].clip})
        buckets.append(row)
    # A sample of a dataset, shard or bucket by its own name (a URL keeps its `//`).
    names = {s.image: _shown(s) for s in scanned.samples if s.blob is not None}
    # Every epoch has the same number of batches; epoch 0 stands for all.
    total = len(epoch_batches(plan, t.train_batch_size, t.seed, 0, num_processes))
    per_process = total // num_processes
    accum = t.gradient_accumulation_steps
    steps = per_process / accum
    return {
        "images": len(samples),
        **(_windows(samples) if video else {}),
        **({"clip_frames": clip_rows(cfg, plan), **conditioning(cfg)} if video else {}),
        # A family that trains on sound (`audio`): which clips have any.
        **(sound_counts(samples) if video and family.audio else {}),
        "samples_per_epoch": sum(b["per_epoch"] for b in buckets),
        "datasets": _datasets(cfg, samples, plan),
        "buckets": buckets,
        "dropped": [{"file": names.get(f, str(f)), "reason": why} for f, why in plan.dropped],
        "aspect_histogram": aspect_histogram([s.width / s.height for s in samples]),
        "small_bucket_policy": cfg.data.small_bucket_policy,
        "processes": num_processes,
        "train_batch_size": t.train_batch_size,
        "gradient_accumulation_steps": accum,
        "effective_batch": plan.group_size,
        "batches_per_epoch": per_process,
        "batches_all_processes": total,
        "steps_per_epoch": round(steps, 3),
        "max_train_steps": t.max_train_steps,
        # Micro-batches carry over epoch ends, so the run needs steps × accumulation batches.
        "epochs": math.ceil(t.max_train_steps * accum / per_process) if per_process else None,
    }


def _control_sizer(cfg: Config, family: Any) -> Any:
    """Something with the family's `control_size` rule: the family itself, else its class (the
    facts alone do not hold the rule; only a paired dataset imports the class)."""
    return family if hasattr(family, "control_size") else family_class(family.name)(cfg)


def _wxh(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _carries_alpha(sample: Any) -> bool:
    """Whether a still image carries transparency (its header; a source's member is opened)."""
    if sample.clip:
        return False
    return has_alpha(sample.blob.open() if sample.blob is not None else sample.image)


def _shown(sample: Any) -> str:
    """How a report names a sample: its file, or its source's name for it."""
    return sample.blob.name if getattr(sample, "blob", None) is not None else str(sample.image)


def _datasets(cfg: Config, samples: list, plan: Any) -> list[dict[str, Any]]:
    """Each dataset: its name, folder, role, weight, images kept and samples per epoch."""
    kept = Counter(s.dataset for s in samples)
    dropped = Counter()
    seen = views(cfg.data)
    for f, _ in plan.dropped:
        for v in seen:
            if Path(f).is_relative_to(v.data.image_dir):
                dropped[v.index] += 1
    return [
        {
            "name": v.name,
            "image_dir": v.data.image_dir,
            "role": v.role,
            "repeats": v.repeats,
            "loss_weight": v.loss_weight,
            "images": kept[v.index],
            "dropped": dropped[v.index],
            "samples_per_epoch": kept[v.index] * v.repeats,
        }
        for v in seen
    ]


def _windows(samples: list) -> dict[str, int]:
    """Clips kept and the windows they train as (`frame_sampling`); each window is a sample."""
    clips = [s for s in samples if s.clip]
    return {"clips": len({s.image for s in clips}), "windows": len(clips)}


CONDITION_KEY = "condition_frame"
"""The config key (data or model section) an image-to-video run may name its conditioning frame
by; absent, the first frame of each window conditions it, as the Wan I2V pipelines take it."""


def conditioning(cfg: Config) -> dict[str, Any]:
    """Which frame of a window would condition an image-to-video model: `condition_frame` where
    the config has such a key (a frame index within the window, or a word), else the first."""
    value = next(
        (
            getattr(sec, CONDITION_KEY)
            for sec in (cfg.data, cfg.model)
            if hasattr(sec, CONDITION_KEY)
        ),
        None,
    )
    if value is None or value in (0, "first"):
        return {"conditioning_frame": "first frame of each window", "conditioning_index": 0}
    if value == "last":
        return {"conditioning_frame": "last frame of each window", "conditioning_index": -1}
    if isinstance(value, int):
        return {"conditioning_frame": f"frame {value} of each window", "conditioning_index": value}
    return {"conditioning_frame": f"{value} frame", "conditioning_index": None}


def clip_rows(cfg: Config, plan: Any) -> list[dict[str, Any]]:
    """Per clip: the frames it holds, the frames each window trains (the family's count, Wan's
    4k+1), the stride, how many windows it is cut into and which source frames each takes,
    and the source frame that conditions each window (image-to-video)."""
    strides = {v.index: v.data.frame_stride for v in views(cfg.data)}
    index = conditioning(cfg)["conditioning_index"]
    rows: dict[Path, dict[str, Any]] = {}
    for sample, placed in zip(plan.samples[: plan.size], plan.placements[: plan.size], strict=True):
        if not sample.clip:
            continue
        row = rows.setdefault(
            sample.image,
            {
                "clip": sample.image.name,
                "source_frames": sample.total_frames,
                "frames_trained": placed.num_frames,
                "frame_stride": strides.get(sample.dataset, 1),
                "windows": 0,
                "window_frames": [],
                "conditioning_frames": [],
            },
        )
        frames = placed.frames or (0,)
        row["windows"] += 1
        row["window_frames"].append(f"{frames[0]}-{frames[-1]}")
        cond = frames[index] if index is not None and index < len(frames) else None
        row["conditioning_frames"].append(cond)
    return list(rows.values())


def aspect_histogram(aspects: list[float], bins: int = 12) -> list[dict[str, Any]]:
    """Counts of aspect ratios (width / height) in equal bins of log aspect ratio."""
    if not aspects:
        return []
    lo, hi = math.log(min(aspects)), math.log(max(aspects))
    if hi - lo < 1e-9:
        return [
            {"from": round(min(aspects), 3), "to": round(max(aspects), 3), "count": len(aspects)}
        ]
    width = (hi - lo) / bins
    counts = Counter(min(bins - 1, int((math.log(a) - lo) / width)) for a in aspects)
    return [
        {
            "from": round(math.exp(lo + i * width), 3),
            "to": round(math.exp(lo + (i + 1) * width), 3),
            "count": counts.get(i, 0),
        }
        for i in range(bins)
    ]


def report_figure(report: dict[str, Any]):
    """Images per bucket, and the histogram of the images' aspect ratios."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
    a.bar([r["bucket"] for r in report["buckets"]], [r["count"] for r in report["buckets"]])
    a.set_title("images per bucket")
    a.tick_params(axis="x", rotation=45)
    hist = report["aspect_histogram"]
    labels = [f"{h['from']:.2f}" for h in hist]
    b.bar(labels, [h["count"] for h in hist])
    b.set_title("image aspect ratio (width / height, bin start)")
    b.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    plt.close(fig)  # shown once, as the cell's result
    return fig


def pair_lines(bucket: dict[str, Any]) -> list[str]:
    """An edit dataset's bucket: how many pairs, and the sizes their controls train at."""
    if "control_sizes" not in bucket:
        return []
    sizes = Counter(" + ".join(s) for s in bucket["control_sizes"] if s)
    said = ", ".join(f"{k} ({n})" for k, n in sorted(sizes.items()))
    return [f"{'':>14}  pairs: {sum(sizes.values())}, controls resized to {said}"]


def pair_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of the report: its target's bucket, the target, its controls and the size
    each control trains at."""
    return [
        {
            "bucket": b["bucket"],
            "target": Path(f).name,
            "controls": ", ".join(Path(c).name for c in cs),
            "control size": ", ".join(sizes),
        }
        for b in report["buckets"]
        if "control_sizes" in b
        for f, cs, sizes in zip(b["files"], b["controls"], b["control_sizes"], strict=True)
        if cs
    ]


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as a plain-text table and summary."""
    lines = []
    if len(report.get("datasets", [])) > 1:
        lines.append(f"{'dataset':>14}  {'role':>8}  {'images':>6}  repeats  weight  per epoch")
        for d in report["datasets"]:
            lines.append(
                f"{d['name']:>14}  {d['role']:>8}  {d['images']:>6}  {d['repeats']:>7}  "
                f"{d['loss_weight']:>6g}  {d['samples_per_epoch']:>9}"
            )
    lines.append(f"{'bucket':>14}  {'aspect':>6}  {'images':>6}  repeats  per epoch")
    for b in report["buckets"]:
        lines.append(
            f"{b['bucket']:>14}  {b['aspect']:>6}  {b['count']:>6}  {b['repeats']:>7}  "
            f"{b['per_epoch']:>9}"
        )
        lines += pair_lines(b)
    if report.get("clips"):
        lines.append(f"{report['clips']} clip(s) → {report['windows']} window(s)")
        lines.append(
            f"{'clip':>20}  {'frames':>6}  trained  stride  windows  source frames per window"
            "  (conditioning frame)"
        )
        for c in report["clip_frames"]:
            spans = [
                f"{w} ({'-' if k is None else k})"
                for w, k in zip(c["window_frames"], c["conditioning_frames"], strict=True)
            ]
            more = f" … {len(spans) - 4} more" if len(spans) > 4 else ""
            lines.append(
                f"{c['clip'][-20:]:>20}  {c['source_frames']:>6}  {c['frames_trained']:>7}  "
                f"{c['frame_stride']:>6}  {c['windows']:>7}  {', '.join(spans[:4])}{more}"
            )
        lines.append(f"conditioning frame (image-to-video): {report['conditioning_frame']}")
    if "clips_with_sound" in report:
        lines.append(
            f"{report['clips_with_sound']} clip(s) with sound, {report['silent_clips']} silent "
            "(silent clips train video only)"
        )
    for d in report["dropped"]:
        lines.append(f"dropped {d['file']}: {d['reason']}")
    lines.append(
        f"{report['images']} image(s) train ({report['samples_per_epoch']} per epoch with "
        f"repeats), {len(report['dropped'])} dropped; "
        f"effective batch {report['effective_batch']} "
        f"({report['train_batch_size']} × {report['gradient_accumulation_steps']} accumulation × "
        f"{report['processes']} process(es), small buckets: {report['small_bucket_policy']})"
    )
    lines.append(
        f"{report['batches_per_epoch']} batch(es) per process per epoch = "
        f"{report['steps_per_epoch']} optimizer step(s) per epoch; "
        f"{report['max_train_steps']} steps take {report['epochs']} epoch(s)"
    )
    return lines
