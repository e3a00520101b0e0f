"""The doctor: read a run folder (logs, checkpoints, validation images, data manifest) and list
what went wrong, most serious first, each finding with its evidence and the usual fix.

Cheap and safe on a half-written run: every check reads what is there, skips what is not, and a
check that fails becomes an `info` finding instead of an exception. `write_report` is what the
end of every training run calls; it writes `doctor.json` in the run folder.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

SEVERITIES = ("error", "warning", "info")
"""`error`: the run is broken; `warning`: the result is likely worse than it should be;
`info`: worth knowing, often by design."""
REPORT_FILE = "doctor.json"

# Thresholds, in one place. Pixel differences are mean absolute differences of images scaled
# to [0, 1] and shrunk to THUMB pixels a side.
THUMB = 64
STALLED_TOTAL = 0.002  # first to last validation grid changed less than this: nothing learned
PLATEAU_SHARE = 0.05  # a step between grids changing < 5% of the largest change is a plateau
COLLAPSE_SHARE = 0.35  # prompts' images as alike as this share of the reference: collapsed
WASHED_SHARE = 0.6  # contrast or saturation below this share of the reference: washed out
FLAT_CONTRAST = 0.02  # luminance std below this: a flat (grey) image
PRIOR_DRIFT = 0.08  # unrelated prompts moved this far from the reference…
PRIOR_SHARE = 0.5  # …and at least this share of the trigger prompts' move
STABLE_FLAT = 1e-4  # stable loss changed by less than this share: nothing trains
SMALL_BUCKET_WEIGHT = 4.0  # an image alone in a short batch weighs this many times more: warning
MEMORY_RISE = 0.10  # allocated memory grew by this share after the first tenth of the run
_CKPT_LOAD_LIMIT = 256 * 2**20  # optimizer files larger than this are not opened


@dataclass
class Finding:
    """One diagnosis: what, how sure, the evidence and the usual fix."""

    code: str
    severity: str
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        """As plain data."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"[{self.severity}] {self.title}"]
        lines += [f"    - {e}" for e in self.evidence]
        if self.fix:
            lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


def serious(findings: list[Finding]) -> list[Finding]:
    """The errors and warnings."""
    return [f for f in findings if f.severity in ("error", "warning")]


def rows(findings: list[Finding]) -> list[dict[str, str]]:
    """Table rows for a notebook: severity, finding, evidence, fix."""
    return [
        {
            "severity": f.severity,
            "finding": f.title,
            "evidence": "; ".join(f.evidence),
            "fix": f.fix,
        }
        for f in findings
    ]


def format_findings(findings: list[Finding]) -> str:
    """The findings as text, or a line saying there are none."""
    if not findings:
        return "no findings: nothing in this run looks wrong"
    return "\n".join(str(f) for f in findings)


