"""The toy base's recipe runs end to end (a few steps of each stage) and loads like any checkpoint."""

from __future__ import annotations

import json
import random

import numpy as np

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


def test_the_recipe_names_the_command_that_rebuilds_it(tmp_path):
    out = toybase.build(
        tmp_path / "b", seed=2, vae_steps=2, unet_steps=1, decoder_steps=1, vae_color_weight=1.0
    )
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["vae_color_weight"] == 1.0
    assert recipe["command"].endswith(
        "--seed 2 --vae-steps 2 --unet-steps 1 --decoder-steps 1 --vae-color-weight 1.0"
    )
