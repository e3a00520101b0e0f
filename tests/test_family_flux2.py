"""FLUX.2 specifics the contract suite does not see: the transformer inputs the kit builds equal,
tensor for tensor, those Flux2Pipeline and Flux2KleinPipeline build at sampling; the σ shift is
the pipelines'; the latents are normalised as theirs; variants and step distillation are read
from the configs; LoRA and single files load back through diffusers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.families.flux2 import family as flux2
from kit.families.flux2.family import patchify, unpack
from tests.conftest import lora_loads_exactly

CAPTION = "a small red circle on a blue background"
SIDE = 64  # pixels: an 8×8 latent, 4×4 patches


@pytest.fixture(scope="module")
def tiny_dev(tiny_base):
    return tiny_base("flux2")


@pytest.fixture(scope="module")
def tiny_klein(tmp_path_factory):
    """A tiny step-distilled klein (Qwen3, no guidance input), beside the session's dev."""
    return get_family("flux2").make_tiny(tmp_path_factory.mktemp("klein") / "base", kind="klein")


@pytest.fixture(scope="module")
def tiny_klein_base(tiny_klein, tmp_path_factory):
    """The same klein with its pipeline config saying it is not step-distilled."""
    path = tmp_path_factory.mktemp("klein_base") / "base"
    shutil.copytree(tiny_klein, path)
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}))
    return path


def _family(path, **changes):
    return get_family(
        "flux2", Config().replace(model_family="flux2", pretrained_model=str(path), **changes)
    )


def _spy(module: torch.nn.Module) -> list[dict]:
    """Record every forward's keyword arguments and output on `module`."""
    calls: list[dict] = []
    forward = module.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append({**kwargs, "out": out[0]})
        return out

    module.forward = recording
    return calls


