"""The objective's choices: a timestep window for every family and the robust losses.

`min_timestep` / `max_timestep` bound DDPM timesteps and flow-matching σ (σ·1000) under every
σ sampling and shift; `huber` and `smooth_l1` are sd-scripts' pseudo-Huber curves, applied per
element before the per-sample weighting; the defaults leave a run bit for bit as it was.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kit.config import Config, load_config
from kit.errors import ConfigError
from kit.families import NoiseDraw, get_family
from kit.families.noise import ddpm_timestep_range, flow_noise_and_target
from kit.run import checkpoint as ckpt
from kit.train.loop import train
from kit.train.objective import denoising_loss, elementwise_loss
from tests.conftest import write_config, write_run_config

N = 4096  # draws per check: enough to reach both ends of a window


def _family(name: str, **objective):
    return get_family(name, Config().replace(model_family=name, **objective))


# ------------------------------------------------------------------ timestep windows


def test_ddpm_timesteps_are_drawn_uniformly_inside_the_window():
    from diffusers import DDPMScheduler

    comps = SimpleNamespace(noise_scheduler=DDPMScheduler(num_train_timesteps=1000))
    latents = torch.zeros(N, 4, 1, 1)
    family = _family("sd15", min_timestep=200, max_timestep=300)
    t = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0)).timesteps
    assert t.dtype == torch.long
    assert int(t.min()) == 200 and int(t.max()) == 299  # max is exclusive; both ends reached
    assert len(t.unique()) == 100
    # The whole range is the former draw: after the noise, randint over all 1000 steps.
    full = _family("sd15").noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    torch.randn(latents.shape, generator=g)
    assert torch.equal(full.timesteps, torch.randint(0, 1000, (N,), generator=g))


def test_the_window_scales_to_a_scheduler_with_fewer_steps():
    assert ddpm_timestep_range(1000, 0, 1000) == (0, 1000)
    assert ddpm_timestep_range(100, 0, 1000) == (0, 100)
    assert ddpm_timestep_range(100, 250, 500) == (25, 50)
    assert ddpm_timestep_range(100, 995, 1000) == (99, 100)  # never empty
    assert ddpm_timestep_range(100, 0, 1) == (0, 1)


def _flow_comps(**config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return SimpleNamespace(noise_scheduler=FlowMatchEulerDiscreteScheduler(**config))


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal", "mode"])
@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("sd3", {"shift": 3.0}),  # SD3's released scheduler
        ("flux", {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}),  # dev
    ],
)
def test_flow_sigma_lies_in_the_window_for_every_sampling(name, config, sampling):
    """The draw is shifted over [0, 1] and then mapped into [min, max)/1000: the bounds hold
    whatever the shift, and inside them the draw keeps its shifted shape."""
    comps = _flow_comps(**config)
    latents = torch.zeros(N // 2, 1, 64, 64)  # Flux's shift for 1024² images (about 3.2)
    window = _family(name, min_timestep=250, max_timestep=600, timestep_sampling=sampling)
    draw = window.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    sigma = draw.timesteps / 1000
    assert float(sigma.min()) >= 0.25 and float(sigma.max()) <= 0.6
    # On x0 = 0 the noisy latent is σ·ε: the model sees the bounded σ, not only its label.
    torch.testing.assert_close(draw.noisy, sigma.view(-1, 1, 1, 1) * draw.target)
    # The same draw without the window, mapped linearly: the shift acts before the bounds.
    whole = _family(name, timestep_sampling=sampling)
    free = whole.noise_and_target(comps, latents, torch.Generator().manual_seed(0)).timesteps
    assert torch.allclose(sigma, 0.25 + 0.35 * free / 1000, atol=1e-6)
    assert float(free.max()) > 600  # the unbounded draw does leave the window


def test_the_full_window_leaves_the_flow_draw_bit_for_bit():
    latents = torch.randn(64, 4, 2, 2, generator=torch.Generator().manual_seed(3))
    for sampling in ("uniform", "logit_normal", "mode"):
        a = flow_noise_and_target(
            latents, torch.Generator().manual_seed(0), sampling=sampling, shift=3.0
        )
        b = flow_noise_and_target(
            latents,
            torch.Generator().manual_seed(0),
            sampling=sampling,
            shift=3.0,
            min_timestep=0,
            max_timestep=1000,
        )
        assert torch.equal(a.timesteps, b.timesteps) and torch.equal(a.noisy, b.noisy)


# ------------------------------------------------------------------ losses

D = torch.tensor([-3.0, -0.5, -1e-4, 0.0, 2e-3, 0.05, 0.3, 1.0, 10.0])


def _pseudo_huber(d: torch.Tensor, c: float) -> torch.Tensor:
    """sd-scripts' `conditional_loss` "huber" written out, in float64."""
    d = d.double()
    return 2 * c * (torch.sqrt(d**2 + c**2) - c)