# ---------------------------------------------------------------- reading a run


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class _Run:
    """What a run folder holds, each part read once and only when a check asks."""

    def __init__(self, root: Path, error: str | None = None) -> None:
        self.root = root
        self.error = error

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        from kit.run.folder import RunDir

        return [r for r in RunDir(self.root).read_metrics() if isinstance(r.get("step"), int)]

    @cached_property
    def config(self) -> Any:
        """The checked Config, or None when it cannot be read."""
        from kit.config import load_config

        try:
            return load_config(self.root / "config.json")
        except Exception:
            return None

    @cached_property
    def flat(self) -> dict[str, Any]:
        """The flat config: the checked one, else the raw file over the defaults."""
        from kit.config import Config

        if self.config is not None:
            return self.config.to_dict(flat=True)
        out = Config().to_dict(flat=True)
        try:
            raw = json.loads((self.root / "config.json").read_text())
            for k, v in raw.items():
                out.update(v if isinstance(v, dict) else {k: v})
        except Exception:
            pass
        return out

    @cached_property
    def manifest(self) -> list[dict[str, Any]]:
        try:
            data = json.loads((self.root / "dataset_manifest.json").read_text())
            return [r for r in data if isinstance(r, dict)]
        except Exception:
            return []

    @cached_property
    def captions(self) -> list[str]:
        return [str(r.get("caption", "")) for r in self.manifest]

    @cached_property
    def checkpoints(self) -> dict[int, Path]:
        """Complete checkpoints by step."""
        root = self.root / "checkpoints"
        out = {}
        if root.is_dir():
            for d in root.iterdir():
                m = re.fullmatch(r"step-(\d+)", d.name)
                if m and (d / "COMPLETE").is_file():
                    out[int(m.group(1))] = d
        return dict(sorted(out.items()))

    @cached_property
    def validation(self) -> dict[int, dict[tuple[str, int], np.ndarray]]:
        """Validation images by step, each keyed by (prompt, seed)."""
        out = {}
        root = self.root / "validation"
        if root.is_dir():
            for d in root.iterdir():
                m = re.fullmatch(r"step-(\d+)", d.name)
                if m and d.is_dir():
                    images = _read_images(d)
                    if images:
                        out[int(m.group(1))] = {k: v for k, (_, v) in images.items()}
        return dict(sorted(out.items()))

    @cached_property
    def base_images(self) -> dict[tuple[str, int], np.ndarray]:
        """The base model's own images (adapter scale 0), where `draw_checkpoint` drew them."""
        out: dict[tuple[str, int], np.ndarray] = {}
        root = self.root / "validation"
        if root.is_dir():
            for d in sorted(root.glob("*-scales")):
                for key, (scale, img) in _read_images(d, with_scale=True).items():
                    if scale == 0:
                        out[key[:2]] = img
        return out

    def reference(self) -> tuple[str, dict[tuple[str, int], np.ndarray]] | None:
        """What later images are compared against: the base model's images, else the first grid."""
        if self.base_images:
            return "the base model (adapter scale 0)", self.base_images
        if len(self.validation) >= 2:
            step, images = next(iter(self.validation.items()))
            return f"the first validation grid (step {step}), standing in for the base", images
        return None

    @cached_property
    def expected_lr(self) -> dict[int, float] | None:
        """The configured schedule's learning rate at each logged step (one process)."""
        import torch

        from kit.optim import make_scheduler

        if self.config is None or not self.rows:
            return None
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=self.config.train.learning_rate)
        try:
            sched = make_scheduler(opt, self.config.train)
        except Exception:
            return None
        logged, out = {r["step"] for r in self.rows}, {}
        for s in range(1, max(logged) + 1):
            opt.step()
            sched.step()
            if s in logged:
                out[s] = sched.get_last_lr()[0]
        return out

    @cached_property
    def triggers(self) -> list[str]:
        return [t for t in self.flat.get("trigger_words") or [] if t]


def _read_images(folder: Path, with_scale: bool = False) -> dict[tuple, tuple[float, np.ndarray]]:
    """A validation folder's images (not its grid), small, in [0, 1], keyed by prompt and seed."""
    from PIL import Image

    out: dict[tuple, tuple[float, np.ndarray]] = {}
    for png in sorted(folder.glob("*.png")):
        if png.name == "grid.png":
            continue
        try:
            meta = json.loads(png.with_suffix(".json").read_text())
            key: tuple = (str(meta["prompt"]), int(meta["seed"]))
            scale = float(meta.get("adapter_scale", 1.0))
        except Exception:
            key, scale = (png.stem, 0), 1.0
        if with_scale:
            key = (*key, scale)
        try:
            with Image.open(png) as im:
                im = im.convert("RGB").resize((THUMB, THUMB), Image.Resampling.BILINEAR)
                out[key] = (scale, np.asarray(im, dtype=np.float32) / 255.0)
        except Exception:
            continue
    return out


def _diff(a: dict, b: dict, keys: list | None = None) -> float | None:
    """Mean absolute pixel difference over the images both hold (None when they share none)."""
    common = [k for k in (keys if keys is not None else a) if k in a and k in b]
    if not common:
        return None
    return float(np.mean([np.abs(a[k] - b[k]).mean() for k in common]))


def _fmt_steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps[:8]) + (" …" if len(steps) > 8 else "")


# ---------------------------------------------------------------- the checks

Check = Callable[[_Run], Iterator[Finding]]
CHECKS: list[Check] = []


def _check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


_GUARD = re.compile(r"(loss|gradient norm) became (\S+) at step (\d+)")