@pytest.mark.parametrize("which", ["dev", "klein", "klein base"])
def test_training_inputs_are_the_pipelines_inputs(which, tiny_dev, tiny_klein, tiny_klein_base):
    path = {"dev": tiny_dev, "klein": tiny_klein, "klein base": tiny_klein_base}[which]
    family = _family(path, max_sequence_length=32)
    comps = family.load(str(path))
    latents = torch.randn(1, comps.vae.config.latent_channels, SIDE // 8, SIDE // 8)
    calls = _spy(comps.denoiser)
    pipe = family.pipeline(comps)
    with torch.no_grad():
        pipe(
            prompt=CAPTION,
            latents=patchify(latents),  # the pipeline takes patchified noise
            height=SIDE,
            width=SIDE,
            num_inference_steps=2,
            guidance_scale=family.train_guidance_scale(),
            max_sequence_length=32,
            output_type="latent",
        )
        seen = calls[0]  # the first step (klein base's conditional half of CFG)
        assert len(calls) == (4 if which == "klein base" else 2)
        step = pipe.scheduler.timesteps[:1]
        cond = family.encode_text(comps, [CAPTION])
        pred = family.predict(comps, latents, step, cond)
    ours = calls[-1]
    keys = ("hidden_states", "timestep", "guidance", "encoder_hidden_states", "txt_ids", "img_ids")
    assert set(keys) <= set(ours)
    for key in keys:
        if seen[key] is None:
            assert ours[key] is None and which != "dev", key
            continue
        assert ours[key].dtype == seen[key].dtype, key
        assert torch.equal(ours[key], seen[key]), key
    assert (seen["guidance"] is not None) == (which == "dev")
    assert torch.equal(pred, unpack(seen["out"], SIDE // 8, SIDE // 8))


def test_shift_is_the_pipelines_for_the_size(tiny_dev):
    """The σ schedule Flux2Pipeline draws with at its default 50 steps is the kit's shift
    applied to its unshifted σ, at this size (16 tokens) and a large one (4096)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    family = _family(tiny_dev, max_sequence_length=8)
    comps = family.load(str(tiny_dev))
    calls = _spy(comps.denoiser)
    with torch.no_grad():
        family.pipeline(comps)(prompt=CAPTION, height=SIDE, width=SIDE, output_type="latent")
    drawn = torch.stack([c["timestep"][0] for c in calls])
    assert len(drawn) == 50
    sigmas = torch.linspace(1.0, 1 / 50, 50, dtype=torch.float64)
    shift = family.flow_shift(comps.noise_scheduler.config, SIDE // 8, SIDE // 8)
    expected = shift * sigmas / (1 + (shift - 1) * sigmas)
    torch.testing.assert_close(drawn.double(), expected, atol=1e-5, rtol=1e-5)
    large = family.flow_shift(comps.noise_scheduler.config, 128, 128)  # 1024 px
    assert large == pytest.approx(np.exp(compute_empirical_mu(4096, 50)))
    assert _family(tiny_dev, flow_shift=2.0).flow_shift(comps.noise_scheduler.config, 8, 8) == 2


def test_latents_are_normalised_as_the_pipeline_normalises_them(tiny_dev):
    family = _family(tiny_dev)
    comps = family.load(str(tiny_dev))
    pixels = torch.rand(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ours = family.encode_images(comps, pixels)
        theirs = family.pipeline(comps)._encode_vae_image(pixels, generator=None)
    assert ours.shape == (2, comps.vae.config.latent_channels, SIDE // 8, SIDE // 8)
    torch.testing.assert_close(patchify(ours), theirs)
    assert not torch.allclose(comps.vae.bn.running_mean, torch.zeros(()))  # the stats matter


def test_variants_and_distillation_come_from_the_configs(tiny_dev, tiny_klein, tiny_klein_base):
    dev, klein, base = (_family(p) for p in (tiny_dev, tiny_klein, tiny_klein_base))
    assert (dev.pipeline_class, klein.pipeline_class) == ("Flux2Pipeline", "Flux2KleinPipeline")
    assert dev.variant_of(str(tiny_dev)) == "dev" and dev.distillation(str(tiny_dev)) == ""
    assert "is_distilled" in klein.distillation(str(tiny_klein))
    assert base.variant_of(str(tiny_klein_base)).startswith("klein base")
    assert base.distillation(str(tiny_klein_base)) == ""
    shipped = _family("black-forest-labs/FLUX.2-klein-9B")
    assert shipped.variant_of("black-forest-labs/FLUX.2-klein-4B") == "klein 4B"
    assert shipped.variant_of("black-forest-labs/FLUX.2-klein-9B") == "klein 9B"
    assert shipped.variant_of("black-forest-labs/FLUX.2-dev") == "dev"
    assert shipped.variant_of("black-forest-labs/FLUX.2-klein-base-4B") == "klein base 4B"
    assert shipped.distillation("black-forest-labs/FLUX.2-klein-base-9B") == ""
    assert "klein 9B" in shipped.distillation("black-forest-labs/FLUX.2-klein-9B")
    assert shipped.version_metadata()["modelspec.architecture"] == "flux-2-klein-9b"
    assert set(dev.variants) >= {"dev", "klein 4B", "klein 9B"}


def test_klein_samples_through_its_own_pipeline(tiny_klein):
    from diffusers import Flux2KleinPipeline

    family = _family(tiny_klein, max_sequence_length=16)
    comps = family.load(str(tiny_klein))
    pipe = family.pipeline(comps)
    assert isinstance(pipe, Flux2KleinPipeline) and pipe.config.is_distilled
    # The parts say which pipeline they need, whatever base the config names.
    other = get_family("flux2").pipeline(comps)
    assert isinstance(other, Flux2KleinPipeline) and other.config.is_distilled
    cond = family.encode_text(comps, [CAPTION, "a dog"])
    assert cond["prompt_embeds"].shape == (2, 16, comps.denoiser.config.joint_attention_dim)


def test_lora_round_trips_every_default_target(tiny_dev, tmp_path):
    from diffusers import Flux2Pipeline

    from kit.methods import get_method

    cfg = Config().replace(model_family="flux2", pretrained_model=str(tiny_dev), lora_rank=2)
    family = get_family("flux2", cfg)
    comps = family.load(str(tiny_dev))
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    lora_loads_exactly(family, comps, Flux2Pipeline.from_pretrained(str(tiny_dev)), tmp_path)


def test_single_file_reads_back_through_diffusers_and_the_kit(tiny_dev, tmp_path):
    family = _family(tiny_dev)
    comps = family.load(str(tiny_dev), parts=("denoiser",))
    path = tmp_path / "flux2-tiny.safetensors"
    save_file(family.single_file_state_dict(comps), str(path))
    want = comps.denoiser.state_dict()
    pipe = family.single_file_pipeline(path, tiny_dev)
    got = pipe.transformer.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    kit = _family(path, model_config=str(tiny_dev)).load(str(path), parts=("denoiser",))
    assert all(torch.equal(kit.denoiser.state_dict()[k], want[k]) for k in want)


def test_refusals():
    from kit.methods import get_method

    with pytest.raises(ConfigError, match="bucket_step"):
        _family("black-forest-labs/FLUX.2-dev", bucket_step=24)
    cfg = Config().replace(model_family="flux2", network_type="textual_inversion")
    with pytest.raises(ConfigError, match="textual_inversion on flux2"):
        get_method(cfg, get_family("flux2", cfg))
    cfg = Config().replace(model_family="flux2", train_text_encoder=True)
    with pytest.raises(ConfigError, match="text encoders"):
        get_method(cfg, get_family("flux2", cfg)).attach  # noqa: B018


def test_a_processor_folders_chat_template_is_found(tiny_dev, tmp_path):
    """The released dev's `tokenizer/` is a Pixtral processor whose template may sit in the
    processor's own `chat_template.json`, which a tokenizer does not read."""
    copy = tmp_path / "base"
    shutil.copytree(tiny_dev, copy)
    folder = copy / "tokenizer"
    template = _family(tiny_dev).load_tokenizers(str(tiny_dev))["text_encoder"].chat_template
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    loaded = _family(copy).load_tokenizers(str(copy))["text_encoder"]
    assert template and loaded.chat_template == template


@pytest.mark.parametrize("which", ["dev", "klein"])
def test_token_limit_leaves_the_templates_tokens(which, tiny_dev, tiny_klein):
    """A caption of exactly `token_limit` tokens fills the pipeline's padded length."""
    path = tiny_dev if which == "dev" else tiny_klein
    family = _family(path, max_sequence_length=200)
    tokenizer = family.load_tokenizers(str(path))["text_encoder"]
    limit = family.token_limit("text_encoder", tokenizer)
    assert 2 < limit < 200
    caption = " ".join(["dog"] * 400)
    ids = tokenizer(caption, add_special_tokens=False).input_ids[:limit]
    text = tokenizer.decode(ids)
    full = tokenizer(flux2.chat_prompt(tokenizer, text), add_special_tokens=False).input_ids
    assert len(full) == 200
