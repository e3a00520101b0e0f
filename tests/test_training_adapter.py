"""The training adapter: a LoRA read by the family's own diffusers loader, run inside the base
while another LoRA trains, switched off for the grids the export is judged by, and never
exported; a step-distilled base without one is warned about."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kit.config import Config, load_config
from kit.errors import KitError
from kit.families import get_family
from kit.families.training_adapter import read_training_adapter
from kit.train.loop import train
from kit.train.prepare import _training_adapter

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def adapter_file(tiny_sd15, tmp_path_factory):
    """A random LoRA for the tiny SD1.5 UNet, saved as diffusers saves one (alpha ≠ rank)."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(tiny_sd15, subfolder="unet")
    unet.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("adapter")
    StableDiffusionPipeline.save_lora_weights(
        out,
        unet_lora_layers=get_peft_model_state_dict(unet),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        safe_serialization=True,
    )
    return out


def _unet_inputs():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(1, 4, 8, 8, generator=g),
        torch.tensor([500]),
        torch.randn(1, 77, 32, generator=g),
    )


def test_runs_as_diffusers_loads_it_and_switches_off_to_the_plain_base(tiny_sd15, adapter_file):
    from diffusers import StableDiffusionPipeline
    from peft.tuners.lora import LoraLayer

    family = get_family("sd15")
    comps = family.load(str(tiny_sd15), parts=("denoiser",))
    unet = comps.denoiser
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    x, t, text = _unet_inputs()
    with torch.no_grad():
        plain = unet(x, t, encoder_hidden_states=text).sample

    adapter = read_training_adapter(family, unet, str(adapter_file))
    # Read, then taken out again: the denoiser is left as it was.
    assert not any(isinstance(m, LoraLayer) for m in unet.modules())
    assert unet.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())
    attentions = sum(1 for n, _ in unet.named_modules() if n.endswith(("attn1", "attn2")))
    assert len(adapter.layers) == 4 * attentions
    assert {s for _, _, s in adapter.layers.values()} == {2.0}  # alpha 4 / rank 2

    adapter.attach(unet, "cpu")
    reference = StableDiffusionPipeline.from_pretrained(str(tiny_sd15))
    reference.load_lora_weights(str(adapter_file))
    with torch.no_grad():
        ours = unet(x, t, encoder_hidden_states=text).sample
        theirs = reference.unet(x, t, encoder_hidden_states=text).sample
        with adapter.switched_off():
            off = unet(x, t, encoder_hidden_states=text).sample
    assert not torch.allclose(ours, plain, atol=1e-3)  # the adapter does something
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(off, plain)
    adapter.remove()


def test_a_file_of_another_base_is_refused_in_one_line(tiny_base, adapter_file):
    family = get_family("flux")
    comps = family.load(str(tiny_base("flux")), parts=("denoiser",))
    with pytest.raises(KitError, match="training_adapter"):
        read_training_adapter(family, comps.denoiser, str(adapter_file))
    with pytest.raises(KitError, match="cannot load 'no/such-adapter'"):
        read_training_adapter(family, comps.denoiser, "no/such-adapter")


class _Distilled:
    """A stand-in family whose base says it is step-distilled."""

    name = "stand-in"

    def distillation(self, pretrained: str) -> str:
        return "Stand-in Turbo is step-distilled (8 steps, no CFG)."


def test_a_distilled_base_without_an_adapter_is_warned_about():
    said: list[str] = []
    assert _training_adapter(Config(), _Distilled(), None, said.append) is None
    (line,) = said
    assert line.startswith("warning: Stand-in Turbo is step-distilled")
    assert "training_adapter" in line and "non-distilled base" in line
    said.clear()
    _training_adapter(Config(), get_family("sd15"), None, said.append)
    assert said == []  # a base that is not distilled: nothing to say


def test_trains_with_it_draws_both_grids_and_exports_without_it(
    make_config, adapter_file, tmp_path
):
    cfg = load_config(
        make_config(training_adapter=str(adapter_file), max_train_steps=2, checkpointing_steps=2)
    )
    result = train(cfg)
    run = result.run_dir
    step = run / "validation" / "step-000002"
    assert (step / "grid.png").is_file()
    assert (step / "with-training-adapter" / "grid.png").is_file()
    sidecar = json.loads((step / "with-training-adapter" / "00_seed0.json").read_text())
    assert sidecar["training_adapter"] == adapter_file.name  # a name, never the local path
    # The export holds the trained LoRA alone: the same keys as a run without the adapter.
    plain = load_config(
        make_config("plain.json", max_train_steps=2, output_dir=str(tmp_path / "p"))
    )
    other = train(plain)
    ours = load_file(str(next((run / "checkpoints").rglob("adapter*.safetensors"))))
    theirs = load_file(str(next((other.run_dir / "checkpoints").rglob("adapter*.safetensors"))))
    assert ours.keys() == theirs.keys()
    # Same seed, same data: the adapter inside the base changed what was learned.
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours)
