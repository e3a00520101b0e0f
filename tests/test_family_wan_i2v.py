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


def a_clip(frames: int, height: int, width: int, seed: int = 0) -> list[Image.Image]:
    """Random 8-bit frames."""
    g = torch.Generator().manual_seed(seed)
    u8 = torch.randint(0, 256, (frames, height, width, 3), generator=g, dtype=torch.uint8)
    return [Image.fromarray(f.numpy(), "RGB") for f in u8]


def cached_clip(wan, comps, tmp: Path, frames: int, size: int):
    """One training clip (a frame folder of the bucket's size, so nothing is cropped) through
    the kit's cache: its batch of one, and its frames as files."""
    from kit.data.cache import fill_cache, plan_cache

    clip = tmp / "data" / "clip"
    clip.mkdir(parents=True)
    for i, frame in enumerate(a_clip(frames, size, size)):
        frame.save(clip / f"{i:04d}.png")
    (tmp / "data" / "clip.txt").write_text("a large red zorbic moving right")
    cfg = wan.cfg.replace(
        image_dir=str(tmp / "data"),
        cache_dir=str(tmp / "cache"),
        resolution=size,
        bucket_step=16,
        num_frames=frames,
        validation_prompts=[{"prompt": "x", "control": [str(clip / "0000.png")]}],
    )
    fam = get_family("wan", cfg)
    data = fill_cache(
        plan_cache(
            cfg, fam.identity(str(wan.cfg.model.pretrained_model)), torch.float32, family=fam
        ),
        cfg,
        fam,
        comps,
    )
    return data.load_batch([0]), sorted(clip.iterdir())


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_inputs_equal_the_pipelines(i2v_base, kind, tmp_path):
    """One training clip, cached as a run caches it: the transformer's keyword arguments the
    kit builds for it equal, tensor for tensor, those WanImageToVideoPipeline builds for the
    clip's first frame, the same prompt, size, frame count and noise, at every step."""
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

    frames, size = 5, 32
    batch, files = cached_clip(wan, comps, tmp_path, frames, size)
    z = comps.vae.config.z_dim
    assert batch["latents"].shape[1] == z
    latent_frames, side = batch["latents"].shape[2], batch["latents"].shape[-1]
    noise = torch.randn(1, z, latent_frames, side, side, generator=torch.Generator().manual_seed(1))
    prompt = "a large red zorbic moving right"
    with torch.no_grad():
        pipe(
            image=Image.open(files[0]).convert("RGB"),
            prompt=prompt,
            height=size,
            width=size,
            num_frames=frames,
            num_inference_steps=6,
            guidance_scale=1.0,  # one forward per step: the conditional one training makes
            latents=noise.clone(),
            max_sequence_length=16,
            output_type="latent",
        )
    if kind == "wan22_i2v":
        assert {name for name, _ in seen_pipe} == {"high", "low"}  # across the boundary
    cond = {k: v for k, v in batch.items() if k != "latents"}
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
        a_clip(1, 32, 32, seed=5)[0].save(first)
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


@pytest.mark.slow
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
    # The diffusers files redraw the validation clip through WanImageToVideoPipeline with
    # diffusers' own loader; the kohya files load through diffusers' converter and name
    # ComfyUI's modules (one file per expert for Wan 2.2 I2V A14B).
    result = export(tmp / "straight", "diffusers")
    assert result.verification.passed and result.verification.images == 1
    if kind == "wan22_i2v":
        assert set(result.files) == {"high_noise", "low_noise"}
    kohya = export(tmp / "straight", "kohya")
    assert kohya.verification.passed
    clients = kohya.verification.clients
    # (In 4 steps one expert may never train: its file then changes nothing, exactly.)
    assert clients and all(c["exact"] for c in clients) and any(c["weights"] for c in clients)


@pytest.mark.slow
def test_shipped_i2v_configs_estimate(module_trace_cache):
    """`kit estimate` on the shipped Wan 2.1 I2V 14B and Wan 2.2 I2V A14B configs: the traced
    step feeds the 36-channel input (and 2.1's CLIP image tokens); 2.2's second expert waits."""
    from kit.preflight.estimate import estimate

    gib = 2**30
    for hub_id, weights in (
        ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", (30, 31.5)),  # 16.4B in bf16
        ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", (26, 27.5)),  # one 14.3B expert in bf16
    ):
        cfg = Config().replace(
            model_family="wan",
            pretrained_model=hub_id,
            resolution=480,
            num_frames=17,
            mixed_precision="bf16",
            gradient_checkpointing=True,
        )
        e = estimate(cfg)
        low, high = weights
        assert low < e.components["denoiser_weights"] / gib < high, hub_id
        assert e.components["activations"] > 0
