"""Optimizers and learning-rate schedules, from the libraries that implement them."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from typing import Any

import torch

from kit.config import TrainConfig
from kit.errors import ConfigError


def make_optimizer(params: list[Any], t: TrainConfig) -> torch.optim.Optimizer:
    """The configured optimizer over `params`: parameters, or groups (dicts with `params` and
    optionally their own `lr`)."""
    betas = (t.adam_beta1, t.adam_beta2)
    # AdamW and its 8-bit twin take the same settings.
    adam = {
        "lr": t.learning_rate,
        "betas": betas,
        "weight_decay": t.adam_weight_decay,
        "eps": t.adam_epsilon,
    }
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, **adam, **adamw_kernel(params))
    if t.optimizer == "adamw8bit":
        if not torch.cuda.is_available():
            raise ConfigError("optimizer adamw8bit needs a CUDA GPU (bitsandbytes); use adamw here")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(
                "optimizer adamw8bit needs bitsandbytes: pip install bitsandbytes"
            ) from None
        return bnb.optim.AdamW8bit(params, **adam)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed learning rate, so the schedule and warm-up apply as configured.
        return Adafactor(
            params,
            lr=t.learning_rate,
            relative_step=False,
            scale_parameter=False,
            warmup_init=False,
            weight_decay=t.adam_weight_decay,
        )
    if t.optimizer in PACKAGES:
        _require(t.optimizer)  # one line naming what to install, not an ImportError
    if t.optimizer == "prodigy":
        from prodigyopt import Prodigy

        # Prodigy estimates the step size itself; learning_rate is a multiplier (1.0 is usual).
        return Prodigy(params, lr=t.learning_rate, betas=betas, weight_decay=t.adam_weight_decay)
    if t.optimizer == "lion":
        from lion_pytorch import Lion

        # The sign of the update: every weight moves by the learning rate, so Lion wants one
        # 3-10x below AdamW's. Its betas are its paper's (0.9, 0.99), not Adam's.
        return Lion(params, lr=t.learning_rate, weight_decay=t.adam_weight_decay)
    if t.optimizer == "came":
        from came_pytorch import CAME

        # Factored second moments (as Adafactor) and a factored confidence term; its own betas
        # and epsilons, from its paper.
        return CAME(params, lr=t.learning_rate, weight_decay=t.adam_weight_decay)
    if t.optimizer == "schedulefree":
        from schedulefree import AdamWScheduleFree

        # No schedule: the optimizer averages its iterates instead, and warms up itself.
        optimizer = AdamWScheduleFree(
            params,
            lr=t.learning_rate,
            betas=betas,
            eps=t.adam_epsilon,
            weight_decay=t.adam_weight_decay,
            warmup_steps=t.lr_warmup_steps,
        )
        optimizer.train()  # it refuses to step in eval mode, and is created in it
        return optimizer
    raise ConfigError(f"optimizer: unknown '{t.optimizer}'")


PACKAGES = {
    "prodigy": ("prodigyopt", "prodigyopt"),
    "lion": ("lion_pytorch", "lion-pytorch"),
    "came": ("came_pytorch", "came-pytorch"),
    "schedulefree": ("schedulefree", "schedulefree"),
}
"""Optimizers from optional packages: name → (module, what to pip install)."""


def _require(optimizer: str) -> None:
    module, package = PACKAGES[optimizer]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"optimizer {optimizer} needs {package}: pip install {package}")


def check_optimizer(t: TrainConfig, deepspeed: bool) -> None:
    """Refuse, before anything loads, an optimizer whose package is missing or that cannot run
    under this launch."""
    if t.optimizer in PACKAGES:
        _require(t.optimizer)
    if t.optimizer == "schedulefree" and deepspeed:
        # ZeRO steps the optimizer on its own flat fp32 copies: the averaged weights that
        # `eval()` computes there would never reach the model that is saved.
        raise ConfigError(
            "optimizer schedulefree cannot run under DeepSpeed (its averaged weights would not "
            "reach the saved model); launch without --deepspeed-stage or choose another optimizer"
        )


def _modes(optimizer: Any) -> bool:
    """Whether `optimizer` (or the one accelerate wrapped) has train and eval modes (the
    schedule-free ones: its weights in train mode are not the ones to evaluate or keep)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return callable(getattr(inner, "eval", None)) and callable(getattr(inner, "train", None))


