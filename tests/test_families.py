"""One contract suite, run over every registered model family on its tiny offline copy.

A new family passes by adding its file under kit/families/; nothing here names a family.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers.modular_pipelines import ModularPipeline
from safetensors.torch import load_file

from kit.config import load_config
from kit.export.writer import export
from kit.families import family_names, get_family
from kit.run import checkpoint as ckpt
from kit.train.loop import train
from tests.conftest import short_clips, write_run_config

FAMILIES = family_names()

# Plain diffusers, no kit: redraw a validation sample from its sidecar and an exported file.
REPRODUCE = textwrap.dedent(
    """
    import json, sys
    import diffusers, numpy as np, torch
    from PIL import Image

    sidecar, lora = sys.argv[1], sys.argv[2]
    spec = json.load(open(sidecar))
    pipe = getattr(diffusers, spec["pipeline"]).from_pretrained(spec["base_model"], **spec.get("pipeline_kwargs", {}))
    pipe.load_lora_weights(lora)
    kwargs = spec["call_kwargs"]
    named = kwargs.get("image")  # an edit model's control(s), named by file
    if isinstance(named, str):
        kwargs["image"] = Image.open(named).convert("RGB")
    elif isinstance(named, list):
        kwargs["image"] = [Image.open(f).convert("RGB") for f in named]
    out = pipe(**kwargs, generator=torch.Generator(spec["generator_device"]).manual_seed(spec["seed"]))
    if hasattr(out, "frames"):
        frames = [Image.fromarray((np.asarray(f) * 255).round().astype("uint8")) if not isinstance(f, Image.Image) else f for f in out.frames[0]]
    else:
        frames = [out.images[0]]
    w, h = frames[0].size
    strip = Image.new("RGB", (w * len(frames), h))
    for i, f in enumerate(frames):
        strip.paste(f, (i * w, 0))
    kits = np.asarray(Image.open(sidecar[: -len(".json")] + ".png").convert("RGB"), dtype=int)
    print(int(np.abs(np.asarray(strip, dtype=int) - kits).max()))
    """
)


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory, tiny_base, family_dataset):
    """Per family: a tiny base, the session's few samples of its kind (four images or clips:
    two batches, so the four steps see every sample twice), and a config for a short run."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    base = tiny_base(name)
    fields = {
        "family": name,
        "base": base,
        "data": family_dataset(name),
        "cache_dir": str(tmp / "cache"),
        "trigger_words": ["zorbstar"],
        **short_clips(name),
        "lora_alpha": 2,
        "learning_rate": 1e-2,
        "validation_prompt": ["a large red zorbstar"],
        "validation_seeds": [3],
        "validation_guidance_scale": 3.0,
    }
    return name, tmp, fields


def _config(tmp, fields, run: str, **overrides):
    path = write_run_config(
        tmp / f"{run}.json", **{**fields, "output_dir": str(tmp / run), **overrides}
    )
    return load_config(path)


def test_tiny_model_loads_with_its_pipeline_class(family_run):
    import diffusers

    name, tmp, fields = family_run
    family = get_family(name, _config(tmp, fields, "load"))  # told its base, as a run is
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(
        str(fields["base"]), **family.pipeline_kwargs
    )
    assert type(pipe).__name__ == family.pipeline_class
    comps = family.load(str(fields["base"]))
    assert comps.identity and all(comps.identity.values())
    tokenizers = family.load_tokenizers(str(fields["base"]))
    assert len(tokenizers) == len(comps.text_encoders)


@pytest.mark.slow
def test_trains_resumes_exports_and_reproduces(family_run):
    name, tmp, fields = family_run
    straight = train(_config(tmp, fields, "straight"))
    assert straight.step == 4
    rows = [json.loads(x) for x in (tmp / "straight/logs/metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    weights = load_file(str(ckpt.checkpoint_dir(tmp / "straight", 4) / ckpt.ADAPTER_FILE))
    assert any("lora_B" in k and w.abs().sum() > 0 for k, w in weights.items()), "adapter unchanged"

    # 2 steps, stop, resume, 2 more: the same adapter, bit for bit.
    split = _config(tmp, fields, "split")
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    resumed = load_file(str(ckpt.checkpoint_dir(tmp / "split", 4) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)

    family = get_family(name)
    for fmt in family.export_formats:
        result = export(tmp / "straight", fmt)
        assert result.verification.passed, (fmt, result.verification)

    if issubclass(family.pipeline_type(), ModularPipeline):
        # A modular pipeline's `from_pretrained` loads no parts and its processor spec needs
        # torchvision: its redraw is the export check's (the blocks over the base's parts).
        return
    lora = tmp / "straight/exports/diffusers/pytorch_lora_weights.safetensors"
    sidecar = next((tmp / "straight/validation/step-000004").glob("*.json"))
    out = subprocess.run(
        [sys.executable, "-c", REPRODUCE, str(sidecar), str(lora)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) <= 2


def test_memory_estimate_traces_the_architecture(family_run):
    from kit.preflight.estimate import estimate

    name, tmp, fields = family_run
    est = estimate(_config(tmp, fields, "estimate"))
    assert est.components["activations"] > 0
    assert est.components["denoiser_weights"] > 0
    assert est.settings["trainable_params"] > 0
    bigger = estimate(_config(tmp, fields, "estimate"), resolution=128)
    assert bigger.components["activations"] > est.components["activations"]


def test_token_counts_per_text_encoder(family_run):
    from kit.data.captions import caption_report

    name, tmp, fields = family_run
    rep = caption_report(_config(tmp, fields, "captions"))
    tokens = rep["tokens"]
    assert set(tokens) == set(get_family(name).load_tokenizers(str(fields["base"])))
    for per_encoder in tokens.values():
        assert per_encoder["max"] > 0 and per_encoder["truncated"] == 0