@_check
def nonfinite_loss(run: _Run) -> Iterator[Finding]:
    """A NaN or infinite loss, from the log or from the error that stopped training."""
    precision = run.flat.get("mixed_precision", "no")
    bad = [
        r for r in run.rows if any(k in r and not _finite(r[k]) for k in ("loss", "stable_loss"))
    ]
    evidence = []
    m = _GUARD.search(run.error or "")
    if m:
        evidence.append(f"training stopped: {m.group(1)} became {m.group(2)} at step {m.group(3)}")
    if bad:
        evidence.append(
            f"{len(bad)} logged step(s) with a non-finite loss, first at step {bad[0]['step']} "
            f"(loss {bad[0].get('loss')})"
        )
    scales = [(r["step"], r["loss_scale"]) for r in run.rows if _finite(r.get("loss_scale"))]
    overflows = [
        r["step"]
        for r in run.rows
        if "grad_norm" in r and r["grad_norm"] is not None and not _finite(r["grad_norm"])
    ]
    if evidence or (scales and len(overflows) > max(3, 0.05 * len(run.rows))):
        state = f"mixed_precision={precision}"
        if scales:
            low = min(scales, key=lambda s: s[1])
            state += (
                f"; gradient scaler {scales[0][1]:g} at step {scales[0][0]} → "
                f"{scales[-1][1]:g} at step {scales[-1][0]} (lowest {low[1]:g} at step {low[0]})"
            )
        elif precision == "fp16":
            state += "; no loss scale logged"
        evidence.append(state)
        if overflows:
            evidence.append(
                f"{len(overflows)} step(s) overflowed (gradient norm inf/NaN): steps {_fmt_steps(overflows)}"
            )
        if run.checkpoints:
            evidence.append(f"last good checkpoint: {list(run.checkpoints.values())[-1]}")
        real_nan = bool(m or bad)
        yield Finding(
            "nonfinite_loss",
            "error" if real_nan else "warning",
            "the loss became NaN or infinite" if real_nan else "fp16 gradients keep overflowing",
            evidence,
            "lower learning_rate (÷3–10), keep max_grad_norm at 1.0, train in bf16 instead of fp16 "
            "(or fp32), check the data for broken images; resume from the last good checkpoint",
        )


@_check
def run_stopped(run: _Run) -> Iterator[Finding]:
    """The log ends before max_train_steps: a crash, an interruption, or a run still going."""
    if not run.rows:
        if (run.root / "config.json").is_file():
            yield Finding(
                "no_metrics",
                "info",
                "no training step has been logged yet",
                [f"{run.root / 'logs/metrics.jsonl'} is missing or empty"],
                "wait for the run to start, or look at its console output for an early error",
            )
        return
    last, target = run.rows[-1]["step"], int(run.flat.get("max_train_steps") or 0)
    if target and last < target:
        ck = list(run.checkpoints)
        evidence = [f"metrics end at step {last} of {target}"]
        evidence.append(f"newest checkpoint: step {ck[-1]}" if ck else "no complete checkpoint")
        if run.error:
            evidence.append(f"error: {run.error[:300]}")
        yield Finding(
            "run_stopped",
            "warning",
            f"the run stopped at step {last} of {target} (or is still running)",
            evidence,
            "read the error above; then `kit train CONFIG --resume latest` continues from the "
            "newest checkpoint",
        )


def _data_check(run: _Run) -> list[str]:
    """Were captions and images really read? One line per fact, problems first."""
    from PIL import Image

    man = run.manifest
    if not man:
        return ["no dataset_manifest.json: cannot check what was trained on"]
    out = []
    caps = run.captions
    empty = sum(not c.strip() for c in caps)
    hashes = len({r.get("sha256") for r in man})
    flat_images = []
    for r in man[:4]:
        try:
            with Image.open(r["image"]) as im:
                if float(np.asarray(im.convert("L"), dtype=np.float32).std()) < 2.0:
                    flat_images.append(Path(r["image"]).name)
        except Exception:
            flat_images.append(f"{Path(str(r.get('image'))).name} (unreadable)")
    if empty:
        out.append(f"PROBLEM: {empty} of {len(caps)} captions are empty")
    if hashes < len(man):
        out.append(f"PROBLEM: {len(man)} samples but only {hashes} distinct image file(s)")
    if flat_images:
        out.append(f"PROBLEM: flat (single-colour) or unreadable images: {', '.join(flat_images)}")
    out.append(
        f"data read: {len(man)} images ({hashes} distinct files), "
        f"{len(set(caps))} distinct captions, {empty} empty"
    )
    return out


