"""SDXL specifics the contract suite cannot see: the kit conditions the UNet as the pipeline does."""

from __future__ import annotations

import pytest
import torch

from kit.families import get_family


@pytest.fixture(scope="module")
def sdxl(tiny_base):
    """The tiny SDXL, loaded by the family and by plain diffusers."""
    import diffusers

    family = get_family("sdxl")
    base = tiny_base("sdxl")
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(str(base), **family.pipeline_kwargs)
    return family, family.load(str(base)), pipe


def test_text_embeddings_match_the_pipeline(sdxl):
    family, comps, pipe = sdxl
    captions = ["a large red circle", ""]
    ours = family.encode_text(comps, captions)
    embeds, _, pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
    assert ours["prompt_embeds"].shape == (2, 77, 64)
    assert torch.equal(ours["prompt_embeds"], embeds)
    assert torch.equal(ours["pooled_prompt_embeds"], pooled)


def test_size_and_crop_ids_condition_the_unet_as_the_pipeline_does(sdxl):
    family, comps, pipe = sdxl
    enc = family.encode_text(comps, ["a cat", "a dog"])
    latents = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))
    steps = torch.tensor([10, 500])
    sizes = {
        "original_size": torch.tensor([[80, 100], [64, 96]]),
        "crop_top_left": torch.tensor([[8, 2], [0, 0]]),
        "target_size": torch.tensor([[64, 96], [64, 96]]),
    }
    ours = family.predict(comps, latents, steps, {**enc, **sizes})

    dim = comps.text_encoders[1].config.projection_dim
    ids = torch.cat(
        [
            pipe._get_add_time_ids((80, 100), (8, 2), (64, 96), torch.float32, dim),
            pipe._get_add_time_ids((64, 96), (0, 0), (64, 96), torch.float32, dim),
        ]
    )
    added = {"text_embeds": enc["pooled_prompt_embeds"], "time_ids": ids}
    theirs = pipe.unet(
        latents, steps, encoder_hidden_states=enc["prompt_embeds"], added_cond_kwargs=added
    )
    assert torch.allclose(ours, theirs.sample, atol=1e-6)

    uncropped = family.predict(
        comps, latents, steps, {**enc, **sizes, "crop_top_left": torch.zeros(2, 2)}
    )
    assert not torch.allclose(ours[0], uncropped[0]) and torch.allclose(ours[1], uncropped[1])


def test_kit_pipeline_is_the_saved_pipeline(sdxl):
    family, comps, pipe = sdxl
    ours = family.pipeline(comps)
    assert type(ours.scheduler) is type(pipe.scheduler)
    assert ours.scheduler.config == pipe.scheduler.config
    assert ours.watermark is None and pipe.watermark is None
    assert ours.config.force_zeros_for_empty_prompt == pipe.config.force_zeros_for_empty_prompt
