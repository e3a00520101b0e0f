"""Wan image-to-video on tiny bases (Wan 2.1 I2V with a tiny CLIP vision model, Wan 2.2 I2V A14B,
TI2V-5B with `condition_frame`): the transformer inputs of a training clip equal the pipeline's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from kit.config import Config
from kit.errors import ConfigError, KitError
from kit.families import get_family

# kind → (variant index in Wan.variants, extra config)
KINDS = {
    "wan21_i2v": (3, {}),
    "wan22_i2v": (4, {}),
    "ti2v": (2, {"condition_frame": 0}),
}


@pytest.fixture(scope="module")
def i2v_base(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            wan = get_family("wan")
            out = tmp_path_factory.mktemp("models") / f"tiny-{kind}"
            made[kind] = wan.make_tiny(out, seed=0, variant=wan.variants[KINDS[kind][0]])
        return made[kind]

    return get


def family(base: Path, kind: str, **fields):
    cfg = Config().replace(pretrained_model=str(base), max_sequence_length=16)
    return get_family("wan", cfg.replace(**{**KINDS[kind][1], **fields}))


def recorder(module: torch.nn.Module, name: str, calls: list):
    """Record every forward of `module` as (name, its keyword arguments)."""

    def hook(_, args, kwargs):
        calls.append((name, dict(kwargs)))

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def a_clip(frames: int, height: int, width: int, seed: int = 0):
    """Random 8-bit frames: the kit's pixels (1, 3, F, H, W) as it reads them, and frame 0 as
    the PIL image a user hands the pipeline."""
    g = torch.Generator().manual_seed(seed)
    u8 = torch.randint(0, 256, (frames, height, width, 3), generator=g, dtype=torch.uint8)
    pixels = (u8.permute(3, 0, 1, 2).float() / 127.5 - 1.0).unsqueeze(0)  # kit.data.pixels
    return pixels, Image.fromarray(u8[0].numpy(), "RGB")


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_inputs_equal_the_pipelines(i2v_base, kind):
    from diffusers import WanImageToVideoPipeline

    base = i2v_base(kind)
    wan = family(base, kind)
    assert wan.variant_of(str(base)) == wan.variants[KINDS[kind][0]]
    assert wan.pipeline_class == "WanImageToVideoPipeline"
    comps = wan.load(str(base))
    pipe = WanImageToVideoPipeline.from_pretrained(str(base))
    seen_pipe: list = []
    parts = [("high", pipe.transformer)]
    if pipe.transformer_2 is not None:
        parts.append(("low", pipe.transformer_2))
    for name, part in parts:
        recorder(part, name, seen_pipe)
    seen_kit: list = []
    if hasattr(comps.denoiser, "expert"):
        for name in ("high", "low"):
            recorder(comps.denoiser.expert(name), name, seen_kit)
    else:
        recorder(comps.denoiser, "high", seen_kit)

    frames, height, width = 5, 32, 32
    pixels, image = a_clip(frames, height, width)
    z = comps.vae.config.z_dim
    s = comps.vae.config.scale_factor_spatial
    noise = torch.randn(
        1, z, 2, height // s, width // s, generator=torch.Generator().manual_seed(1)
    )
    prompt = "a large red zorbic moving right"
    with torch.no_grad():
        pipe(
            image=image,
            prompt=prompt,
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=6,
            guidance_scale=1.0,  # one forward per step: the conditional one training makes
            latents=noise.clone(),
            max_sequence_length=16,
            output_type="latent",
        )
    if kind == "wan22_i2v":
        assert {name for name, _ in seen_pipe} == {"high", "low"}  # across the boundary
    # The conditioning as the cache holds it (unbatched, fp32, on the CPU), batched.
    made = wan.pixel_conditioning(comps, pixels)
    cond = {k: v.float().unsqueeze(0) for k, v in made.items()}
    cond.update(wan.encode_text(comps, [prompt]))
    if kind == "ti2v":
        mask = cond.pop("loss_mask")[0, 0]  # the loss leaves out the image's latent frame
        assert not mask[0].any() and bool(mask[1:].all())
    else:
        assert "loss_mask" not in cond
    assert ("image_embeds" in cond) == (kind == "wan21_i2v")
    for step, (name, theirs) in enumerate(seen_pipe):
        hidden = theirs["hidden_states"]
        if kind == "ti2v":
            noisy = hidden  # its first frame is the image's latents; predict puts them there
            t = theirs["timestep"][:, -1]
        else:
            noisy, t = hidden[:, :z], theirs["timestep"]
        if step == 0:  # the pipeline starts from our noise
            assert torch.equal(noisy[:, :, 1:], noise[:, :, 1:])
        seen_kit.clear()
        with torch.no_grad():
            wan.predict(comps, noisy, t, cond)
        ((expert, ours),) = seen_kit
        assert expert == name
        keys = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")
        for key in keys:
            a, b = ours.get(key), theirs.get(key)
            assert (a is None) == (b is None), key
            assert a is None or torch.equal(a, b), (key, step)


def test_what_image_to_video_cannot_do_is_refused(i2v_base, tiny_base, tmp_path):
    import json
    import shutil

    t2v = tiny_base("wan")
    with pytest.raises(ConfigError, match="condition_frame: 0, but .* text-to-video"):
        family(t2v, "wan21_i2v", condition_frame=0)
    base = i2v_base("wan21_i2v")
    with pytest.raises(ConfigError, match="validation_prompt: image-to-video draws"):
        family(base, "wan21_i2v", validation_prompt=["a cat"])
    with pytest.raises(ConfigError, match="validation_prompts: image-to-video"):
        family(base, "wan21_i2v", image_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="condition_frame: 9 is not a frame"):
        family(base, "wan21_i2v", condition_frame=9, num_frames=5)
    # A folder that calls itself image-to-video but whose transformer takes no frames.
    fake = tmp_path / "fake-i2v"
    shutil.copytree(t2v, fake)
    index = json.loads((fake / "model_index.json").read_text())
    (fake / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "WanImageToVideoPipeline"})
    )
    with pytest.raises(KitError, match="takes no conditioning frames"):
        family(fake, "wan21_i2v")
    # TI2V-5B trains text-to-video unless a conditioning frame is asked for.
    assert family(i2v_base("ti2v"), "ti2v", condition_frame=None).i2v is None


@pytest.fixture(scope="module")
def i2v_runs(tmp_path_factory, i2v_base, family_dataset):
    """`run(kind)`: a short run on that tiny base, and the fields to repeat it."""
    from kit.config import load_config
    from kit.train.loop import train
    from tests.conftest import write_run_config

    made: dict = {}

    def run(kind: str):
        if kind in made:
            return made[kind]
        tmp = tmp_path_factory.mktemp(f"{kind}run")
        first = tmp / "first.png"
        a_clip(1, 32, 32, seed=5)[1].save(first)
        fields = {
            "family": "wan",
            "base": i2v_base(kind),
            "data": family_dataset("wan"),
            "cache_dir": str(tmp / "cache"),
            "num_frames": 5,
            "max_sequence_length": 16,
            "max_train_steps": 4,
            "checkpointing_steps": 2,
            "validation_prompt": [],
            "validation_prompts": [{"prompt": "a large red zorbstar", "control": [str(first)]}],
            "validation_seeds": [3],
            **KINDS[kind][1],
        }

        def config(name: str, **overrides):
            path = write_run_config(
                tmp / f"{name}.json", **{**fields, "output_dir": str(tmp / name), **overrides}
            )
            return load_config(path)

        made[kind] = (tmp, config, train(config("straight")))
        return made[kind]

    return run


@pytest.mark.parametrize("kind", list(KINDS))
def test_trains_resumes_and_exports(i2v_runs, kind):
    from safetensors.torch import load_file

    from kit.export.writer import export
    from kit.run import checkpoint as ckpt
    from kit.train.loop import train

    tmp, config, straight = i2v_runs(kind)
    assert straight.step == 4 and len(straight.validation_grids) == 1
    weights = load_file(str(ckpt.checkpoint_dir(tmp / "straight", 4) / ckpt.ADAPTER_FILE))
    assert any(w.abs().sum() > 0 for k, w in weights.items() if "lora_B" in k)
    split = config("split")
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    resumed = load_file(str(ckpt.checkpoint_dir(tmp / "split", 4) / ckpt.ADAPTER_FILE))
    assert weights.keys() == resumed.keys()
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    for fmt in ("diffusers", "kohya"):
        result = export(tmp / "straight", fmt)
        assert result.verification.passed, (fmt, result.verification)