@_check
def loss_trend(run: _Run) -> Iterator[Finding]:
    """Stable loss (fixed noise) flat or rising; raw loss only for long runs, as it is noisy."""
    stable = [(r["step"], r["stable_loss"]) for r in run.rows if _finite(r.get("stable_loss"))]
    lrs = [r["lr"] for r in run.rows if _finite(r.get("lr"))]
    grads = [r["grad_norm"] for r in run.rows if _finite(r.get("grad_norm"))]
    context = []
    if lrs:
        context.append(f"learning rate peaked at {max(lrs):.3g}")
    if grads and max(grads) == 0:
        context.append("every logged gradient norm is 0: nothing receives a gradient")
    if len(stable) >= 3:
        (s0, first), (s1, last) = stable[0], stable[-1]
        change = (last - first) / abs(first) if first else 0.0
        span = f"stable loss {first:.5g} at step {s0} → {last:.5g} at step {s1} ({change:+.3%})"
        if abs(change) < STABLE_FLAT or (s1 >= 100 and -0.01 < change <= 0.25):
            yield Finding(
                "loss_not_falling",
                "warning",
                "the loss is not falling",
                [span, *context, *_data_check(run)],
                "raise learning_rate (LoRA: 1e-4 to 5e-4), check that the network trains "
                "(`kit network CONFIG`) and that captions and images are what you expect",
            )
        elif change > 0.25:
            yield Finding(
                "loss_rising",
                "warning",
                "the loss is rising",
                [span, *context],
                "lower learning_rate (÷3–10) or add warm-up (lr_warmup_steps ≈ 5% of the steps)",
            )
        return
    loss = [r["loss"] for r in run.rows if _finite(r.get("loss"))]
    if len(loss) >= 50:
        k = len(loss) // 5
        head, tail = statistics.fmean(loss[:k]), statistics.fmean(loss[-k:])
        span = f"mean loss of the first {k} logged steps {head:.4g} → last {k} {tail:.4g}"
        if tail > 1.5 * head:
            yield Finding(
                "loss_rising",
                "warning",
                "the loss is rising",
                [span, *context],
                "lower learning_rate (÷3–10) or add warm-up",
            )
        elif tail >= head:
            yield Finding(
                "loss_not_falling",
                "info",
                "the raw loss is not falling (it is noisy by nature)",
                [span, *context, *_data_check(run)],
                "set stable_loss_steps to log a loss on fixed noise, which shows learning clearly",
            )


def _resumes(run: _Run) -> list[int]:
    """Indices of rows that start a new process: the logged time starts again, or the learning
    rate leaves the configured schedule right after a checkpoint."""
    rows = run.rows
    return [
        i
        for i in range(1, len(rows))
        if _finite(rows[i].get("time"))
        and _finite(rows[i - 1].get("time"))
        and rows[i]["time"] < rows[i - 1]["time"]
        or rows[i - 1]["step"] in run.checkpoints
        and _lr_off_schedule(run, rows[i - 1], rows[i])
    ]


def _checkpoint_state(path: Path, step: int) -> list[str]:
    """What a checkpoint lacks for an exact resume."""
    import torch

    from kit.run.checkpoint import SHARDED_DIR

    out = []
    # Under DeepSpeed the optimizer state is in the engine's own folder, one file per process.
    sharded = (path / SHARDED_DIR).is_dir()
    missing = [
        n
        for n in ("optimizer.pt", "scheduler.pt", "rng.pt", "progress.json")
        if not (path / n).is_file() and not (sharded and n == "optimizer.pt")
    ]
    if missing:
        out.append(f"{path.name} lacks {', '.join(missing)}")
    opt = path / "optimizer.pt"
    if opt.is_file() and opt.stat().st_size < _CKPT_LOAD_LIMIT and step > 0:
        state = torch.load(opt, map_location="cpu", weights_only=True)
        if not state.get("state"):
            out.append(f"{path.name}/optimizer.pt holds no optimizer moments (state is empty)")
    sch = path / "scheduler.pt"
    if sch.is_file():
        state = torch.load(sch, map_location="cpu", weights_only=True)
        if isinstance(state.get("last_epoch"), int) and state["last_epoch"] < step:
            out.append(
                f"{path.name}/scheduler.pt is at position {state['last_epoch']}, "
                f"the checkpoint at step {step}"
            )
    return out


