"""Krea 2 specifics the contract suite does not see: the transformer inputs the kit builds equal
Krea2Pipeline's tensor for tensor, the σ shift of each release, Raw and Turbo read from the
configs with their own validation defaults, the original layout ComfyUI and Krea's LoRA files
use, the diffusers LoRA round trip, and Turbo's training adapter."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from kit.config import Config
from kit.families import get_family
from kit.families.krea2 import layout
from kit.families.krea2.family import pack, transformer_inputs, unpack
from kit.families.samplers import ImageSpec
from tests.conftest import assert_same_inputs as _assert_same
from tests.conftest import lora_loads_exactly
from tests.conftest import transformer_calls as _recorded_call

CAPTIONS = ["a red zorbstar", "a small blue circle on the left of a big green tree"]
LENGTH = 24  # a short fixed text length keeps the tiny runs quick


@pytest.fixture(scope="module")
def tiny_raw(tiny_base):
    return tiny_base("krea2")


@pytest.fixture(scope="module")
def tiny_turbo(tiny_raw, tmp_path_factory):
    """The same tiny model with its pipeline config saying it is the distilled release."""
    path = tmp_path_factory.mktemp("krea2") / "turbo"
    shutil.copytree(tiny_raw, path)
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return path


def _family(base, **changes):
    cfg = Config().replace(model_family="krea2", pretrained_model=str(base), **changes)
    return get_family("krea2", cfg)


@pytest.fixture(scope="module")
def loaded(tiny_raw):
    family = _family(tiny_raw, max_sequence_length=LENGTH)
    return family, family.load(str(tiny_raw))


def test_packing_is_the_pipelines(loaded):
    family, comps = loaded
    pipe = family.pipeline(comps)
    x = torch.randn(2, 16, 8, 6)
    packed = pipe._pack_latents(x, 2, 16, 8, 6)
    assert torch.equal(pack(x), packed)
    assert torch.equal(unpack(packed, 8, 6), x)
    assert torch.equal(pipe._unpack_latents(packed, 64, 48).squeeze(2), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformer_inputs_equal_the_pipelines(loaded, dtype):
    """THE test: every tensor the kit feeds the transformer for a training sample (packed
    latents, text states and mask, timestep, position ids) is, dtype included, what
    Krea2Pipeline builds at inference for the same latents, prompts, size and timestep; with
    CFG the negative pass gets the kit's encoding of the negative prompt. In bf16 too, where
    the transformer keeps its norms in fp32 and the pipeline casts to the text's dtype."""
    family, comps = loaded
    if dtype != torch.float32:
        comps = family.load(comps.source, dtype=dtype)
    pipe = family.pipeline(comps)
    own = comps.denoiser.dtype  # what `predict` casts to: the weights', not the norms' fp32
    latents = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(1))
    calls = _recorded_call(
        pipe,
        prompt=list(CAPTIONS),
        negative_prompt="blurry",
        latents=pipe._pack_latents(latents, 2, 16, 8, 6),  # the pipeline's own packing
        height=64,
        width=48,
        num_inference_steps=3,
        guidance_scale=4.5,
        max_sequence_length=LENGTH,
        output_type="latent",
    )
    assert len(calls) == 6  # CFG: the prompt's pass, then the negative's, per step
    text = family.encode_text(comps, CAPTIONS)
    assert text["prompt_embeds"].shape == (2, LENGTH, 3, 32)
    assert text["prompt_embeds_mask"].sum(1).tolist()[0] < LENGTH  # padded captions
    timesteps = pipe.scheduler.timesteps  # the pipeline's own schedule
    kit = transformer_inputs(
        latents, timesteps[:1].expand(2), text["prompt_embeds"], text["prompt_embeds_mask"], own
    )
    _assert_same(kit, calls[0])
    negative = family.encode_text(comps, ["blurry"] * 2)
    kit_negative = transformer_inputs(
        latents, timesteps[:1].expand(2), negative["prompt_embeds"], negative["prompt_embeds_mask"],
        own,
    )  # fmt: skip
    _assert_same(kit_negative, calls[1])
    # A later step: the noisy latents the pipeline reached, at its own timestep.
    noisy = unpack(calls[2]["hidden_states"], 8, 6)
    again = transformer_inputs(
        noisy, timesteps[1:2].expand(2), text["prompt_embeds"], text["prompt_embeds_mask"], own
    )
    _assert_same(again, calls[2])
    # `predict` feeds the transformer exactly these (through the cache's float mask too).
    seen = []
    hook = comps.denoiser.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw), with_kwargs=True
    )
    cached = {**text, "prompt_embeds_mask": text["prompt_embeds_mask"].float()}
    with torch.no_grad():
        family.predict(comps, latents, timesteps[:1].expand(2), cached)
    hook.remove()
    _assert_same(kit, seen[0])