@pytest.mark.parametrize("c", [0.01, 0.1, 1.0])
def test_huber_and_smooth_l1_equal_the_hand_formulas(c):
    pred, target = D + 0.25, torch.full_like(D, 0.25)
    huber = elementwise_loss(pred, target, "huber", c)
    smooth = elementwise_loss(pred, target, "smooth_l1", c)
    d = pred.double() - target.double()
    assert huber.dtype == smooth.dtype == torch.float32
    torch.testing.assert_close(huber.double(), _pseudo_huber(d, c), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(smooth.double(), _pseudo_huber(d, c) / c, rtol=1e-5, atol=1e-12)
    # mse is the plain square.
    assert torch.equal(elementwise_loss(pred, target), (pred - target).pow(2))


def test_the_robust_losses_have_their_limits():
    d = torch.tensor([-2.0, -0.7, 0.4, 1.5, 3.0])
    zero = torch.zeros_like(d)
    # c ≫ |d|: Huber is the squared error (the mse scale, so learning rates carry over).
    torch.testing.assert_close(elementwise_loss(d, zero, "huber", 1e3), d**2, rtol=1e-5, atol=0)
    # c ≪ |d|: Huber grows linearly, 2c|d| - 2c²; smooth L1 tends to twice the L1 loss.
    c = 1e-3
    linear = 2 * c * d.abs() - 2 * c * c
    torch.testing.assert_close(elementwise_loss(d, zero, "huber", c), linear, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        elementwise_loss(d, zero, "smooth_l1", 1e-6), 2 * d.abs(), rtol=1e-5, atol=0
    )
    # Small errors keep their digits in fp32 (no cancellation in √(d² + c²) - c).
    tiny = torch.tensor([1e-4, 3e-5])
    torch.testing.assert_close(
        elementwise_loss(tiny, torch.zeros(2), "huber", 0.1), tiny**2, rtol=1e-5, atol=0
    )
    # An outlier pulls with at most 2c: the gradient of Huber is bounded, mse's is not.
    pred = torch.tensor([0.0, 1.0, 100.0], requires_grad=True)
    elementwise_loss(pred, torch.zeros(3), "huber", 0.1).sum().backward()
    assert float(pred.grad.abs().max()) < 0.2 and float(pred.grad[0]) == 0.0


class _Fixed:
    """A family whose draw and prediction are given: the loss alone is under test."""

    def __init__(self, draw: NoiseDraw, pred: torch.Tensor, **objective) -> None:
        self.cfg = Config().replace(**objective)
        self.draw, self.pred = draw, pred

    def noise_and_target(self, comps, latents, generator):
        return self.draw

    def predict(self, comps, noisy, timesteps, cond):
        return self.pred


@pytest.mark.parametrize("loss_type", ["mse", "huber", "smooth_l1"])
def test_the_loss_is_taken_per_element_before_the_per_sample_weight(loss_type):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, 4, 2, 2, generator=g)
    pred = target + torch.randn(3, 4, 2, 2, generator=g) * torch.tensor([0.01, 1.0, 5.0]).view(
        3, 1, 1, 1
    )
    weight = torch.tensor([2.0, 0.5, 1.0])
    draw = NoiseDraw(torch.zeros_like(target), torch.zeros(3), target, weight)
    family = _Fixed(draw, pred, loss_type=loss_type, huber_c=0.2)
    loss = denoising_loss(family, None, {"latents": target}, g, "cpu")
    d = (pred - target).double()
    each = {
        "mse": d**2,
        "huber": _pseudo_huber(d, 0.2),
        "smooth_l1": _pseudo_huber(d, 0.2) / 0.2,
    }[loss_type]
    expected = (each.flatten(1).mean(1) * weight.double()).mean()
    assert math.isclose(float(loss), float(expected), rel_tol=1e-5)