def _lr_off_schedule(run: _Run, before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The learning rate after a resume against the configured schedule, where it matched before."""
    want = run.expected_lr
    lr0, lr1, s0, s1 = before.get("lr"), after.get("lr"), before["step"], after["step"]
    if not want or not (_finite(lr0) and _finite(lr1)) or s0 not in want or s1 not in want:
        return None
    peak = run.flat.get("learning_rate") or 1.0

    def off(lr: float, expected: float) -> float:
        return abs(lr - expected) / max(abs(expected), 1e-3 * peak)

    if off(lr0, want[s0]) <= 0.01 and off(lr1, want[s1]) > 0.05:
        return (
            f"learning rate {lr1:.3g} at step {s1}; the schedule gives {want[s1]:.3g} there "
            f"(it matched at step {s0}: {lr0:.3g}), so the scheduler state was not restored"
        )
    return None


@_check
def resume_jump(run: _Run) -> Iterator[Finding]:
    """A jump in learning rate, loss scale or loss right after a resume: state not restored."""
    rows = run.rows
    init_scale = run.flat.get("grad_scaler_init_scale", 65536.0)
    for i in _resumes(run):
        before, after = rows[max(0, i - 10) : i], rows[i : i + 5]
        at = rows[i - 1]["step"]
        hard, soft = [], []
        lr_note = _lr_off_schedule(run, rows[i - 1], rows[i])
        if lr_note:
            hard.append(lr_note)
        s0, s1 = rows[i - 1].get("loss_scale"), rows[i].get("loss_scale")
        if _finite(s0) and _finite(s1) and s1 == init_scale and s0 != init_scale:
            hard.append(
                f"loss scale {s0:g} at step {at} → {s1:g} (the initial scale) after the resume"
            )
        b = [r["loss"] for r in before if _finite(r.get("loss"))]
        a = [r["loss"] for r in after if _finite(r.get("loss"))]
        if len(b) >= 3 and a:
            mb, ma = statistics.fmean(b), statistics.fmean(a)
            sd = statistics.pstdev(b)
            if ma > mb + max(3 * sd / math.sqrt(len(a)), 0.25 * abs(mb)):
                soft.append(
                    f"loss {mb:.4g} (mean of {len(b)} steps before) → {ma:.4g} "
                    f"(mean of {len(a)} steps after)"
                )
        st = [r for r in rows[max(0, i - 10) : i + 5] if _finite(r.get("stable_loss"))]
        sb = [r for r in st if r["step"] <= at]
        sa = [r for r in st if r["step"] > at]
        if sb and sa and sa[0]["stable_loss"] > 1.1 * sb[-1]["stable_loss"]:
            soft.append(
                f"stable loss {sb[-1]['stable_loss']:.5g} at step {sb[-1]['step']} → "
                f"{sa[0]['stable_loss']:.5g} at step {sa[0]['step']}"
            )
        if not (hard or soft):
            continue
        ck = run.checkpoints.get(at)
        if ck is not None:
            hard += _checkpoint_state(ck, at)
        yield Finding(
            "resume_jump",
            "error" if hard else "warning",
            f"training jumped right after the resume at step {at}: state not fully restored",
            [f"resumed from {ck or f'step {at}'}", *hard, *soft],
            "resume from a complete checkpoint (optimizer, scheduler, RNG and scaler state); "
            "if one was edited or copied without its .pt files, resume from the one before",
        )


_MEMORY_KEYS = ("memory_gib", "memory_allocated_gib", "gpu_memory_gib", "memory_allocated")


@_check
def memory_rising(run: _Run) -> Iterator[Finding]:
    """GPU memory that keeps growing across steps: a leak (logged only on a GPU)."""
    key = next((k for k in _MEMORY_KEYS if any(_finite(r.get(k)) for r in run.rows)), None)
    if key is None:
        return
    pts = [(r["step"], float(r[key])) for r in run.rows if _finite(r.get(key))]
    pts = pts[len(pts) // 10 :]  # the first tenth fills caches and optimizer state
    if len(pts) < 5:
        return
    (s0, m0), (s1, m1) = pts[0], pts[-1]
    if m1 > m0 * (1 + MEMORY_RISE) and all(
        b[1] >= a[1] - 1e-9 for a, b in itertools.pairwise(pts[-5:])
    ):
        per100 = (m1 - m0) / max(1, s1 - s0) * 100
        yield Finding(
            "memory_rising",
            "warning",
            "GPU memory keeps rising across steps",
            [f"{key} {m0:.3g} at step {s0} → {m1:.3g} at step {s1} ({per100:+.3g} per 100 steps)"],
            "something keeps tensors from earlier steps (a loss stored without .item(), a growing "
            "list of outputs); an out-of-memory error will follow if it goes on",
        )


@_check
def small_buckets(run: _Run) -> Iterator[Finding]:
    """Buckets smaller than a batch: their few images train alone, with outsized weight."""
    batch = int(run.flat.get("train_batch_size") or 1)
    counts = Counter(tuple(r["bucket"]) for r in run.manifest if "bucket" in r)
    if batch < 2 or not counts:
        return
    micro = sum(math.ceil(n / batch) for n in counts.values())
    steps = run.rows[-1]["step"] if run.rows else int(run.flat.get("max_train_steps") or 0)
    accum = int(run.flat.get("gradient_accumulation_steps") or 1)
    epochs = steps * accum / micro if micro else 0
    small = sorted((n, b) for b, n in counts.items() if n < batch)
    if not small:
        return
    evidence = [
        f"bucket {b[0]}x{b[1]} holds {n} image(s) with train_batch_size {batch}: each epoch it "
        f"makes a batch of {n}, so its images weigh {batch / n:.1f}× an image in a full batch "
        f"(about {epochs:.0f} epochs in this run)"
        for n, b in small[:5]
    ]
    worst = batch / small[0][0]
    yield Finding(
        "small_buckets",
        "warning" if worst >= SMALL_BUCKET_WEIGHT else "info",
        f"{len(small)} bucket(s) hold fewer images than a batch",
        evidence,
        "crop or remove the odd-shaped images, lower max_aspect_ratio or raise bucket_step so "
        "they join a larger bucket, or lower train_batch_size and raise "
        "gradient_accumulation_steps",
    )


@_check
def captions_truncated(run: _Run) -> Iterator[Finding]:
    """Captions longer than a text encoder reads: their ends are cut off silently."""
    if run.config is None or not run.captions:
        return
    from kit.families import get_family

    cfg = run.config
    family = get_family(cfg.model.model_family, cfg)
    tokenizers = _tokenizers(family, cfg.model.pretrained_model)
    if tokenizers is None:
        return  # the base model is not reachable here
    for name, tok in tokenizers.items():
        limit = family.token_limit(name, tok)
        over = [(len(tok(c).input_ids), r) for c, r in zip(run.captions, run.manifest, strict=True)]
        over = [(n, r) for n, r in over if n > limit]
        if over:
            n, r = max(over, key=lambda x: x[0])
            yield Finding(
                "captions_truncated",
                "warning",
                f"{len(over)} caption(s) are cut off by the {name} tokenizer",
                [
                    f"{len(over)} of {len(run.captions)} captions exceed {limit} tokens",
                    f"longest: {n} tokens ({n - limit} cut off), {Path(str(r.get('image'))).name}",
                ],
                "shorten those captions (put the trigger word and key facts first); what is cut "
                "off is never seen by the model",
            )


_TOKENIZERS: dict[tuple[str, str], Any] = {}


def _tokenizers(family: Any, pretrained: str) -> dict[str, Any] | None:
    """The family's tokenizers, loaded once per process (None when unreachable)."""
    key = (family.name, pretrained)
    if key not in _TOKENIZERS:
        try:
            _TOKENIZERS[key] = family.load_tokenizers(pretrained)
        except Exception:
            _TOKENIZERS[key] = None
    return _TOKENIZERS[key]


@_check
def captions_identical(run: _Run) -> Iterator[Finding]:
    """Most captions the same: the model cannot tell what varies from what to learn."""
    caps = run.captions
    if len(caps) < 4:
        return
    text, n = Counter(caps).most_common(1)[0]
    if n / len(caps) >= 0.5:
        yield Finding(
            "captions_identical",
            "warning",
            f"{n} of {len(caps)} captions are identical",
            [f"'{text[:80]}' appears {n} times; {len(set(caps))} distinct captions in all"],
            "caption what differs between images (pose, background, lighting, clothes), so the "
            "trigger word takes only what stays the same",
        )


def _has_word(caption: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word.lower())}(?!\w)", caption.lower()) is not None


