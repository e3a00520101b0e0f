"""A quantized frozen base (`base_quantization`): int8 on the tiny SDXL and Flux trains LoRA in
fp32 on top, checkpoints hold the adapter alone, and the export loads on the unquantized base;
what cannot run is refused with the way out."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kit.config import load_config
from kit.errors import ConfigError, KitError
from kit.families import get_family
from kit.families import quantize as quant
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir
from tests.conftest import TEXTUAL_INVERSION, write_run_config

FAMILIES = ["sdxl", "flux"]


def _trained(state) -> dict[str, nn.Parameter]:
    """The trained parameters by name, across the denoiser and text encoders."""
    from kit.methods.base import unwrap

    out = {}
    for part in [state.comps.denoiser, *state.comps.text_encoders]:
        for name, p in unwrap(part).named_parameters():
            if p.requires_grad:
                out[name] = p
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def int8_run(request, tmp_path_factory, tiny_base, family_dataset):
    """Two LoRA steps on the family's tiny base stored int8, then a diffusers export: what was
    seen before, during and after (prepared once per family for the tests below)."""
    from kit.export.writer import export
    from kit.families.quantize import is_quantized
    from kit.methods.base import unwrap
    from kit.train.loop import fit
    from kit.train.prepare import prepare

    family = request.param
    tmp = tmp_path_factory.mktemp(f"int8-{family}")
    path = write_run_config(
        tmp / "config.json",
        base=tiny_base(family),
        data=family_dataset(family),
        family=family,
        base_quantization="int8",
        max_train_steps=2,
        checkpointing_steps=0,
    )
    rows: list[dict] = []
    state = prepare(load_config(path), callbacks=[rows.append])
    denoiser = unwrap(state.comps.denoiser)
    seen = {
        "layers": {n: m for n, m in denoiser.named_modules() if is_quantized(m)},
        "text": [
            {n: m for n, m in unwrap(e).named_modules() if is_quantized(m)}
            for e in state.comps.text_encoders
        ],
        "dtypes": {p.dtype for p in _trained(state).values()},
        "initial": {n: p.detach().clone() for n, p in _trained(state).items()},
    }
    fit(state)
    seen["final"] = {n: p.detach().clone() for n, p in _trained(state).items()}
    seen["steps"] = [r for r in rows if r.get("kind") == "step"]
    seen["export"] = export(tmp / "run", "diffusers")
    return family, tmp / "run", seen


@pytest.mark.slow
def test_the_blocks_linear_layers_are_int8_and_smaller(int8_run):
    family, _, seen = int8_run
    layers = seen["layers"]
    assert layers, f"no layer of the {family} denoiser was quantized"
    for name, layer in layers.items():
        # peft wraps the quantized layer; the base layer under it holds int8 codes.
        base = getattr(layer, "base_layer", layer)
        weight = base.weight
        assert type(base).__name__ == "QLinear", name
        assert weight._data.dtype == torch.int8, name
        logical = weight.numel() * torch.empty((), dtype=weight.dtype).element_size()
        assert quant.tensor_bytes(weight) < logical, name
    # What the blocks do not hold stays as it was: the output projection and the embedders.
    names = " ".join(layers)
    assert "embed" not in names and not any("." not in n for n in layers)


def test_the_text_encoders_are_gone_once_the_cache_is_filled(int8_run):
    """The grids draw from cached prompt embeddings: no encoder, quantized or not, stays for
    the steps (`text_encoder_quantization` stores them quantized while they encode)."""
    _, _, seen = int8_run
    assert seen["text"] == []


def test_lora_trains_in_fp32_with_finite_losses(int8_run):
    _, _, seen = int8_run
    assert seen["dtypes"] == {torch.float32}
    steps = seen["steps"]
    assert len(steps) == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert all(r["grad_norm"] > 0 and torch.isfinite(torch.tensor(r["grad_norm"])) for r in steps)
    # lora_B starts at zero: a B that moved received gradients through the quantized layers.
    moved = [n for n in seen["final"] if not torch.equal(seen["final"][n], seen["initial"][n])]
    assert any(".lora_B." in n for n in moved)


def test_the_checkpoint_holds_the_adapter_only(int8_run):
    _, run_dir, _ = int8_run
    folder = ckpt.checkpoint_dir(run_dir, 2)
    weights = load_file(str(folder / ckpt.ADAPTER_FILE))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert all(v.dtype == torch.float32 and type(v) is torch.Tensor for v in weights.values())
    # Nothing of the base beside it: the usual files, and optimizer state for the adapter only.
    assert {f.name for f in folder.iterdir()} == {
        ckpt.ADAPTER_FILE,
        *ckpt.STATE_FILES,
        ckpt.MARKER,
    }
    optimizer = torch.load(folder / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert len(optimizer["state"]) == len(weights)


def test_the_export_loads_on_the_unquantized_base_and_verifies(int8_run):
    family, run_dir, seen = int8_run
    result = seen["export"]
    v = result.verification
    assert v.passed and v.images >= 1 and v.max_abs_diff <= 2
    # The references are the kit's redraw on the unquantized base, not the images training
    # drew on the int8 one, and the record says so.
    assert all("-scales/" in f for f in v.files)
    assert any("training ran on the base stored int8" in n and "differ" in n for n in v.notes)
    record = json.loads(result.path.with_suffix(".verify.json").read_text())
    assert record["notes"] == v.notes
    exported = load_file(str(result.path))
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in exported.values())
    # Training's own images at that step are still there, drawn on the quantized base.
    assert list(RunDir(run_dir).validation_step(2).glob("*.png"))


# ---------------------------------------------------------------- refusals


def test_nf4_without_cuda_names_int8():
    with pytest.raises(KitError, match="nf4 needs a CUDA GPU.*use base_quantization: int8"):
        quant.check_quantization("nf4", "cpu", method=_method("lora"))


def _method(kind: str, **fields):
    from kit.config import Config
    from kit.families import get_family
    from kit.methods import get_method

    extra = TEXTUAL_INVERSION if kind == "textual_inversion" else {"network_type": kind}
    cfg = Config().replace(model_family="sdxl", **{**extra, **fields})
    return get_method(cfg, get_family("sdxl", cfg))


def test_what_cannot_train_on_a_quantized_base_is_refused():
    with pytest.raises(ConfigError, match="network_type full.*cannot take gradient steps"):
        quant.check_quantization("int8", "cpu", method=_method("full"))
    with pytest.raises(ConfigError, match="dora.*use network_type lora"):
        quant.check_quantization("fp8", "cpu", method=_method("dora"))
    with pytest.raises(ConfigError, match="loha sizes its factors"):
        quant.check_quantization("nf4", "cuda", method=_method("loha"))
    with pytest.raises(KitError, match="under DeepSpeed"):
        quant.check_quantization("int8", "cpu", method=_method("lora"), deepspeed=True)
    with pytest.raises(ConfigError, match="unknown value 'int4'"):
        quant.check_quantization("int4", "cpu")
    # What does run: int8 and fp8 on the CPU, a frozen denoiser under textual inversion.
    for kind in ("none", "int8", "fp8"):
        quant.check_quantization(kind, "cpu", method=_method("lora"))
    quant.check_quantization("int8", "cpu", method=_method("textual_inversion"))


def test_full_with_a_quantized_base_is_refused_before_loading(tmp_path, tiny_sd15, dataset):
    from kit.train.loop import train

    path = write_run_config(
        tmp_path / "c.json",
        base=tiny_sd15,
        data=dataset,
        network_type="full",
        base_quantization="int8",
    )
    with pytest.raises(ConfigError, match="base_quantization: int8 with network_type full"):
        train(load_config(path))
    assert not (tmp_path / "cache").exists()  # nothing was cached or loaded


def test_textual_inversion_learns_through_a_quantized_denoiser(
    tmp_path, tiny_sd15, dataset, capsys
):
    from kit.train.loop import train

    for p in dataset.glob("*.txt"):  # the concept is called by the placeholder
        p.write_text(p.read_text().replace("zorbic", "<zorb>"))
    path = write_run_config(
        tmp_path / "c.json",
        base=tiny_sd15,
        data=dataset,
        base_quantization="int8",
        max_train_steps=1,
        checkpointing_steps=0,
        validation_prompt=["a red <zorb>"],
        **TEXTUAL_INVERSION,
    )
    rows: list[dict] = []
    train(load_config(path), callbacks=[rows.append])
    assert "denoiser: " in capsys.readouterr().out  # the quantization was reported
    (step,) = [r for r in rows if r.get("kind") == "step"]
    # The placeholder's gradient reached the text encoder through the int8 denoiser.
    assert step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["loss"]))


def test_nf4_is_refused_by_the_trainer_on_cpu(tmp_path, tiny_sd15, dataset):
    from kit.train.loop import train

    path = write_run_config(
        tmp_path / "c.json", base=tiny_sd15, data=dataset, base_quantization="nf4"
    )
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(KitError, match="nf4 needs a CUDA GPU"):
        train(load_config(path))


# ---------------------------------------------------------------- the layer rule


def test_fp8_on_cpu_and_the_estimate_match_what_is_stored(tiny_base):
    family = get_family("flux")
    comps = family.load(str(tiny_base("flux")), parts=("denoiser",))
    denoiser = comps.denoiser
    names = quant.quantizable_layers(denoiser)
    before, after = quant.estimated_bytes(denoiser, "fp8", torch.bfloat16)
    report = quant.quantize(denoiser, "fp8", device="cpu", dtype=torch.bfloat16)
    assert report.layers == names and (report.bytes_before, report.bytes_after) == (before, after)
    assert "proj_out" in report.kept and "x_embedder" in report.kept
    # The AdaLN modulations of the blocks are stored like every other projection.
    assert "transformer_blocks.0.norm1.linear" in names
    layer = denoiser.get_submodule(names[0])
    assert layer.weight._data.dtype == torch.float8_e4m3fn
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    assert torch.isfinite(layer(x)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nf4 runs on CUDA only")
def test_nf4_on_cuda_packs_the_blocks_and_lora_trains_on_it(tiny_base):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig

    family = get_family("flux")
    denoiser = family.load(str(tiny_base("flux")), parts=("denoiser",)).denoiser
    report = quant.quantize(denoiser, "nf4", device="cuda", dtype=torch.bfloat16)
    denoiser.to("cuda", dtype=torch.bfloat16)
    # (Each layer's scales cost about a kilobyte: on these tiny layers nf4 saves little.)
    assert report.bytes_after < report.bytes_before
    denoiser.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    layer = denoiser.get_submodule(next(n for n in report.layers if n.endswith("attn.to_q")))
    x = torch.randn(3, layer.in_features, device="cuda", dtype=torch.bfloat16)
    layer(x).float().sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


@pytest.mark.slow
def test_wan_encodes_its_cache_with_its_umt5_int8_and_trains(
    tmp_path, tiny_base, family_dataset, monkeypatch
):
    """`text_encoder_quantization`: Wan's UMT5 is stored int8 (layer by layer on the device)
    while it fills the cache, the cache is keyed apart, and the encoder is gone afterwards."""
    import kit.train.prepare as prep
    from kit.families import get_family
    from kit.train.loop import fit

    calls: list[tuple[str, str]] = []
    real = prep.quant.quantize

    def spy(module, kind, **kwargs):
        calls.append((type(module).__name__, kind))
        return real(module, kind, **kwargs)

    monkeypatch.setattr(prep.quant, "quantize", spy)
    path = write_run_config(
        tmp_path / "config.json",
        base=tiny_base("wan"),
        data=family_dataset("wan"),
        family="wan",
        base_quantization="int8",
        text_encoder_quantization="int8",
        max_train_steps=1,
        checkpointing_steps=0,
        num_frames=5,
    )
    cfg = load_config(path)
    rows: list[dict] = []
    state = prep.prepare(cfg, callbacks=[rows.append])
    assert ("UMT5EncoderModel", "int8") in calls
    assert state.comps.text_encoders == []
    plain = get_family("wan", cfg.replace(text_encoder_quantization="none"))
    assert state.comps.identity["text"] != plain.identity(str(tiny_base("wan")))["text"]
    fit(state)
    losses = [r["loss"] for r in rows if r.get("kind") == "step"]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)
