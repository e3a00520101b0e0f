"""The toy base's recipe runs end to end (a few steps of each stage) and loads like any checkpoint."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kit.toy import base as toybase
from kit.toy import world as toyworld


def test_random_polygons_come_in_any_color():
    rng = random.Random(0)
    colors = set()
    for _ in range(40):
        pixels = np.asarray(toybase.random_polygon(rng)).reshape(-1, 3)
        values, counts = np.unique(pixels, axis=0, return_counts=True)
        colors.update(
            tuple(int(c) for c in v) for v, n in zip(values, counts, strict=True) if n > 40
        )
    known = set(toyworld.COLORS.values()) | set(toyworld.BACKGROUNDS.values())
    assert len(colors - known) >= 30  # a codec for every color, not the six of the world


@pytest.mark.slow
def test_a_short_build_saves_a_loadable_pipeline(tmp_path):
    import torch
    from diffusers import StableDiffusionPipeline

    out = toybase.build(tmp_path / "base", seed=3, vae_steps=2, unet_steps=2, decoder_steps=1)
    recipe = json.loads((out / "recipe.json").read_text())
    assert (recipe["seed"], recipe["vae_steps"], recipe["unet_steps"]) == (3, 2, 2)
    assert recipe["decoder_steps"] == 1 and recipe["prediction_type"] == "v_prediction"
    assert not list(out.rglob("*.bin")), "safetensors only"
    pipe = StableDiffusionPipeline.from_pretrained(
        out, safety_checker=None, requires_safety_checker=False
    )
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.vae.config.norm_num_groups == 1
    image = pipe(
        "a small zorbic circle on a white background, on the left",
        num_inference_steps=2,
        width=64,
        height=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


@pytest.mark.slow
def test_the_color_term_makes_latents_follow_the_image_colors():
    import torch
    import torch.nn.functional as F

    world = toybase.scenes()[::6]
    images = toybase.to_tensor([toyworld.render(s, 64, 64) for s in world])

    def color_error(weight: float) -> float:
        vae, _ = toybase.train_vae(images, 40, seed=1, color_weight=weight, log=lambda _: None)
        with torch.no_grad():
            mean = vae.encode(images).latent_dist.mean
        return F.mse_loss(mean[:, :3], F.avg_pool2d(images, 4)).item()

    # Off (the committed recipe), the latents owe the image's colors nothing; on, the first
    # three channels come to hold them.
    assert color_error(1.0) < 0.5 * color_error(0.0)


@pytest.mark.slow
def test_the_recipe_names_the_command_that_rebuilds_it(tmp_path):
    out = toybase.build(
        tmp_path / "b",
        seed=2,
        vae_steps=2,
        unet_steps=1,
        decoder_steps=1,
        vae_color_weight=0.5,
        color_jitter=20.0,
    )
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["vae_color_weight"] == 0.5 and recipe["color_jitter"] == 20.0
    assert recipe["command"].endswith(
        "--seed 2 --vae-steps 2 --unet-steps 1 --decoder-steps 1 --vae-color-weight 0.5"
        " --color-jitter 20.0"
    )


def test_jittered_shapes_keep_their_layout_their_name_and_a_hole_around_the_concept():
    import torch

    world = toybase.scenes()
    images = toybase.to_tensor([toyworld.render(s, 64, 64) for s in world])
    recolor = toybase.Recolor(world, images, toybase.build_vae().eval(), radius=90.0)
    # With the named fill, the repainted image is the rendered one (to rounding).
    every = torch.arange(len(world))
    assert (recolor.paint(every, recolor.fills) - images).abs().max() < 1 / 127.5
    idx = torch.randint(0, len(world), (2000,), generator=torch.Generator().manual_seed(0))
    fills = recolor.jittered_fills(idx, torch.Generator().manual_seed(1))
    moved = (fills - recolor.fills[idx]).norm(dim=1)
    assert float(moved.max()) <= 90.0 + 1e-3 and float(moved.mean()) > 40.0
    names = torch.tensor(list(toyworld.COLORS.values()), dtype=torch.float32)
    assert torch.equal(torch.cdist(fills, names).argmin(1), recolor.label[idx])
    pink = torch.tensor(list(toyworld.CONCEPT_COLORS.values()), dtype=torch.float32)
    assert float(torch.cdist(fills, pink).min()) >= toybase.RECIPE["color_hole"]
    backgrounds = torch.tensor(list(toyworld.BACKGROUNDS.values()), dtype=torch.float32)
    assert float(torch.cdist(fills, backgrounds).min()) >= toybase.RECIPE["color_margin"]
    # The latents the denoiser trains on: one per scene, and they vary with the draw.
    few = torch.arange(8)
    a = recolor.latents(few, torch.Generator().manual_seed(1))
    b = recolor.latents(few, torch.Generator().manual_seed(2))
    assert a.shape == (8, 4, 16, 16) and not torch.allclose(a, b)
