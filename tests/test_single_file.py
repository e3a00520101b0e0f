"""Single-file base models, another VAE, and frozen parts loaded in the dtype they run in.

A checkpoint file as A1111 and ComfyUI share it must train exactly as the diffusers folder it was
written from; validation, export (with its verification) and merge must work on such a run; a
file that is not the configured architecture is refused with both named; the file's cache
identity is a hash of its bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families import get_family, identity, ldm
from kit.families.loading import ensure_base_model, load_base
from kit.run import checkpoint as ckpt
from kit.run.env import advice, host_memory, report
from tests.conftest import write_run_config


@pytest.fixture(scope="module", autouse=True)
def _hash_store(tmp_path_factory):
    """File hashes are kept under `$XDG_CACHE_HOME`: a folder of this module's, not the home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield


def _cfg(family: str, pretrained: str | Path, **model: str) -> Config:
    cfg = Config()
    cfg.model.model_family = family
    cfg.model.pretrained_model = str(pretrained)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def _same_weights(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb), what
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{what}.{k}"


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_base):
    """`files(name)`: the family's tiny model as one file in its original layout (the whole
    checkpoint for the SD families, the transformer alone for SD3 and Wan)."""
    out = tmp_path_factory.mktemp("single")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            family = get_family(name)
            path = out / f"{name}.safetensors"
            save_file(family.single_file_state_dict(family.load(str(tiny_base(name)))), str(path))
            made[name] = path
        return made[name]

    return get


# ------------------------------------------------------------------ loading


# Flux is left out: diffusers' Flux converter builds the original fused weights at Flux's own
# width (3072), so a tiny Flux file cannot be read by it at all.
@pytest.mark.parametrize("name", ["sd15", "sdxl", "sd3", "wan"])
def test_every_part_loads_from_the_file_as_from_the_folder(tiny_base, files, name):
    """Bit for bit: the parts the file holds through diffusers' converters, the ones it lacks
    (SD3's and Wan's encoders and VAE) from `model_config`."""
    folder = tiny_base(name)
    ours = get_family(name).load(str(folder))
    family = get_family(name, _cfg(name, files(name), model_config=str(folder)))
    theirs = family.load(str(files(name)))
    _same_weights(ours.denoiser, theirs.denoiser, "denoiser")
    _same_weights(ours.vae, theirs.vae, "vae")
    assert len(ours.text_encoders) == len(theirs.text_encoders)
    for i, (a, b) in enumerate(zip(ours.text_encoders, theirs.text_encoders, strict=True)):
        _same_weights(a, b, f"text_encoders.{i}")
    assert theirs.source == str(folder)  # the pipelines read their configs from model_config
    assert theirs.subfolders["denoiser"] in ("unet", "transformer")


def test_parts_load_straight_in_their_dtype(tiny_base, files):
    """A per-part dtype: frozen parts in bf16 straight away, the VAE in fp32, each equal to
    the fp32 weights cast, from the folder and from the file alike."""
    folder = tiny_base("sd15")
    ref = get_family("sd15").load(str(folder))
    dtypes = {"*": torch.bfloat16, "vae": torch.float32}
    for source in (folder, files("sd15")):
        cfg = _cfg("sd15", source, model_config=str(folder))
        _, comps = load_base(cfg, dtype=dtypes)
        assert {p.dtype for p in comps.denoiser.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in comps.text_encoders[0].parameters()} == {torch.bfloat16}
        assert {p.dtype for p in comps.vae.parameters()} == {torch.float32}
        for k, v in comps.denoiser.state_dict().items():
            assert torch.equal(v, ref.denoiser.state_dict()[k].to(torch.bfloat16)), k


def test_training_loads_the_frozen_base_in_its_half_dtype(
    tmp_path, monkeypatch, tiny_base, files, family_dataset, cpu_fp16
):
    """Under fp16 the frozen denoiser and text encoder load in fp16 (not fp32, then cast), the
    VAE in fp32 for the cache; the weights are the fp32 ones rounded once."""
    import kit.train.prepare as prep

    asked = []

    def spy(cfg, dtype=torch.float32, parts=(), family=None):
        asked.append(dtype)
        return load_base(cfg, dtype=dtype, parts=parts, family=family)

    monkeypatch.setattr(prep, "load_base", spy)
    folder = tiny_base("sd15")
    path = write_run_config(
        tmp_path / "config.json",
        base=files("sd15"),
        data=family_dataset("sd15"),
        model_config=str(folder),
        mixed_precision="fp16",
    )
    s = prep.prepare(load_config(path))
    # Two loads, each straight in its dtype: the cache's parts, then the denoiser.
    assert asked == [{"*": torch.float16, "vae": torch.float32}] * 2
    ref = get_family("sd15").load(str(folder)).denoiser.state_dict()
    base = {k.replace(".base_layer", ""): v for k, v in s.comps.denoiser.state_dict().items()}
    assert {v.dtype for k, v in base.items() if "lora_" not in k} == {torch.float16}
    for k, v in ref.items():
        assert torch.equal(base[k], v.half()), k


