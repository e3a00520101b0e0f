"""What the kit says about a run and its files: the base a config means, the metadata, the
clients and versions each file is for, and the model card's usage text (issue 47)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kit.cli import main
from kit.config import Config, load_config
from kit.errors import ConfigError
from kit.families import family_info, get_family

ROOT = Path(__file__).resolve().parent.parent
SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"


def test_an_unset_base_is_the_familys_own(tmp_path, capsys):
    path = tmp_path / "zimage.json"
    path.write_text(json.dumps({"model_family": "zimage", "image_dir": str(tmp_path)}))
    assert load_config(path).model.pretrained_model == family_info("zimage").hub_id
    assert Config().model.pretrained_model == SD15
    # A base left at its family's own follows the family; one that was set stays.
    assert Config().replace(model_family="wan").model.pretrained_model == family_info("wan").hub_id
    mine = Config().replace(pretrained_model="me/my-sd15")
    assert mine.replace(lora_rank=2).model.pretrained_model == "me/my-sd15"
    assert main(["estimate", str(path)]) == 0
    assert "denoiser_weights" in capsys.readouterr().out


def test_a_base_of_another_family_is_one_line(tmp_path, capsys):
    path = tmp_path / "mixed.json"
    path.write_text(
        json.dumps({"model_family": "zimage", "pretrained_model": SD15, "image_dir": "x"})
    )
    with pytest.raises(ConfigError, match="pretrained_model: .* is a sd15 model"):
        get_family("zimage", load_config(path))
    assert main(["estimate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "OSError" not in err
    assert "model_family is zimage" in err and "Tongyi-MAI/Z-Image-Turbo" in err


def _wan(hub: str):
    return get_family("wan", Config().replace(model_family="wan", pretrained_model=hub))


def test_wan_files_name_their_release_and_expert():
    """Wan 2.1 keeps musubi-tuner's `wan2.1`; Wan 2.2 names its release (ai-toolkit's
    `ss_base_model_version` values) and each expert's file its timesteps."""
    v21 = _wan("Wan-AI/Wan2.1-T2V-1.3B-Diffusers").version_metadata()
    assert v21["ss_base_model_version"] == v21["modelspec.architecture"] == "wan2.1"
    for hub, version, arch in (
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan_2.2_14b", "wan2.2-t2v-a14b"),
        ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan_2.2_14b", "wan2.2-i2v-a14b"),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan_2.2_5b", "wan2.2-ti2v-5b"),
    ):
        meta = _wan(hub).version_metadata()
        assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (version, arch)
        assert meta["modelspec.implementation"] == "https://github.com/Wan-Video/Wan2.2"
    a14b = _wan("Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    assert a14b.part_metadata("high_noise")["modelspec.timestep_range"] == "875,1000"
    assert a14b.part_metadata("low_noise")["modelspec.timestep_range"] == "0,875"
    assert a14b.part_metadata("") == {}


def _family(name: str, base: str = ""):
    return get_family(
        name, Config().replace(model_family=name, **({"pretrained_model": base} if base else {}))
    )


def test_client_versions_are_named_where_support_starts():
    from kit.export.writer import Verification, use_in

    zimage = _family("zimage")
    assert zimage.client_label("ComfyUI") == "ComfyUI ≥ 0.8 (Z-Image)"
    klein = _family("flux2", "black-forest-labs/FLUX.2-klein-4B")
    assert klein.client_label("ComfyUI") == "ComfyUI ≥ 0.12 (FLUX.2 klein)"
    assert _family("flux2").client_label("ComfyUI") == "ComfyUI ≥ 0.8 (FLUX.2)"
    assert _family("sd15").client_label("ComfyUI") == "ComfyUI"
    comfy = {"client": "ComfyUI", "exact": True, "passed": True, "part": ""}
    v = Verification(0, 0, 0.0, True, clients=[comfy])
    assert use_in("kohya", v, ("diffusers", "kohya"), zimage) == ["ComfyUI ≥ 0.8 (Z-Image)"]
    assert use_in("kohya", v, ("diffusers", "kohya"), klein) == ["ComfyUI ≥ 0.12 (FLUX.2 klein)"]


def _record(run, fmt: str, stem: str, **fields) -> None:
    folder = run.exports / fmt
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.verify.json").write_text(json.dumps(fields))


def _usage(tmp_path, family, records: dict[str, dict], diffusers=()):
    from kit.export.card import client_usage, file_use
    from kit.methods import get_method
    from kit.run.folder import RunDir

    run = RunDir(tmp_path)
    for stem, fields in records.items():
        _record(run, "kohya", stem, **fields)
    files = {"kohya": [f"{s}.safetensors" for s in records], "diffusers": list(diffusers)}
    title, text = client_usage(run, family, get_method(family.cfg, family), files)
    rows = {s: file_use(run, "kohya", f"{s}.safetensors") for s in records}
    return title, text, rows


def test_the_card_names_only_the_clients_a_check_backs(tmp_path):
    comfy = [{"client": "ComfyUI", "exact": True, "passed": True, "part": ""}]
    zimage = _family("zimage")
    title, text, _ = _usage(
        tmp_path / "z", zimage, {"run": {"use_in": ["ComfyUI ≥ 0.8 (Z-Image)"], "clients": comfy}}
    )
    assert title == "Use it in ComfyUI" and "ComfyUI ≥ 0.8 (Z-Image)" in text
    assert "<lora:" not in text and "AUTOMATIC1111" not in text and "Forge" not in text
    both = {"use_in": ["ComfyUI", "A1111"], "clients": comfy}
    title, text, _ = _usage(tmp_path / "sd", _family("sd15"), {"run": both})
    assert title == "Use it in AUTOMATIC1111 or ComfyUI" and "<lora:run:1>" in text
    # A file exported without its check: no client is named for it.
    title, text, rows = _usage(tmp_path / "none", zimage, {"run": {}})
    assert title == "Use it in other clients" and "no client check backs it" in text
    assert "ComfyUI" not in rows["run"] and "A1111" not in rows["run"]


def test_each_expert_file_is_for_its_own_expert(tmp_path):
    from kit.export.writer import Verification

    wan = _family("wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    checks = [
        {"client": "ComfyUI", "exact": True, "passed": True, "part": p}
        for p in ("high_noise", "low_noise")
    ]
    both = Verification(0, 0, 0.0, True, clients=checks)
    formats = ("diffusers", "kohya")
    records = {}
    for part, other in (("high_noise", "low-noise"), ("low_noise", "high-noise")):
        one = both.for_file(part, wan, "kohya", formats)
        assert [c["part"] for c in one.clients] == [part]
        assert len(one.use_in) == 1 and other not in one.use_in[0]
        assert part.replace("_", "-") in one.use_in[0]
        records[f"run_{part}"] = one.__dict__
        diffusers = both.for_file(part, wan, "diffusers", formats).use_in[0]
        assert ("load_into_transformer_2=True" in diffusers) == (part == "low_noise")
    title, text, rows = _usage(tmp_path, wan, records)
    high, low = text.splitlines()[:2]
    assert "run_high_noise" in high and "the high-noise expert" in high and "low-noise" not in high
    assert "run_low_noise" in low and "the low-noise expert" in low and "high-noise" not in low
    assert "Each file goes on the model it names" in text
    assert "low-noise" not in rows["run_high_noise"] and "high-noise" not in rows["run_low_noise"]


def test_the_exports_guide_says_which_kohya_files_diffusers_converter_loads():
    """Measured: diffusers' converter loads the 2026 families' LoRA files, and raises on (or,
    for a FLUX.2 LoHa, silently skips) their LoHa and LoKr files."""
    from kit.methods import get_method

    text = " ".join((ROOT / "docs/guides/exports.md").read_text(encoding="utf-8").split())
    claims = [s for s in re.split(r"(?<=[.;])\s+", text) if "diffusers' own converter" in s]
    assert claims and all("LoRA" in s for s in claims), claims
    assert "a LoHa or LoKr one does not" in text
    assert "loads a FLUX.2 LoHa file without an error while changing no weight" in text
    # The export checks a LoHa / LoKr kohya file with no diffusers redraw, as the guide says.
    for name in ("zimage", "qwen_image", "flux2", "chroma"):
        family = _family(name)
        for kind in ("loha", "lokr"):
            method = get_method(family.cfg.replace(network_type=kind), family)
            assert method.kohya_apply() is None, (name, kind)


def test_an_update_still_at_its_initial_value_is_untrained():
    """peft starts one factor of each update at zero: while one stays all zero, in every
    module, the file changes nothing."""
    import torch

    from kit.methods import get_method

    sd15 = _family("sd15")

    def untrained(kind: str, **factors) -> bool:
        method = get_method(sd15.cfg.replace(network_type=kind), sd15)
        weights = {}
        for module in ("down.0.to_q", "down.0.to_k"):
            for name, zero in factors.items():
                weights[f"{module}.{name}.weight"] = (torch.zeros if zero else torch.ones)(2, 2)
        return method.untrained(weights)

    assert untrained("lora", lora_A=False, lora_B=True)
    assert not untrained("lora", lora_A=False, lora_B=False)
    assert untrained("loha", hada_w1_a=False, hada_w1_b=False, hada_w2_a=False, hada_w2_b=True)
    assert not untrained("loha", hada_w1_a=False, hada_w2_b=False)
    assert untrained("lokr", lokr_w1=True, lokr_w2=False)
    assert not untrained("lokr", lokr_w1=False, lokr_w2=False)
    method = get_method(sd15.cfg.replace(network_type="lora"), sd15)
    one_trained = {"a.lora_B.weight": torch.zeros(2, 2), "b.lora_B.weight": torch.ones(2, 2)}
    assert not method.untrained(one_trained)
    assert not method.untrained({})
