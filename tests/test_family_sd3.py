"""SD3 specifics beyond the contract suite: T5 left out, T5 length, flow-matching draws."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.data.cache import build_cache
from kit.export.writer import export
from kit.families import get_family
from kit.families.base import ImageSpec
from kit.families.loading import load_base
from kit.train.loop import train
from tests.conftest import EXAMPLE, write_run_config


@pytest.fixture(scope="module")
def sd3_setup(tmp_path_factory, tiny_base):
    """A tiny SD3 base and a copy of the example images."""
    tmp = tmp_path_factory.mktemp("sd3")
    base = tiny_base("sd3")
    shutil.copytree(EXAMPLE / "images", tmp / "data")
    return tmp, base


def _config(tmp, base, run: str, **overrides):
    fields = {
        "output_dir": str(tmp / run),
        "cache_dir": str(tmp / f"cache-{run}"),
        "learning_rate": 1e-2,
        "max_train_steps": 1,
        "checkpointing_steps": 1,
        "validation_guidance_scale": 3.0,
        **overrides,
    }
    path = write_run_config(
        tmp / f"{run}.json", base=base, data=tmp / "data", family="sd3", **fields
    )
    return load_config(path)


@pytest.mark.slow
def test_without_t5_trains_a_step_and_plain_diffusers_reproduces_it(sd3_setup):
    tmp, base = sd3_setup
    cfg = _config(tmp, base, "no-t5", use_t5=False, max_sequence_length=16)
    family, comps = load_base(cfg)
    assert len(comps.text_encoders) == len(comps.tokenizers) == 2
    assert set(family.load_tokenizers(str(base))) == {"text_encoder", "text_encoder_2"}

    # T5's part of the prompt is zeros, exactly as the pipeline fills it.
    embeds = family.encode_text(comps, ["a red zorbstar"])["prompt_embeds"]
    assert embeds.shape[1] == 77 + 16
    assert embeds[:, 77:].abs().sum() == 0 and embeds[:, :77].abs().sum() > 0

    result = train(cfg)
    assert result.step == 1
    rows = [json.loads(x) for x in (tmp / "no-t5/logs/metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows)
    # The sidecar tells plain diffusers to leave T5 out too; the export then redraws the image.
    assert export(tmp / "no-t5", "diffusers").verification.passed


def test_max_sequence_length_sets_the_cached_prompt_length(sd3_setup):
    tmp, base = sd3_setup
    lengths = {}
    for n in (8, 40):
        # One cache folder: the latents are shared, the text is keyed by the T5 length.
        cfg = _config(tmp, base, f"len{n}", max_sequence_length=n, cache_dir=str(tmp / "cache-len"))
        family, comps = load_base(cfg)
        assert family.token_limit("text_encoder_3", comps.tokenizers[2]) == n
        data = build_cache(cfg, family, comps)
        assert data.stats["text_reused"] == 0
        cached = load_file(str(data.text_files[0]))
        lengths[n] = cached["prompt_embeds"].shape[0]
        assert cached["pooled_prompt_embeds"].shape == (64,)  # CLIP-L + CLIP-G projections
    assert lengths == {8: 77 + 8, 40: 77 + 40}
    # Unset, it is the pipeline's default of 256 tokens, and sampling is told so.
    spec = ImageSpec("a red zorbstar", "", 0, 2, 3.0, 64, 64)
    assert get_family("sd3").call_kwargs(spec)["max_sequence_length"] == 256


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_flow_draw_targets_velocity_at_sigma_times_1000(sd3_setup, weighting):
    tmp, base = sd3_setup
    cfg = _config(tmp, base, "draw", loss_weighting=weighting, timestep_sampling="uniform")
    family, comps = load_base(cfg)
    latents = torch.randn(4, 16, 8, 8)
    draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    sigma = draw.timesteps / 1000
    assert ((sigma > 0) & (sigma < 1)).all()
    noise = draw.target + latents
    s = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(draw.noisy, (1 - s) * latents + s * noise)
    expected = {
        "none": None,
        "sigma_sqrt": sigma**-2,
        "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2)),
    }[weighting]
    if expected is None:
        assert draw.weight is None
    else:
        torch.testing.assert_close(draw.weight, expected)