@_check
def trigger_missing(run: _Run) -> Iterator[Finding]:
    """Trigger words absent from many captions."""
    from kit.data.scan import is_prior_image

    patterns = run.flat.get("prior_images") or []
    image_dir = run.flat.get("image_dir") or ""
    rows = [
        (c, r)
        for c, r in zip(run.captions, run.manifest, strict=True)
        if not is_prior_image(str(r.get("image")), patterns, image_dir)
    ]
    if not rows:
        return
    for word in run.triggers:
        missing = [r for c, r in rows if not _has_word(c, word)]
        if missing:
            share = len(missing) / len(rows)
            yield Finding(
                "trigger_missing",
                "warning" if share > 0.2 else "info",
                f"the trigger word '{word}' is missing from {len(missing)} of {len(rows)} captions",
                [f"e.g. {', '.join(Path(str(r.get('image'))).name for r in missing[:3])}"],
                f"add '{word}' to those captions (kit captions CONFIG lists them), or remove it "
                "from trigger_words",
            )


@_check
def memorization(run: _Run) -> Iterator[Finding]:
    """Training (stable) loss falling while held-out loss rises: memorizing the images."""
    pts = [
        (r["step"], r["stable_loss"], r["validation_loss"])
        for r in run.rows
        if _finite(r.get("stable_loss")) and _finite(r.get("validation_loss"))
    ]
    if len(pts) < 3:
        return
    best = min(pts, key=lambda p: p[2])
    first, last = pts[0], pts[-1]
    if last[1] < first[1] and last[2] > best[2] * 1.05 and last[0] > best[0]:
        yield Finding(
            "memorization",
            "warning",
            f"held-out loss rises since step {best[0]} while the training loss falls",
            [
                f"stable (training) loss {first[1]:.5g} at step {first[0]} → {last[1]:.5g} at step {last[0]}",
                f"validation loss lowest {best[2]:.5g} at step {best[0]} → {last[2]:.5g} at step {last[0]}",
            ],
            f"use the checkpoint nearest step {best[0]}; train fewer steps, a lower rank or "
            "learning rate, or add images",
        )


