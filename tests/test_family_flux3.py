"""FLUX.3 klein specifics the contract suite does not see: the transformer inputs the kit builds
equal, tensor for tensor, those diffusers' modular FLUX.3 blocks build at sampling (base and
step-distilled, with and without reference images); the σ shift is the blocks'; the variant and
step distillation are read from the transformer's config; LoRA loads back through the FLUX.3
loader on the modular pipeline."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from PIL import Image

from kit.config import Config
from kit.families import get_family
from kit.families.flux2.family import patchify
from kit.families.flux3 import family as flux3
from tests.conftest import lora_loads_exactly

CAPTION = "a small red circle on a blue background"
SIDE = 64  # pixels: an 8×8 latent, 4×4 patches


@pytest.fixture(scope="module")
def tiny_base3(tiny_base):
    return tiny_base("flux3")


@pytest.fixture(scope="module")
def tiny_distilled(tmp_path_factory):
    """A tiny step-distilled klein (a flow-map transformer), beside the session's base."""
    return get_family("flux3").make_tiny(tmp_path_factory.mktemp("klein") / "base", distilled=True)


def _family(path, **changes):
    return get_family(
        "flux3", Config().replace(model_family="flux3", pretrained_model=str(path), **changes)
    )


def _spy(module: torch.nn.Module) -> list[dict]:
    """Record every forward's keyword arguments and output on `module`."""
    calls: list[dict] = []
    forward = module.forward

    @functools.wraps(forward)  # the blocks pass what the forward's signature names
    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append({**kwargs, "out": out[0]})
        return out

    module.forward = recording
    return calls


def _reference(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = torch.randint(
        0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed)
    )
    return Image.fromarray(pixels.numpy().astype("uint8"))