def test_predict_is_the_velocity_the_scheduler_steps_with(loaded):
    """Krea2Pipeline steps its Euler scheduler with the model's output as it is:
    x_next = x + (σ_next − σ) · v; the kit's prediction is that v, and its target has that sign."""
    family, comps = loaded
    pipe = family.pipeline(comps)
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    seen = {}

    def keep(p, i, t, kwargs):
        seen.setdefault(i, kwargs["latents"].clone())
        return kwargs

    pipe(prompt=CAPTIONS[:1], latents=pack(latents), height=64, width=64, num_inference_steps=2,
         guidance_scale=0.0, max_sequence_length=LENGTH, output_type="latent",
         callback_on_step_end=keep)  # fmt: skip
    sched = pipe.scheduler
    sigma, sigma_next = sched.sigmas[0], sched.sigmas[1]
    cond = family.encode_text(comps, CAPTIONS[:1])
    with torch.no_grad():
        v = family.predict(comps, latents, sched.timesteps[:1], cond)
    assert torch.allclose(unpack(seen[0], 8, 8), latents + (sigma_next - sigma) * v, atol=1e-6)
    draw = family.noise_and_target(comps, latents, torch.Generator().manual_seed(0))
    s = (draw.timesteps / 1000).view(-1, 1, 1, 1)
    assert torch.allclose(draw.noisy, (1 - s) * latents + s * (draw.target + latents), atol=1e-6)