@contextlib.contextmanager
def eval_weights(optimizer: Any, when: bool = True) -> Iterator[None]:
    """Within the block the trained parameters hold the weights to evaluate, average and save:
    a schedule-free optimizer's average (its eval mode), its train-mode weights again after.
    Nothing changes for other optimizers, or when `when` is false.

    Every process switches at the same steps: the round trip rounds in the last bit, so a
    process that skipped it would drift from the others.
    """
    if not (when and _modes(optimizer)):
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def final_weights(optimizer: Any) -> None:
    """Leave the trained parameters on the weights to keep (training is over or stopped)."""
    if _modes(optimizer):
        optimizer.eval()


def train_weights(optimizer: Any) -> None:
    """Put the trained parameters on the weights the next step starts from; for a restored
    schedule-free optimizer (saved in eval mode) those follow from the saved ones."""
    if _modes(optimizer):
        optimizer.train()


FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose fused AdamW kernel the kit uses (one kernel per step over all parameters)."""


def adamw_kernel(params: list[Any]) -> dict[str, bool]:
    """How AdamW updates `params`: `fused` where every one is a float tensor on a device with
    the fused kernel, else `foreach` (one batched update per step) on CUDA, else the default.

    Measured on CPU (384 LoRA-shaped tensors of SD1.5 widths): the fused step is several
    times faster than the per-tensor loop, and it needs no temporaries, unlike `foreach`.
    Fused rounds differently from the loop in the last bit, but it is deterministic: the same
    run gives the same weights, and a resumed run the straight run's.
    """
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors:
        return {}
    devices = {p.device.type for p in tensors}
    if all(p.is_floating_point() for p in tensors) and devices <= set(FUSED_DEVICES):
        return {"fused": True}
    if devices == {"cuda"}:
        return {"foreach": True}
    return {}


def learning_rate(optimizer: Any, scheduler: Any) -> float:
    """The learning rate to log: the schedule's, or a schedule-free optimizer's own warm-up
    (the rate its last step took)."""
    return optimizer.param_groups[0].get("scheduled_lr") or scheduler.get_last_lr()[0]


def make_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig, num_processes: int = 1) -> Any:
    """The configured diffusers learning-rate schedule (accelerate steps it once per process)."""
    from diffusers.optimization import get_scheduler

    if t.lr_scheduler == "piecewise_constant" and not t.lr_step_rules:
        raise ConfigError("lr_scheduler piecewise_constant needs lr_step_rules, e.g. '1:100,0.1'")
    if t.optimizer == "schedulefree":
        # The config accepts only a constant schedule with it; the warm-up is the optimizer's.
        return get_scheduler("constant", optimizer=optimizer)
    try:
        return get_scheduler(
            t.lr_scheduler,
            optimizer=optimizer,
            num_warmup_steps=t.lr_warmup_steps * num_processes,
            num_training_steps=t.max_train_steps * num_processes,
            num_cycles=t.lr_num_cycles,
            power=t.lr_power,
            step_rules=scale_step_rules(t.lr_step_rules, num_processes) or None,
        )
    except ValueError as e:
        raise ConfigError(f"lr_scheduler {t.lr_scheduler}: {e}") from None


def scale_step_rules(rules: str, num_processes: int) -> str:
    """`piecewise_constant` rules with each milestone multiplied by `num_processes`.

    The rules count optimizer steps; accelerate steps the scheduler once per process per
    optimizer step, so the milestones scale as warm-up and total steps do.
    """
    if not rules or num_processes == 1:
        return rules
    *pairs, last = rules.split(",")
    scaled = []
    for pair in pairs:
        multiplier, sep, until = pair.partition(":")
        if not sep or not until.strip().isdigit():
            raise ConfigError(
                f"lr_step_rules: {pair!r} in {rules!r} must be multiplier:step, e.g. '1:100,0.1'"
            )
        scaled.append(f"{multiplier}:{int(until) * num_processes}")
    return ",".join([*scaled, last])


def scale_learning_rate(learning_rate: float, from_batch: int, to_batch: int) -> float:
    """Square-root scaling: the learning rate for an effective batch of `to_batch` samples."""
    if from_batch < 1 or to_batch < 1:
        raise ValueError("batch sizes must be at least 1")
    return learning_rate * math.sqrt(to_batch / from_batch)