@pytest.mark.parametrize(
    ("which", "references"), [("base", 0), ("distilled", 0), ("base", 1), ("distilled", 2)]
)
def test_training_inputs_are_the_pipelines_inputs(which, references, tiny_base3, tiny_distilled):
    path = tiny_base3 if which == "base" else tiny_distilled
    control = ["c"] * references
    family = _family(path, max_sequence_length=32, control_dir=control)
    comps = family.load(str(path))
    latents = torch.randn(1, comps.vae.config.latent_channels, SIDE // 8, SIDE // 8)
    images = [_reference(i, (SIDE + 16 * i, SIDE)) for i in range(references)]
    calls = _spy(comps.denoiser)
    pipe = family.pipeline(comps)
    kwargs = {"image": images} if images else {}
    with torch.no_grad():
        pipe(
            prompt=CAPTION,
            latents=patchify(latents),  # the blocks take patchified noise
            height=SIDE,
            width=SIDE,
            num_inference_steps=2,
            max_sequence_length=32,
            output="latents",
            **kwargs,
        )
        seen = calls[0]  # the first step (the base's conditional half of CFG)
        assert len(calls) == (4 if which == "base" else 2)
        step = pipe.scheduler.timesteps[:1]
        cond = family.encode_text(comps, [CAPTION])
        for i, image in enumerate(images):
            pixels = family.control_pixels(image)[None]
            cond[f"control_latents_{i}"] = family.encode_images(comps, pixels)
        pred = family.predict(comps, latents, step, cond)
    ours = calls[-1]
    keys = ["hidden_states", "timestep", "encoder_hidden_states", "txt_ids", "img_ids"]
    keys += ["target_timestep"] if which == "distilled" else []
    keys += ["image_cond_hidden_states", "image_cond_ids"] if references else []
    assert set(ours) - {"out", "return_dict"} == set(keys)
    assert set(seen) - {"out", "return_dict", "attention_kwargs"} == set(keys)
    for key in keys:
        # A flow map is asked for the velocity at σ itself (the flow-matching loss's target),
        # not for the jump to the blocks' next step: its target time is the pipeline's time.
        want = seen["timestep"] if key == "target_timestep" else seen[key]
        assert ours[key].dtype == want.dtype, key
        assert torch.equal(ours[key], want), key
    out = seen["out"] if which == "base" else ours["out"]  # the same inputs: the same output
    assert torch.equal(pred, flux3.untokens(out, SIDE // 8, SIDE // 8))


def test_shift_is_the_pipelines(tiny_base3):
    """The σ the base blocks draw with at their default 50 steps are the kit's shift applied to
    their unshifted σ."""
    family = _family(tiny_base3, max_sequence_length=8)
    comps = family.load(str(tiny_base3))
    calls = _spy(comps.denoiser)
    with torch.no_grad():
        family.pipeline(comps)(
            prompt=CAPTION, height=SIDE, width=SIDE, max_sequence_length=8, output="latents"
        )
    drawn = torch.stack([c["timestep"][0] for c in calls[::2]])
    assert len(drawn) == family.default_num_inference_steps == 50
    sigmas = torch.linspace(1.0, 1 / 50, 50, dtype=torch.float64)
    shift = family.flow_shift(comps.noise_scheduler.config, SIDE // 8, SIDE // 8)
    assert shift == pytest.approx(6.93)
    expected = shift * sigmas / (1 + (shift - 1) * sigmas)
    torch.testing.assert_close(drawn.double(), expected, atol=1e-5, rtol=1e-5)


def test_variants_and_distillation_come_from_the_configs(tiny_base3, tiny_distilled):
    base, distilled = _family(tiny_base3), _family(tiny_distilled)
    assert base.variant_of(str(tiny_base3)) == "klein base"
    assert distilled.variant_of(str(tiny_distilled)) == "klein"
    assert base.distillation(str(tiny_base3)) == ""
    assert "flow_map" in distilled.distillation(str(tiny_distilled))
    assert (base.default_num_inference_steps, base.default_guidance_scale) == (50, 3.5)
    assert (distilled.default_num_inference_steps, distilled.default_guidance_scale) == (16, 1.0)
    shipped = _family(flux3.Flux3.hub_id)
    assert shipped.variant_of("black-forest-labs/flux-3-image-klein") == "klein"
    assert shipped.variant_of(flux3.Flux3.hub_id) == "klein base"


def test_lora_loads_through_the_flux3_loader(tiny_base3, tmp_path):
    from kit.methods import get_method

    cfg = Config().replace(model_family="flux3", pretrained_model=str(tiny_base3), lora_rank=2)
    family = get_family("flux3", cfg)
    comps = family.load(str(tiny_base3))
    summary = get_method(cfg, family).attach(comps)
    for target in family.default_lora_targets:
        assert any(m.endswith(target) for m in summary.modules), target
    fresh = family.load(str(tiny_base3))
    pipe = family.pipeline(fresh)
    lora_loads_exactly(family, comps, pipe, tmp_path)


def test_distilled_is_warned_about_and_takes_a_training_adapter(tiny_distilled, tmp_path):
    """The step-distilled klein without an adapter is warned about; a de-distilling LoRA is
    read by the FLUX.3 loader into the denoiser (and the denoiser left plain)."""
    from safetensors.torch import save_file

    from kit.families.training_adapter import read_training_adapter
    from kit.train.prepare import _training_adapter

    family = _family(tiny_distilled)
    said: list[str] = []
    assert _training_adapter(family.cfg, family, None, said.append) is None
    assert said[0].startswith("warning: FLUX.3 klein is step-distilled")
    comps = family.load(str(tiny_distilled), parts=("denoiser",))
    g = torch.Generator().manual_seed(0)
    module = "single_transformer_blocks.0.attn.to_q"
    file = {
        f"transformer.{module}.lora_A.weight": torch.randn(2, 32, generator=g),
        f"transformer.{module}.lora_B.weight": torch.randn(32, 2, generator=g),
    }
    save_file(file, str(tmp_path / "dedistill.safetensors"))
    adapter = read_training_adapter(family, comps.denoiser, str(tmp_path / "dedistill.safetensors"))
    down, up, scale = adapter.layers[module]
    assert torch.equal(down, file[f"transformer.{module}.lora_A.weight"]) and scale == 1.0
    assert torch.equal(up, file[f"transformer.{module}.lora_B.weight"])
    assert not any("lora" in n for n, _ in comps.denoiser.named_parameters())


@pytest.mark.slow
def test_distilled_trains_two_steps_under_its_adapter_and_exports(
    tiny_distilled, family_dataset, tmp_path
):
    """A 2-step LoRA run on the tiny distilled klein with a de-distilling adapter: validation
    draws at the distilled blocks' own settings (16 steps, no CFG), and the diffusers export
    holds the trained LoRA alone and redraws through the blocks."""
    from safetensors.torch import load_file, save_file

    from kit.config import load_config
    from kit.export.writer import export
    from kit.train.loop import train
    from tests.conftest import write_run_config

    g = torch.Generator().manual_seed(0)
    adapter = tmp_path / "dedistill.safetensors"
    # On the target-time embedder, which the trained LoRA leaves alone: not in the export.
    module = "transformer.target_timestep_embedder.linear_1"
    save_file({f"{module}.lora_A.weight": torch.randn(2, 32, generator=g),
               f"{module}.lora_B.weight": torch.randn(32, 2, generator=g) * 0.1},
              str(adapter))  # fmt: skip
    path = write_run_config(
        tmp_path / "c.json", base=tiny_distilled, data=family_dataset("flux3"), family="flux3",
        max_train_steps=2, checkpointing_steps=2, validation_steps=2, max_sequence_length=32,
        training_adapter=str(adapter), validation_guidance_scale=None,
        validation_num_inference_steps=0,
    )  # fmt: skip
    assert train(load_config(path)).step == 2
    step = tmp_path / "run/validation/step-000002"
    for grid in (step, step / "with-training-adapter"):  # what the export draws, and in training
        call = json.loads(next(grid.glob("*_seed*.json")).read_text())["call_kwargs"]
        assert (call["guidance_scale"], call["num_inference_steps"]) == (1.0, 16)
        assert "negative_prompt" not in call and (grid / "grid.png").is_file()
    result = export(tmp_path / "run", "diffusers")
    assert result.verification.passed, result.verification
    assert not any("target_timestep" in k for k in load_file(str(result.path)))


def test_only_diffusers_reads_its_adapters():
    """ComfyUI has no FLUX.3 model at the commit the layout names: the family writes the
    diffusers file alone, and says that ComfyUI loads no file of the run."""
    from kit.export.writer import Verification, use_in
    from kit.families.flux3 import layout

    family = _family(flux3.Flux3.hub_id)
    assert family.export_formats == ("diffusers",) and len(layout.COMFYUI_CHECKED) == 40
    said = use_in("diffusers", Verification(1, 0, 0.0, True), family.export_formats, family)
    assert said[0].startswith("diffusers (pipe.load_lora_weights")
    assert "ComfyUI" in said[1] and "no file of this run loads there" in said[1]


def test_estimate_answers_for_the_hub_id_offline(tmp_path, monkeypatch, capsys):
    """`kit estimate` at 1024 px for the default hub id: the shipped configs, no download."""
    from kit.cli import main
    from kit.preflight import estimate as estimating

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KIT_VRAM_CACHE", str(tmp_path / "vram"))
    estimating.forget_traces()
    path = tmp_path / "flux3.json"
    path.write_text(json.dumps({"model_family": "flux3", "pretrained_model": flux3.Flux3.hub_id,
                                "resolution": 1024, "mixed_precision": "bf16"}))  # fmt: skip
    assert main(["estimate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 5.54B parameters in bf16, and the activations of a 4096-token image with 512 text tokens.
    assert abs(out["components"]["denoiser_weights"] / (5.538e9 * 2) - 1) < 0.01
    assert out["components"]["activations"] > 0
    estimating.forget_traces()


def test_a_processor_folders_chat_template_is_found(tiny_base3, tmp_path):
    """The release's `tokenizer/` is a Qwen3-VL processor whose template may sit in the
    processor's own `chat_template.json`, which a tokenizer does not read."""
    import shutil

    copy = tmp_path / "base"
    shutil.copytree(tiny_base3, copy)
    folder = copy / "tokenizer"
    template = _family(tiny_base3).load_tokenizers(str(tiny_base3))["text_encoder"].chat_template
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    loaded = _family(copy).load_tokenizers(str(copy))["text_encoder"]
    assert template and loaded.chat_template == template


def test_no_single_file_is_written_in_a_layout_it_is_not(tiny_base3):
    from kit.errors import KitError

    family = _family(tiny_base3)
    with pytest.raises(KitError, match="no single-file checkpoint layout"):
        family.single_file_state_dict(None)