# ------------------------------------------------------------------ training runs


def _adapter(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.checkpoint_dir(run_dir, 2) / ckpt.ADAPTER_FILE))


def _run(tmp_path, name: str, base, data, family: str, **objective) -> dict[str, torch.Tensor]:
    path = write_run_config(
        tmp_path / f"{name}.json",
        base=base,
        data=data,
        family=family,
        output_dir=str(tmp_path / name),
        max_train_steps=2,
        checkpointing_steps=2,
        train_batch_size=1,
        **objective,
    )
    assert train(load_config(path)).step == 2
    rows = (tmp_path / name / "logs/metrics.jsonl").read_text().splitlines()
    assert all(math.isfinite(json.loads(r)["loss"]) for r in rows)
    return _adapter(tmp_path / name)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _trained(adapter: dict[str, torch.Tensor]) -> bool:
    """LoRA's up (B) matrices start at zero: any non-zero one has been trained."""
    ups = [v for k, v in adapter.items() if "lora_B" in k or "lora_up" in k]
    return bool(ups) and any(bool(v.abs().sum() > 0) for v in ups)


@pytest.mark.slow
def test_sd15_defaults_are_unchanged_and_each_choice_changes_the_run(
    tmp_path, tiny_sd15, family_dataset
):
    data = family_dataset("sd15")
    default = _run(tmp_path, "default", tiny_sd15, data, "sd15")
    explicit = _run(
        tmp_path,
        "explicit",
        tiny_sd15,
        data,
        "sd15",
        min_timestep=0,
        max_timestep=1000,
        loss_type="mse",
        huber_c=0.5,  # unused by mse
    )
    assert _equal(default, explicit)
    window = _run(tmp_path, "window", tiny_sd15, data, "sd15", max_timestep=500)
    huber = _run(tmp_path, "huber", tiny_sd15, data, "sd15", loss_type="huber")
    assert _trained(huber) and _trained(window)
    assert not _equal(default, window) and not _equal(default, huber)


def test_a_flow_family_trains_with_huber_in_a_window(tmp_path, tiny_base, family_dataset):
    base, data = tiny_base("sd3"), family_dataset("sd3")
    plain = _run(tmp_path, "plain", base, data, "sd3")
    huber = _run(
        tmp_path,
        "huber",
        base,
        data,
        "sd3",
        loss_type="huber",
        min_timestep=100,
        max_timestep=900,
    )
    assert _trained(huber) and not _equal(plain, huber)


# ------------------------------------------------------------------ refused values


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"min_timestep": -1}, "min_timestep: -1"),
        ({"min_timestep": 1000}, "min_timestep: 1000"),
        ({"max_timestep": 1001}, "max_timestep: 1001"),
        ({"min_timestep": 600, "max_timestep": 600}, "max_timestep: 600"),
        ({"min_timestep": 700, "max_timestep": 300}, "max_timestep: 300"),
        ({"huber_c": 0.0}, "huber_c: 0.0"),
        ({"huber_c": -0.1}, "huber_c: -0.1"),
        ({"loss_type": "l1"}, "loss_type"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path, fields, key):
    path = write_config(tmp_path / "bad.json", model_family="sd15", **fields)
    with pytest.raises(ConfigError, match=key):
        load_config(path)