def test_base_pipeline_is_plain_diffusers_on_the_file(tiny_base, files):
    folder = tiny_base("sdxl")
    family = get_family("sdxl", _cfg("sdxl", files("sdxl"), model_config=str(folder)))
    pipe = family.base_pipeline()
    ref = get_family("sdxl").load(str(folder))
    assert type(pipe).__name__ == "StableDiffusionXLPipeline"
    _same_weights(ref.text_encoders[1], pipe.text_encoder_2, "text_encoder_2")
    _same_weights(ref.denoiser, pipe.unet, "unet")


# ------------------------------------------------------------------ bad input


def test_a_file_of_another_family_is_refused(tiny_base, files):
    sdxl, sd15 = files("sdxl"), files("sd15")
    cfg = _cfg("sd15", sdxl, model_config=str(tiny_base("sd15")))
    with pytest.raises(KitError, match="does not hold a sd15 model") as e:
        load_base(cfg)
    assert str(sdxl) in str(e.value)
    cfg = _cfg("sdxl", sd15, model_config=str(tiny_base("sdxl")))
    with pytest.raises(KitError, match="does not hold a sdxl model"):
        load_base(cfg)


def test_a_file_of_no_known_layout_is_refused(tmp_path):
    path = tmp_path / "odd.safetensors"
    save_file({"some.weight": torch.zeros(2)}, str(path))
    with pytest.raises(KitError, match="match no wan checkpoint layout"):
        get_family("wan", _cfg("wan", path)).load(str(path), parts=("denoiser",))


def test_a_model_config_of_another_architecture_is_refused(tmp_path, tiny_base, files):
    """The same family, other widths: a shape mismatch, naming the file and the config."""
    other = tmp_path / "wider"
    shutil.copytree(tiny_base("sd15"), other)
    unet = other / "unet" / "config.json"
    config = json.loads(unet.read_text())
    config["block_out_channels"] = [32, 96]
    unet.write_text(json.dumps(config))
    file = files("sd15")
    with pytest.raises(KitError, match="do not fit") as e:
        load_base(_cfg("sd15", file, model_config=str(other)))
    assert str(file) in str(e.value) and str(other) in str(e.value)


def test_the_shipped_configs_cannot_stand_in_for_tokenizers(files):
    """Empty `model_config` is the shipped config: no hub access, but no tokenizers either."""
    file = files("sd15")
    with pytest.raises(KitError, match="tokenizers from model_config"):
        load_base(_cfg("sd15", file))
    with pytest.raises(KitError, match="model_config: folder not found"):
        load_base(_cfg("sd15", file, model_config="/nowhere/sd15"))
    for missing in (ensure_base_model, load_base):
        with pytest.raises(KitError, match="file not found"):
            missing(_cfg("sd15", "/nowhere/model.safetensors"))
    assert "single-file base model" in ensure_base_model(_cfg("sd15", file, model_config="sd15"))


def test_a_file_that_lacks_a_part_needs_its_weights_in_model_config(tmp_path, tiny_base, files):
    """An SD3 transformer file beside a config folder without the VAE's weights."""
    configs = tmp_path / "configs"
    shutil.copytree(tiny_base("sd3"), configs)
    for f in (configs / "vae").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(KitError, match="holds no vae, and model_config"):
        load_base(_cfg("sd3", files("sd3"), model_config=str(configs)), parts=("vae",))


# ------------------------------------------------------------------ identity


