"""One micro-step: a batch, its loss, the backward pass and (when accumulation is done) the update."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from kit.errors import KitError
from kit.train.objective import denoising_loss, drop_captions
from kit.train.state import TrainState


def batch_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A random stream of its own for one batch; also seeds the global RNG (dropout layers)."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{index}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    torch.manual_seed(value)
    return torch.Generator().manual_seed(value)


def micro_step(s: TrainState, indices: list[int], index: int) -> tuple[float, float | None]:
    """Train on batch `index` of this epoch (its sample `indices`): the loss, averaged over the
    processes, and the gradient norm when this micro-step ended an optimizer step."""
    t, acc = s.cfg.train, s.accelerator
    # Noise, timesteps, dropout, caption variants and caption dropout come from this batch's
    # own stream: the same numbers whichever process draws it, before or after a resume.
    s.generator = generator = batch_generator(t.seed, s.epoch, index)
    variants = s.data.draw_variants(len(indices), generator)
    batch = s.data.load_batch(indices, variants)
    dropped = drop_captions(batch, s.empty_text, s.cfg.objective.caption_dropout, generator)
    with acc.accumulate(*s.trained):
        # The frozen parts are in the half dtype and the trained ones fp32: autocast picks each
        # operation's dtype, for the live text encoders and a denoiser accelerate did not wrap.
        with acc.autocast():
            if s.method.live_text:
                captions = [
                    "" if d else s.data.variant_texts[i][variants[j] if variants else 0]
                    for j, (i, d) in enumerate(zip(indices, dropped, strict=True))
                ]
                batch.update(s.family.encode_text(s.comps, captions))
            loss = denoising_loss(s.family, s.comps, batch, generator, s.device)
        acc.backward(loss)
        grad_norm = None
        if acc.sync_gradients:
            s.method.before_clip(s.comps)
            clip = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
            norm = acc.clip_grad_norm_(s.params, clip)
            # DeepSpeed clips inside its own step and may report no norm here.
            grad_norm = None if norm is None else float(norm)
        # Inside `accumulate` these only act on the micro-step that ends an accumulation.
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
    return float(acc.reduce(loss.detach().float(), "mean")), grad_norm


def guard_finite(
    loss: float,
    grad_norm: float | None,
    step: int,
    precision: str,
    scale: float | None,
    last_good: Path | None,
) -> None:
    """Stop on a non-finite loss (or, without a gradient scaler, a non-finite gradient)."""
    bad_grad = grad_norm is not None and not math.isfinite(grad_norm) and scale is None
    if math.isfinite(loss) and not bad_grad:
        return
    what = f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
    scale_note = f", loss scale {scale:g}" if scale is not None else ""
    keep = (
        f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
    )
    raise KitError(
        f"{what} at step {step} (mixed_precision={precision}{scale_note}); {keep}. "
        f"Usual fixes: a lower learning_rate, max_grad_norm 1.0, {_precision_fix(precision)}"
        "or checking the data for broken images."
    )


def _precision_fix(precision: str) -> str:
    """The precision to try instead of fp16, on this machine ('' when not in fp16)."""
    if precision != "fp16":
        return ""
    # bf16 has fp32's range, but only a GPU that has it can train in it.
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16 instead of fp16, "
    return "fp32 (mixed_precision no) instead of fp16, "