@pytest.mark.parametrize("release", ["raw", "turbo"])
def test_training_draws_at_the_shift_the_pipeline_samples_with(release, tiny_raw, tiny_turbo):
    """Raw's pipeline shifts σ by e^mu with mu from the image's token count (up to 6400 tokens);
    Turbo's by the fixed e^1.15. The kit's training draw uses the same shift at each size."""
    base = tiny_raw if release == "raw" else tiny_turbo
    family = _family(base, max_sequence_length=LENGTH)
    comps = family.load(str(base), parts=("denoiser",))
    for side in (64, 128):  # pixels; latents are side / 8
        shift = family.sigma_shift(comps, side // 8, side // 8)
        pipe = family.pipeline(comps)
        pipe.text_encoder = None
        n = 4
        pipe(prompt_embeds=torch.zeros(1, 2, 3, 32), prompt_embeds_mask=torch.ones(1, 2).bool(),
             height=side, width=side, num_inference_steps=n, guidance_scale=0.0,
             output_type="latent")  # fmt: skip
        u = torch.from_numpy(np.linspace(1.0, 1 / n, n)).float()
        expected = shift * u / (1 + (shift - 1) * u)
        assert torch.allclose(pipe.scheduler.sigmas[:n], expected, atol=1e-5), (side, shift)
    if release == "turbo":
        assert math.isclose(shift, math.exp(1.15))
    assert _family(base, flow_shift=2.0).sigma_shift(comps, 8, 8) == 2.0


def test_variants_and_their_validation_defaults_come_from_the_configs(tiny_raw, tiny_turbo):
    raw, turbo = _family(tiny_raw), _family(tiny_turbo)
    assert raw.variants == ("Raw", "Turbo")
    assert raw.variant_of(str(tiny_raw)) == "Raw" and raw.distillation(str(tiny_raw)) == ""
    assert turbo.variant_of(str(tiny_turbo)) == "Turbo"
    assert "step-distilled" in turbo.distillation(str(tiny_turbo))
    assert (raw.guidance_scale(), raw.inference_steps()) == (4.5, 28)
    assert (turbo.guidance_scale(), turbo.inference_steps()) == (0.0, 8)
    assert turbo.version_metadata()["modelspec.architecture"] == "krea-2-turbo"
    # The shipped configs answer for the hub ids, with no download.
    assert raw.variant_of("krea/Krea-2-Raw") == "Raw"
    assert raw.variant_of("krea/Krea-2-Turbo") == "Turbo"
    assert "Turbo" in raw.distillation("krea/Krea-2-Turbo")


def test_validation_follows_each_release(tiny_raw, tiny_turbo):
    """Raw draws with true CFG (two passes a step, the empty negative prompt named), Turbo with
    one pass and no negative prompt, each at its pipeline's own settings."""
    for base, passes in ((tiny_raw, 2), (tiny_turbo, 1)):
        family = _family(base, max_sequence_length=LENGTH)
        spec = ImageSpec(prompt="a red star", negative_prompt="", seed=0, num_inference_steps=2,
                         guidance_scale=family.guidance_scale(), width=64, height=64,
                         adapter_scale=0.5)  # fmt: skip
        kwargs = family.call_kwargs(spec)
        assert kwargs["attention_kwargs"] == {"scale": 0.5}
        assert ("negative_prompt" in kwargs) == (passes == 2)
        comps = family.load(str(base))
        calls = _recorded_call(family.pipeline(comps), **kwargs, output_type="latent")
        assert len(calls) == 2 * passes


def test_original_layout_is_what_diffusers_and_comfyui_read(loaded):
    """`to_original` is the inverse of diffusers' single-file converter, key for key and
    tensor for tensor, and names modules as ComfyUI's `krea2_to_diffusers` maps them."""
    from diffusers.loaders.single_file_utils import (
        convert_krea2_transformer_checkpoint_to_diffusers,
    )

    family, comps = loaded
    state = comps.denoiser.state_dict()
    original = layout.to_original(state)
    assert "txtfusion.projector.weight" in original  # what diffusers and ComfyUI detect it by
    assert original["blocks.0.mod.lin"].ndim == 1
    back = convert_krea2_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    # ComfyUI's map (comfy/utils.py: krea2_to_diffusers), a few of its rows.
    for diffusers, comfy in (
        ("transformer_blocks.1.attn.to_out.0", "blocks.1.attn.wo"),
        ("transformer_blocks.0.attn.to_gate", "blocks.0.attn.gate"),
        ("text_fusion.refiner_blocks.1.ff.down", "txtfusion.refiner_blocks.1.mlp.down"),
        ("text_fusion.layerwise_blocks.0.attn.to_k", "txtfusion.layerwise_blocks.0.attn.wk"),
        ("time_mod_proj", "tproj.1"),
        ("txt_in.linear_2", "txtmlp.3"),
        ("final_layer.linear", "last.linear"),
    ):
        assert layout.original_module(diffusers) == comfy
    with pytest.raises(Exception, match="original layout"):
        layout.original_module("transformer_blocks.0.attn.to_qkv")


def test_lora_round_trips_through_both_files(loaded, tmp_path):
    """The diffusers file loads through Krea2Pipeline.load_lora_weights to exactly the trained
    weights; so does the ComfyUI / Krea-layout file through diffusers' own Krea 2 converter."""
    from diffusers import Krea2Pipeline
    from peft.utils import get_peft_model_state_dict

    from kit.methods import get_method

    family, comps = loaded
    source = comps.source
    cfg = Config().replace(model_family="krea2", pretrained_model=source, lora_rank=2)
    comps = _family(source).load(source)
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    for stack in ("transformer_blocks", "text_fusion.layerwise_blocks", "text_fusion.refiner"):
        assert any(m.startswith(stack) for m in summary.modules), stack
    state = lora_loads_exactly(family, comps, Krea2Pipeline.from_pretrained(source), tmp_path)
    krea = family.kohya_state_dict(state, alpha=2.0)  # alpha = rank: the scale is 1
    assert all(k.startswith("diffusion_model.") and ".lora_" in k for k in krea)
    pipe = Krea2Pipeline.from_pretrained(source)
    pipe.load_lora_weights(krea)
    loaded_state = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert loaded_state.keys() == state.keys()
    assert all(torch.equal(loaded_state[k], state[k]) for k in state)


def test_the_methods_it_trains(tiny_raw):
    from kit.errors import ConfigError
    from kit.methods import get_method, supported

    family = _family(tiny_raw)
    assert {"lora", "dora", "loha", "lokr", "full"} <= set(supported(family))
    cfg = Config().replace(model_family="krea2", network_type="textual_inversion")
    with pytest.raises(ConfigError, match="Krea2Pipeline cannot load textual-inversion"):
        get_method(cfg, family)


def test_turbo_is_warned_about_and_takes_a_training_adapter(tiny_turbo, tmp_path):
    """A distilled Turbo without an adapter is warned about; a de-distilling LoRA in Krea's
    own layout is read by the pipeline's loader into the denoiser (and the denoiser left plain)."""
    from kit.families.training_adapter import read_training_adapter
    from kit.train.prepare import _training_adapter

    family = _family(tiny_turbo)
    said: list[str] = []
    assert _training_adapter(family.cfg, family, None, said.append) is None
    assert said[0].startswith("warning: Krea 2 Turbo is step-distilled")
    comps = family.load(str(tiny_turbo), parts=("denoiser",))
    g = torch.Generator().manual_seed(0)
    module = "blocks.0.attn.wq"
    file = {
        f"diffusion_model.{module}.lora_A.weight": torch.randn(2, 32, generator=g),
        f"diffusion_model.{module}.lora_B.weight": torch.randn(32, 2, generator=g),
    }
    from safetensors.torch import save_file

    save_file(file, str(tmp_path / "dedistill.safetensors"))
    adapter = read_training_adapter(family, comps.denoiser, str(tmp_path / "dedistill.safetensors"))
    down, up, scale = adapter.layers["transformer_blocks.0.attn.to_q"]
    assert torch.equal(down, file[f"diffusion_model.{module}.lora_A.weight"]) and scale == 1.0
    assert torch.equal(up, file[f"diffusion_model.{module}.lora_B.weight"])
    assert not any("lora" in n for n, _ in comps.denoiser.named_parameters())


def test_a_single_transformer_file_loads_as_the_folder_does(loaded, tiny_raw, tmp_path):
    from safetensors.torch import save_file

    family, comps = loaded
    path = tmp_path / "krea2_raw.safetensors"
    save_file(family.single_file_state_dict(comps), str(path))
    other = _family(path, model_config=str(tiny_raw))
    read = other.load(str(path), parts=("denoiser",))
    ours, theirs = comps.denoiser.state_dict(), read.denoiser.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_estimate_answers_for_the_hub_id_offline(tmp_path, monkeypatch, capsys):
    """`kit estimate` at 1024 px for the default hub id: the shipped configs, no download."""
    from kit.cli import main
    from kit.preflight import estimate as estimating

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KIT_VRAM_CACHE", str(tmp_path / "vram"))
    estimating.forget_traces()
    path = tmp_path / "krea2.json"
    path.write_text(json.dumps({"model_family": "krea2", "pretrained_model": "krea/Krea-2-Raw",
                                "resolution": 1024, "mixed_precision": "bf16"}))  # fmt: skip
    assert main(["estimate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 12.8B parameters in bf16, and the activations of a 4096-token image with 512 text tokens.
    assert abs(out["components"]["denoiser_weights"] / (12.82e9 * 2) - 1) < 0.01
    assert out["components"]["activations"] > 0
    estimating.forget_traces()


@pytest.mark.slow
def test_turbo_trains_two_steps_under_its_adapter_and_exports(tiny_turbo, family_dataset, tmp_path):
    """A 2-step LoRA run on the tiny Turbo with a de-distilling adapter: the validation image
    is drawn at Turbo's own settings, and both exports hold the trained LoRA alone, the
    Krea-layout file exact under ComfyUI's rules."""
    from safetensors.torch import load_file, save_file

    from kit.config import load_config
    from kit.export.writer import export
    from kit.train.loop import train
    from tests.conftest import write_run_config

    g = torch.Generator().manual_seed(0)
    adapter = tmp_path / "dedistill.safetensors"
    # On the time modulation, which the trained LoRA leaves alone: its keys must not be exported.
    save_file({"diffusion_model.tproj.1.lora_A.weight": torch.randn(2, 32, generator=g),
               "diffusion_model.tproj.1.lora_B.weight": torch.randn(192, 2, generator=g) * 0.1},
              str(adapter))  # fmt: skip
    path = write_run_config(
        tmp_path / "c.json", base=tiny_turbo, data=family_dataset("krea2"), family="krea2",
        max_train_steps=2, checkpointing_steps=2, validation_steps=2, max_sequence_length=LENGTH,
        training_adapter=str(adapter), validation_guidance_scale=None,
        validation_num_inference_steps=0,
    )  # fmt: skip
    assert train(load_config(path)).step == 2
    step = tmp_path / "run/validation/step-000002"
    for grid in (step, step / "with-training-adapter"):  # what the export draws, and in training
        sidecar = json.loads(next(grid.glob("*_seed*.json")).read_text())
        call = sidecar["call_kwargs"]
        assert (call["guidance_scale"], call["num_inference_steps"]) == (0.0, 8)
        assert "negative_prompt" not in call and (grid / "grid.png").is_file()
    assert sidecar["training_adapter"] == adapter.stem  # a name, never the local path
    for fmt in ("diffusers", "kohya"):
        result = export(tmp_path / "run", fmt)
        assert result.verification.passed, (fmt, result.verification)
        assert not any("tproj" in k or "time_mod_proj" in k for k in load_file(str(result.path)))
    comfy = [c for c in result.verification.clients if c["client"] == "ComfyUI"]
    assert comfy and comfy[0]["exact"] and comfy[0]["weights"] > 0, comfy


def test_the_token_limit_is_what_the_pipeline_keeps_of_a_caption(loaded):
    """A caption of n tokens keeps min(n, limit) of them, then the pipeline's 5-token suffix,
    in the fixed-length block."""
    from kit.families import tiny

    family, comps = loaded
    tok = comps.tokenizers[0]
    limit = family.token_limit("text_encoder", tok)
    assert limit == LENGTH - 5
    captions = [" ".join(tiny.WORDS[:n]) for n in (3, limit, limit + 4)]
    counts = [len(tok(c).input_ids) for c in captions]
    assert counts == [3, limit, limit + 4]  # one token per word
    kept = family.encode_text(comps, captions)["prompt_embeds_mask"].sum(1).tolist()
    assert kept == [min(n, limit) + 5 for n in counts]