def test_the_cache_identity_of_a_file_is_its_content_hash(tmp_path, monkeypatch, tiny_base, files):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder, file = tiny_base("sd15"), files("sd15")
    moved = tmp_path / "elsewhere.safetensors"
    shutil.copy(file, moved)
    family = get_family("sd15", _cfg("sd15", file, model_config=str(folder)))
    assert identity.file_digest(moved) == hashlib.sha256(moved.read_bytes()).hexdigest()
    # A copy under another name keeps the caches; other bytes change them.
    assert family.identity(str(moved)) == family.identity(str(file))
    assert family.identity(str(file)) != get_family("sd15").identity(str(folder))
    stored = list((tmp_path / "xdg" / "kit" / "file-hashes").iterdir())
    assert stored, "hashed once per file version, and kept"
    state = load_file(str(moved))
    key = next(k for k in state if k.startswith(ldm.VAE_PREFIX))
    state[key] += 1
    save_file(state, str(moved))
    os.utime(moved, ns=(1, 1))
    assert family.identity(str(moved))["vae"] != family.identity(str(file))["vae"]


def test_another_vae_changes_the_latent_key_and_replaces_the_vae(tmp_path, tiny_base):
    """`vae_model` as a folder (config at its root, or a `vae/` subfolder) or one file."""
    folder = tiny_base("sd15")
    other = get_family("sd15").make_tiny(tmp_path / "other", seed=1)
    plain = get_family("sd15").identity(str(folder))
    wanted = get_family("sd15").load(str(other), parts=("vae",)).vae
    vae_file = tmp_path / "vae.safetensors"
    save_file(ldm.vae_to_ldm(wanted.state_dict(), wanted.config), str(vae_file))
    for vae_model in (other, other / "vae", vae_file):
        cfg = _cfg("sd15", folder, vae_model=str(vae_model))
        family = get_family("sd15", cfg)
        ident = family.identity(str(folder))
        assert ident["vae"] != plain["vae"] and ident["text"] == plain["text"]
        _, comps = load_base(cfg, parts=("vae",))
        _same_weights(wanted, comps.vae, f"vae from {vae_model.name}")
    with pytest.raises(KitError, match="no config.json"):
        load_base(_cfg("sd15", folder, vae_model=str(tmp_path)), parts=("vae",))


# ------------------------------------------------------------------ a run from the file


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_base, files, family_dataset):
    """The same two-step LoRA run from the tiny SD1.5 folder and from its single file."""
    from kit.train.loop import train

    out = {}
    folder = tiny_base("sd15")
    for name, fields in (
        ("folder", {"base": folder}),
        ("file", {"base": files("sd15"), "model_config": str(folder)}),
    ):
        tmp = tmp_path_factory.mktemp(name)
        path = write_run_config(
            tmp / "config.json",
            data=family_dataset("sd15"),
            max_train_steps=2,
            checkpointing_steps=2,
            **fields,
        )
        train(load_config(path))
        out[name] = tmp / "run"
    return out


@pytest.mark.slow
def test_a_run_from_the_file_trains_bit_for_bit_as_from_the_folder(runs):
    weights = {
        name: ckpt.exported_weights(ckpt.resolve_resume(run, "latest"))
        for name, run in runs.items()
    }
    assert weights["file"].keys() == weights["folder"].keys()
    for k, v in weights["folder"].items():
        assert torch.equal(v, weights["file"][k]), k


def test_validation_export_and_merge_work_on_the_file_run(tmp_path, runs):
    """Export verification redraws the kit's validation images with plain diffusers on the
    file (drawing them first, as none were drawn in training); the merge reads back exactly."""
    from kit.export.merge import merge
    from kit.export.writer import export

    result = export(runs["file"], "diffusers")
    assert result.verification is not None and result.verification.passed
    assert result.verification.images >= 1
    merged = merge(runs["file"], out=tmp_path / "m.safetensors", dtype="fp32")
    assert merged.max_abs_diff == 0.0 and merged.path.is_file()


# ------------------------------------------------------------------ the machine


def test_env_reports_host_memory():
    mem = host_memory()
    assert set(mem) == {"total_gib", "available_gib", "peak_rss_gib"}
    assert mem["peak_rss_gib"] and mem["peak_rss_gib"] > 0
    rep = report()
    assert any(note.startswith("host RAM: ") for note in advice(rep))


def test_the_estimate_reads_a_file_bases_architecture_from_model_config(tiny_base, files):
    from kit.preflight.estimate import estimate

    from_file = estimate(_cfg("sdxl", files("sdxl"), model_config=str(tiny_base("sdxl"))))
    from_folder = estimate(_cfg("sdxl", tiny_base("sdxl")))
    assert from_file.total_bytes == from_folder.total_bytes > 0