@_check
def validation_stalled(run: _Run) -> Iterator[Finding]:
    """Validation images that stopped changing between grids: the steps after are wasted."""
    steps = list(run.validation)
    if len(steps) < 3:
        return
    imgs = list(run.validation.values())
    diffs = [_diff(a, b) for a, b in itertools.pairwise(imgs)]
    if any(d is None for d in diffs):
        return
    total = _diff(imgs[0], imgs[-1]) or 0.0
    if total < STALLED_TOTAL and max(diffs) < STALLED_TOTAL:
        yield Finding(
            "nothing_learned",
            "warning",
            "the validation images barely change from step to step: nothing is being learned",
            [
                f"mean pixel change {total:.5f} from step {steps[0]} to step {steps[-1]} "
                f"(grids at steps {_fmt_steps(steps)})",
                *(
                    [
                        f"learning rate peaked at {max(r['lr'] for r in run.rows if _finite(r.get('lr'))):.3g}"
                    ]
                    if any(_finite(r.get("lr")) for r in run.rows)
                    else []
                ),
            ],
            "raise learning_rate; check that the adapter trains and is applied when sampling",
        )
        return
    biggest = max(diffs)
    tail = 0
    for d in reversed(diffs):
        if d >= PLATEAU_SHARE * biggest:
            break
        tail += 1
    if tail >= 2:
        since = steps[-tail - 1]
        wasted = steps[-1] - since
        yield Finding(
            "validation_stalled",
            "warning" if wasted >= 0.25 * steps[-1] else "info",
            f"the validation images stopped changing after step {since}",
            [
                "change between grids: "
                + ", ".join(
                    f"{a}→{b}: {d:.4f}" for a, b, d in zip(steps, steps[1:], diffs, strict=False)
                )
            ]
            + [
                f"the last {wasted} steps changed them by less than {PLATEAU_SHARE:.0%} of the largest change"
            ],
            f"stop earlier (max_train_steps ≈ {since}) and use the checkpoint at step {since}; "
            "or raise learning_rate if the images never looked right",
        )


def _diversity(images: dict[tuple[str, int], np.ndarray]) -> float | None:
    """Mean difference between different prompts' images of the same seed."""
    by_seed: dict[int, list[np.ndarray]] = {}
    for (_prompt, seed), img in images.items():
        by_seed.setdefault(seed, []).append(img)
    d = [
        np.abs(a - b).mean()
        for imgs in by_seed.values()
        for a, b in itertools.combinations(imgs, 2)
    ]
    return float(np.mean(d)) if d else None


@_check
def collapse(run: _Run) -> Iterator[Finding]:
    """Every prompt drawing the same picture: overfit to the training images."""
    ref = run.reference()
    if ref is None or not run.validation:
        return
    what, base = ref
    step, last = list(run.validation.items())[-1]
    d0, d1 = _diversity(base), _diversity(last)
    if d0 and d1 is not None and d0 > 0.02 and d1 < COLLAPSE_SHARE * d0:
        yield Finding(
            "collapse",
            "warning",
            "different prompts now draw nearly the same image (overfit)",
            [f"difference between prompts' images: {d0:.4f} in {what} → {d1:.4f} at step {step}"],
            "use an earlier checkpoint; lower learning_rate, rank or steps; caption what varies",
        )


def _tone(images: dict[Any, np.ndarray]) -> tuple[float, float]:
    """Mean contrast (luminance std) and saturation ((max-min)/max) of images."""
    c, s = [], []
    for img in images.values():
        lum = img @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        c.append(float(lum.std()))
        hi, lo = img.max(axis=2), img.min(axis=2)
        s.append(float(np.mean((hi - lo) / np.maximum(hi, 1e-3))))
    return float(np.mean(c)), float(np.mean(s))


@_check
def washed_out(run: _Run) -> Iterator[Finding]:
    """Validation images losing contrast or saturation against the base: grey results."""
    if not run.validation:
        return
    step, last = list(run.validation.items())[-1]
    c1, s1 = _tone(last)
    fix = (
        "fp16 overflow in the VAE or a learning rate too high: train in bf16 (or fp32), "
        "lower learning_rate, and use an earlier checkpoint"
    )
    if c1 < FLAT_CONTRAST:
        yield Finding(
            "grey_images",
            "error",
            f"the validation images at step {step} are flat grey",
            [f"contrast (luminance std) {c1:.4f}"],
            fix,
        )
        return
    ref = run.reference()
    if ref is None:
        return
    what, base = ref
    c0, s0 = _tone(base)
    lost = []
    if c0 > 0 and c1 < WASHED_SHARE * c0:
        lost.append(f"contrast {c0:.3f} in {what} → {c1:.3f} at step {step} ({c1 / c0:.0%})")
    if s0 > 0.05 and s1 < WASHED_SHARE * s0:
        lost.append(f"saturation {s0:.3f} in {what} → {s1:.3f} at step {step} ({s1 / s0:.0%})")
    if lost:
        yield Finding("washed_out", "warning", "the validation images are washing out", lost, fix)


@_check
def prior_drift(run: _Run) -> Iterator[Finding]:
    """Prompts without the trigger word drifting from the base: the prior is being overwritten."""
    ref = run.reference()
    if ref is None or not run.triggers or not run.validation:
        return
    what, base = ref
    step, last = list(run.validation.items())[-1]
    captions = set(run.captions)
    keys = [k for k in last if k in base]
    unrelated = [
        k
        for k in keys
        if k[0] not in captions and not any(_has_word(k[0], t) for t in run.triggers)
    ]
    trigger = [k for k in keys if any(_has_word(k[0], t) for t in run.triggers)]
    if not unrelated or not trigger:
        return
    du, dt = _diff(base, last, unrelated), _diff(base, last, trigger)
    if du is not None and dt and du > PRIOR_DRIFT and du > PRIOR_SHARE * dt:
        yield Finding(
            "prior_drift",
            "warning",
            "prompts without the trigger word drift from the base: the prior is being overwritten",
            [
                f"unrelated prompts moved {du:.4f} from {what} by step {step}; trigger prompts {dt:.4f}",
                f"unrelated prompts: {', '.join(repr(k[0]) for k in unrelated[:3])}",
            ],
            "lower learning_rate or rank, train fewer steps, caption with a rare trigger word, "
            "or add regularisation images of the class",
        )


# ---------------------------------------------------------------- entry points


def diagnose(run_dir: str | Path, error: str | None = None) -> list[Finding]:
    """Every finding for the run folder, most serious first; never raises.

    `error` is the message that stopped training, if any; without it, the one `write_report`
    stored in an earlier `doctor.json` is used while the log has not moved past it.
    """
    root = Path(run_dir)
    if error is None:
        error = _stored_error(root)
    run = _Run(root, error)
    findings: list[Finding] = []
    if not (root / "config.json").is_file():
        findings.append(
            Finding(
                "not_a_run",
                "info",
                f"{root} has no config.json yet",
                ["checks that need the config use the defaults"],
                "point the doctor at the output_dir of a run",
            )
        )
    for check in CHECKS:
        try:
            findings += list(check(run))
        except Exception as e:  # a half-written run must not break the report
            findings.append(
                Finding(
                    "check_failed",
                    "info",
                    f"the {check.__name__} check could not run",
                    [f"{type(e).__name__}: {e}"],
                    "",
                )
            )
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def _stored_error(root: Path) -> str | None:
    try:
        old = json.loads((root / REPORT_FILE).read_text())
        err, at = old.get("error"), old.get("step")
        from kit.run.folder import RunDir

        rows = RunDir(root).read_metrics()
        last = rows[-1].get("step") if rows else 0
        return err if err and (at is None or last <= at) else None
    except Exception:
        return None


def write_report(run_dir: str | Path, error: BaseException | str | None = None) -> Path | None:
    """Diagnose the run and write `doctor.json` in its folder; never raises (None on failure)."""
    try:
        root = Path(run_dir)
        text = None if error is None else str(error) or type(error).__name__
        findings = diagnose(root, text)
        from kit.io import write_json
        from kit.run.folder import RunDir

        rows_ = RunDir(root).read_metrics()
        path = root / REPORT_FILE
        write_json(
            path,
            {
                "step": rows_[-1].get("step") if rows_ else 0,
                "error": text,
                "counts": {s: sum(f.severity == s for f in findings) for s in SEVERITIES},
                "findings": [f.to_dict() for f in findings],
            },
        )
        return path
    except Exception:
        return None
