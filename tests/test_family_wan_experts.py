"""Wan 2.2 A14B's two experts on a tiny two-expert base: routing, draws, training, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kit.config import Config
from kit.errors import ConfigError
from kit.families import get_family
from kit.families.wan.experts import WanExperts


@pytest.fixture(scope="module")
def experts_base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-wan22"
    wan = get_family("wan")
    return wan.make_tiny(out, seed=0, variant=wan.variants[1])


def wan22(base: Path, **fields):
    return get_family(
        "wan", Config().replace(pretrained_model=str(base), max_sequence_length=16, **fields)
    )


def recorder(module: torch.nn.Module, name: str, calls: list):
    """Record every forward of `module` as (name, its keyword arguments)."""

    def hook(_, args, kwargs):
        calls.append((name, dict(kwargs)))

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def test_training_inputs_and_expert_equal_the_pipelines(experts_base):
    from diffusers import WanPipeline

    wan = wan22(experts_base)
    comps = wan.load(str(experts_base))
    assert isinstance(comps.denoiser, WanExperts)
    pipe = WanPipeline.from_pretrained(str(experts_base))
    assert pipe.config.boundary_ratio == 0.875
    seen_pipe: list = []
    for name, part in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        recorder(part, name, seen_pipe)
    seen_kit: list = []
    for name in ("high", "low"):
        recorder(comps.denoiser.expert(name), name, seen_kit)
    # The same weights in both: the kit's experts are the pipeline's.
    for name, part in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        ours = comps.denoiser.expert(name).state_dict()
        assert all(torch.equal(v, ours[k]) for k, v in part.state_dict().items())

    prompt = "a large red zorbic moving right"
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pipe(
            prompt=prompt,
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=6,
            guidance_scale=1.0,  # one forward per step: the conditional one training makes
            latents=latents,
            max_sequence_length=16,
            output_type="latent",
        )
    experts_used = [name for name, _ in seen_pipe]
    assert "high" in experts_used and "low" in experts_used  # the steps cross the boundary
    cond = wan.encode_text(comps, [prompt])
    for name, theirs in seen_pipe:
        seen_kit.clear()
        with torch.no_grad():
            wan.predict(comps, theirs["hidden_states"], theirs["timestep"], cond)
        ((expert, ours),) = seen_kit
        assert expert == name  # the expert the pipeline runs at this timestep
        for key in ("hidden_states", "timestep", "encoder_hidden_states"):
            assert torch.equal(ours[key], theirs[key]), key
        assert theirs.get("encoder_hidden_states_image") is None


def test_one_expert_draws_only_its_timesteps(experts_base):
    latents = torch.zeros(4, 16, 2, 4, 4)
    boundary = 0.875 * 1000
    for setting, side in (("high", lambda t: t >= boundary), ("low", lambda t: t < boundary)):
        wan = wan22(experts_base, train_experts=setting)
        comps = wan.load(str(experts_base))
        assert comps.denoiser.trained == (setting,)
        names = {n.split(".")[0] for n, p in comps.denoiser.named_parameters()}
        assert names == {setting}  # the other expert is held beside, never adapted
        g = torch.Generator().manual_seed(0)
        steps = torch.cat([wan.noise_and_target(comps, latents, g).timesteps for _ in range(50)])
        assert bool(side(steps).all())
    # Both: each batch on one side, and the sides as often as the distribution puts them there.
    wan = wan22(experts_base, train_experts="both", timestep_sampling="uniform")
    comps = wan.load(str(experts_base))
    g = torch.Generator().manual_seed(0)
    draws = [wan.noise_and_target(comps, latents, g).timesteps for _ in range(400)]
    assert all(len({bool(t >= boundary) for t in d}) == 1 for d in draws)
    high = sum(bool(d[0] >= boundary) for d in draws) / len(draws)
    # Uniform u shifted by 3: σ >= 0.875 where u >= 0.875 / (3 - 2 · 0.875) = 0.7.
    assert abs(high - 0.3) < 0.07


def test_what_two_experts_do_not_do_yet_is_refused(experts_base, monkeypatch):
    from kit.errors import KitError
    from kit.methods import get_method

    wan = wan22(experts_base, base_quantization="int8")
    assert get_method(wan.cfg, wan).quantization_refusal("int8") is None  # both stored int8
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KitError, match="two experts train on one process"):
        wan22(experts_base).load(str(experts_base))


def test_train_experts_is_refused_for_one_transformer(tiny_base):
    base = tiny_base("wan")
    wan = get_family("wan", Config().replace(pretrained_model=str(base), train_experts="high"))
    with pytest.raises(ConfigError, match="train_experts: high.*one transformer"):
        wan.identity(str(base))
    with pytest.raises(ConfigError, match="train_experts"):
        Config().replace(train_experts="middle")


@pytest.fixture(scope="module")
def experts_run(tmp_path_factory, experts_base, family_dataset):
    """A straight run training both experts, and the fields to repeat it."""
    from kit.config import load_config
    from kit.train.loop import train
    from tests.conftest import write_run_config

    tmp = tmp_path_factory.mktemp("wan22run")
    fields = {
        "family": "wan",
        "base": experts_base,
        "data": family_dataset("wan"),
        "cache_dir": str(tmp / "cache"),
        "num_frames": 5,
        "max_sequence_length": 16,
        "train_experts": "both",
        "timestep_sampling": "uniform",
        "max_train_steps": 6,
        "checkpointing_steps": 3,
        "validation_prompt": ["a large red zorbstar"],
        "validation_seeds": [3],
    }

    def config(run: str, **overrides):
        path = write_run_config(
            tmp / f"{run}.json", **{**fields, "output_dir": str(tmp / run), **overrides}
        )
        return load_config(path)

    result = train(config("straight"))
    return tmp, config, result


@pytest.mark.slow
def test_both_experts_train_and_resume_bit_for_bit(experts_run):
    from safetensors.torch import load_file

    from kit.run import checkpoint as ckpt
    from kit.train.loop import train

    tmp, config, straight = experts_run
    assert straight.step == 6 and len(straight.validation_grids) == 1
    weights = load_file(str(ckpt.checkpoint_dir(tmp / "straight", 6) / ckpt.ADAPTER_FILE))
    for expert in ("high", "low"):
        trained = [w for k, w in weights.items() if k.startswith(f"{expert}.") and "lora_B" in k]
        assert trained and any(w.abs().sum() > 0 for w in trained), expert
    # One optimizer holding both: each expert's parameters stepped only on its own steps
    # (AdamW skips a parameter without a gradient), so its moments are its own.
    state = torch.load(ckpt.checkpoint_dir(tmp / "straight", 6) / ckpt.OPTIMIZER_FILE)["state"]
    steps = [int(state[i]["step"]) if i in state else 0 for i in range(len(weights))]
    half = len(weights) // 2  # the high expert's parameters come first, as many as the low's
    high, low = set(steps[:half]), set(steps[half:])
    assert len(high) == len(low) == 1 and min(*high, *low) > 0
    assert high.pop() + low.pop() == 6  # every step trained exactly one expert
    # 3 steps, stop, resume, 3 more: both adapters and the optimizer's state, bit for bit.
    split = config("split")
    train(split.replace(max_train_steps=3))
    train(split, resume="latest")
    resumed = load_file(str(ckpt.checkpoint_dir(tmp / "split", 6) / ckpt.ADAPTER_FILE))
    assert weights.keys() == resumed.keys()
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_exports_one_file_per_expert_that_loads_into_it(experts_run, experts_base):
    from diffusers import WanPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kit.export.writer import export
    from kit.run import checkpoint as ckpt

    tmp, _, _ = experts_run
    result = export(tmp / "straight", "diffusers")
    # Redrawn by plain diffusers with both files loaded: the kit's validation clip.
    assert result.verification.passed and result.verification.images == 1
    files = result.files
    assert {k: p.name for k, p in files.items()} == {
        "high_noise": "pytorch_lora_weights_high_noise.safetensors",
        "low_noise": "pytorch_lora_weights_low_noise.safetensors",
    }
    for part, path in files.items():
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["kit.expert"] == part
            assert all(k.startswith("transformer.blocks.") for k in f.keys())

    # diffusers' own loader: the high-noise file into `transformer`, the low-noise one into
    # `transformer_2`; fused, each expert's weights are its trained adapter's merge.
    pipe = WanPipeline.from_pretrained(str(experts_base))
    experts = {"high": pipe.transformer, "low": pipe.transformer_2}
    before = {e: {k: v.clone() for k, v in m.state_dict().items()} for e, m in experts.items()}
    pipe.load_lora_weights(str(files["high_noise"].parent), weight_name=files["high_noise"].name)
    pipe.load_lora_weights(
        str(files["low_noise"].parent),
        weight_name=files["low_noise"].name,
        load_into_transformer_2=True,
    )
    pipe.fuse_lora(components=["transformer", "transformer_2"])
    pipe.unload_lora_weights()
    trained = load_file(str(ckpt.checkpoint_dir(tmp / "straight", 6) / ckpt.ADAPTER_FILE))
    want = {e: dict(w) for e, w in before.items()}
    for key, a in trained.items():
        if ".lora_A." in key:
            expert, _, name = key.partition(".")
            weight = name.replace(".lora_A.weight", ".weight")
            want[expert][weight] = want[expert][weight] + trained[key.replace("_A.", "_B.")] @ a
    for expert, model in experts.items():
        got = model.state_dict()
        assert got.keys() == want[expert].keys()
        for k, v in got.items():
            assert torch.allclose(v, want[expert][k], atol=1e-6), (expert, k)
        changed = [k for k in got if not torch.equal(got[k], before[expert][k])]
        assert len(changed) == 2 * 2 * 4  # q, k, v, out of both attentions in both blocks

    # ComfyUI's names, checked as every Wan export is: each expert's file on its expert.
    kohya = export(tmp / "straight", "kohya")
    assert kohya.verification.passed
    clients = {(c["client"], c["part"]): c for c in kohya.verification.clients}
    assert set(clients) == {("ComfyUI", "high_noise"), ("ComfyUI", "low_noise")}
    assert all(c["exact"] and c["weights"] > 0 for c in clients.values())
    assert kohya.verification.describe().startswith("verified")
    boundary = {"high_noise": "875,1000", "low_noise": "0,875"}
    for part, path in kohya.files.items():
        assert path.name.endswith(f"_{part}.safetensors")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            assert any(k.startswith("lora_unet_blocks_0_self_attn_q.") for k in f.keys())
        assert meta["kit.expert"] == part and meta["modelspec.timestep_range"] == boundary[part]
        assert meta["ss_base_model_version"] == "wan_2.2_14b"
        assert meta["modelspec.architecture"] == "wan2.2-t2v-a14b/lora"
        # Its own record: its expert's check only, and the client on that expert alone.
        other = "low-noise" if part == "high_noise" else "high-noise"
        for record in (
            json.loads(path.with_suffix(".verify.json").read_text()),
            kohya.verifications[part].__dict__,
        ):
            assert record["part"] == part and [c["part"] for c in record["clients"]] == [part]
            assert len(record["use_in"]) == 1 and record["use_in"][0].startswith("ComfyUI on ")
            assert (
                part.replace("_", "-") in record["use_in"][0] and other not in record["use_in"][0]
            )
        assert kohya.verifications[part].describe().startswith("verified")

    # The model card: each file's row names its own expert; ComfyUI's steps put each file on
    # its expert's model; diffusers loads the low-noise file into transformer_2; no A1111.
    from kit.config import load_config
    from kit.export.card import model_card
    from kit.run.folder import RunDir

    run = RunDir(tmp / "straight")
    names = {fmt: [p.name for p in r.files.values()] for fmt, r in (("diffusers", result),)}
    names["kohya"] = [p.name for p in kohya.files.values()]
    card = model_card(run, load_config(run.config), names, None)
    for part, other in (("high_noise", "low-noise"), ("low_noise", "high-noise")):
        rows = [line for line in card.splitlines() if line.startswith("| `") and part in line]
        assert len(rows) == 2 and all(other not in r for r in rows), rows
        (usage,) = [line for line in card.splitlines() if line.startswith("- `") and part in line]
        assert f"the {part.replace('_', '-')} expert" in usage and other not in usage
    assert "## Use it in ComfyUI\n" in card and "<lora:" not in card and "AUTOMATIC1111" not in card
    assert "load_into_transformer_2=True)" in card


def test_an_expert_no_batch_drew_is_called_untrained(experts_run, capsys):
    """One step of `both` trains one expert: the other's adapter ends at its initial value.
    Training, the doctor, the export's records and the card say so, with the batches drawn."""
    from kit.export.card import file_use
    from kit.export.writer import export
    from kit.run import checkpoint as ckpt
    from kit.run.folder import RunDir
    from kit.train.loop import train

    tmp, config, _ = experts_run
    capsys.readouterr()
    train(config("one", max_train_steps=1, checkpointing_steps=1))
    printed = capsys.readouterr().out
    run = RunDir(tmp / "one")
    drawn = json.loads((ckpt.checkpoint_dir(run.root, 1) / ckpt.PROGRESS_FILE).read_text())
    ((drew, batches),) = drawn["drawn"].items()
    idle = "low_noise" if drew == "high_noise" else "high_noise"
    assert batches == 1
    assert f"the {idle} adapter is still at its initial value at step 1" in printed
    doctor = json.loads(run.doctor_report.read_text())["findings"]
    (finding,) = [f for f in doctor if f["code"] == "untrained_part"]
    assert finding["severity"] == "warning" and idle in finding["title"]
    assert (
        f"batches each part drew: high_noise {int(drew == 'high_noise')}" in finding["evidence"][0]
    )
    kohya = export(run.root, "kohya")
    described = kohya.verifications[idle].describe()
    assert described.startswith("UNTRAINED:") and "drew 0 batches" in described
    assert kohya.verifications[drew].describe().startswith("verified")
    assert json.loads(kohya.files[idle].with_suffix(".verify.json").read_text())["untrained"]
    assert file_use(run, "kohya", kohya.files[idle].name).startswith("UNTRAINED")
    assert not file_use(run, "kohya", kohya.files[drew].name).startswith("UNTRAINED")
    # Written again without its check, a file keeps no earlier file's record.
    export(run.root, "kohya", verify=False)
    assert not kohya.files[idle].with_suffix(".verify.json").exists()
    assert file_use(run, "kohya", kohya.files[idle].name).startswith("not checked")


@pytest.mark.slow
def test_quantized_experts_train_resume_and_export(experts_run):
    """base_quantization with two experts: both experts' frozen Linear layers stored int8 (the
    held one too), the adapters on the quantized layers; resume bit for bit; two files."""
    from safetensors.torch import load_file

    from kit.export.writer import export
    from kit.families.wan.experts import _quantized_layers
    from kit.run import checkpoint as ckpt
    from kit.train.loop import fit, train
    from kit.train.prepare import prepare

    tmp, config, _ = experts_run
    fields = {"base_quantization": "int8", "max_train_steps": 4, "checkpointing_steps": 2}
    s = prepare(config("int8", **fields))
    experts = s.comps.denoiser
    for name in ("high", "low"):
        quantized = _quantized_layers(experts.expert(name))
        assert len(quantized) == 2 * 10  # attentions (4 + 4) and feed-forward (2) of 2 blocks
        wrapped = [m for m in experts.expert(name).modules() if hasattr(m, "lora_A")]
        assert wrapped and all(type(m.base_layer) is type(quantized[0]) for m in wrapped)
    assert fit(s).step == 4
    weights = load_file(str(ckpt.checkpoint_dir(tmp / "int8", 4) / ckpt.ADAPTER_FILE))
    assert {k.split(".")[0] for k in weights} == {"high", "low"}
    split = config("int8_split", **fields)
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    resumed = load_file(str(ckpt.checkpoint_dir(tmp / "int8_split", 4) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    out = export(tmp / "int8", "diffusers", verify=False)
    assert sorted(out.files) == ["high_noise", "low_noise"]


def test_quantized_expert_moves_as_its_library_tensor(experts_base):
    """`place` moves a quantized layer through its module (codes and scales together)."""
    from kit.families import quantize as quant
    from kit.families.wan.experts import _quantized_layers

    # Training one expert, the held one is stored quantized too (validation draws with it).
    held = wan22(experts_base, train_experts="high").load(str(experts_base)).denoiser
    report = quant.quantize(held, "int8", device="cpu")
    assert {n.split(".")[0] for n in report.layers} == {"high", "low"}
    assert _quantized_layers(held.expert("low"))

    experts = wan22(experts_base).load(str(experts_base)).denoiser
    quant.quantize(experts, "int8", device="cpu")
    moved: list[tuple[type, str]] = []

    def move(t, device):
        moved.append((type(t), device.type))
        return t

    experts.move = move
    experts.place("low", torch.device("cuda"))
    kinds = {k for k, _ in moved}
    assert type(_quantized_layers(experts.low)[0].weight) in kinds
    assert ("cuda" in {d for _, d in moved}) and ("cpu" in {d for _, d in moved})
    assert experts.active == "low"


@pytest.mark.slow
def test_estimate_holds_one_expert_on_the_gpu_and_both_in_host_ram(module_trace_cache):
    from kit.preflight.estimate import estimate

    gib = 2**30
    runs = {}
    for setting in ("both", "high"):
        cfg = Config().replace(
            model_family="wan",
            pretrained_model="Wan-AI/Wan2.2-T2V-A14B-Diffusers",  # the shipped configs
            train_experts=setting,
            resolution=480,
            num_frames=17,
            mixed_precision="bf16",
            gradient_checkpointing=True,
        )
        runs[setting] = e = estimate(cfg)
        # One 14.3B expert in bf16 on the GPU; the other waits in host RAM, named in a note.
        assert 26 < e.components["denoiser_weights"] / gib < 27.5, setting
        waiting = [n for n in e.notes if "waits in host RAM" in n]
        assert len(waiting) == 1 and "26.61 GiB" in waiting[0]
        # Loading reads both experts (and the T5) into host RAM before one goes to the GPU.
        assert e.host_bytes / gib > 2 * 26.6
    assert "change places" in next(n for n in runs["both"].notes if "waits" in n)
    assert "untrained low-noise expert" in next(n for n in runs["high"].notes if "waits" in n)
    # Both adapters train (their weights and optimizer state count), one expert's activations.
    both, high = (runs[k].components for k in ("both", "high"))
    assert both["trainable_weights"] == 2 * high["trainable_weights"]
    assert both["activations"] == high["activations"]
    # Quantized: both experts stored so, the one on the GPU and the one in host RAM; the load
    # still reads both in bf16 (they are quantized once loaded).
    for kind, size in (("int8", 13.53), ("nf4", 7.19)):
        e = estimate(cfg.replace(train_experts="both", base_quantization=kind))
        assert abs(e.components["denoiser_weights"] / gib - size) < 0.01, kind
        waiting = next(n for n in e.notes if "waits in host RAM" in n)
        assert f"({size:.2f} GiB, stored {kind}" in waiting
        assert e.host_bytes / gib > 2 * 26.6


@pytest.mark.slow
def test_ti2v_5b_estimates_as_one_transformer(module_trace_cache):
    from kit.preflight.estimate import estimate

    cfg = Config().replace(
        model_family="wan",
        pretrained_model="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        resolution=480,
        num_frames=17,
        mixed_precision="bf16",
        gradient_checkpointing=True,
    )
    e = estimate(cfg)
    assert 9 < e.components["denoiser_weights"] / 2**30 < 9.7  # 5.0B parameters in bf16
    assert not [n for n in e.notes if "waits in host RAM" in n]
    with pytest.raises(ConfigError, match="train_experts: both.*one transformer"):
        estimate(cfg.replace(train_experts="both"))


def test_one_expert_at_a_time_on_the_accelerator(experts_base):
    """Which tensors `place` sends where (recorded: this machine has no accelerator)."""
    from peft import LoraConfig

    wan = wan22(experts_base)
    experts = wan.load(str(experts_base)).denoiser
    experts.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    where: dict[int, str] = {}  # by storage: the fake move leaves every tensor in place

    def move(t, device):
        where[t.data_ptr()] = device.type
        return t

    experts.move = move
    gpu = torch.device("cuda")

    def at(name, trained):
        module = experts.expert(name)
        tensors = [p for p in module.parameters() if p.requires_grad == trained]
        tensors += [] if trained else list(module.buffers())
        return {where.get(t.data_ptr(), "cpu") for t in tensors}

    assert experts.active == "high"
    experts.place("low", gpu)
    assert at("low", False) == at("low", True) == {"cuda"} and at("high", False) == {"cpu"}
    experts.place("high", gpu)
    assert at("high", False) == at("high", True) == {"cuda"}
    # The waiting expert's frozen weights leave; its adapter, once on the device, stays.
    assert at("low", False) == {"cpu"} and at("low", True) == {"cuda"}
    # WanPipeline calls the experts themselves: each places itself before its forward.
    experts.expert("low")(
        hidden_states=torch.zeros(1, 16, 1, 2, 2),
        timestep=torch.tensor([100.0]),
        encoder_hidden_states=torch.zeros(1, 4, 32),
    )
    assert experts.active == "low"
    # `.to(dtype)` while the base is placed: the waiting expert takes the dtype too.
    experts = wan.load(str(experts_base)).denoiser
    experts.to(dtype=torch.bfloat16)
    for name in ("high", "low"):
        assert {p.dtype for p in experts.expert(name).parameters()} == {torch.bfloat16}


def test_ti2v_timesteps_per_token_equal_the_pipelines(tmp_path):
    from diffusers import WanPipeline

    wan = get_family("wan")
    base = wan.make_tiny(tmp_path / "ti2v", seed=0, variant=wan.variants[2])
    assert wan.variant_of(str(base)) == wan.variants[2]
    wan = wan22(base)
    comps = wan.load(str(base))
    assert comps.vae.config.z_dim == 48 and not isinstance(comps.denoiser, WanExperts)
    assert wan.pipeline(comps).config.expand_timesteps  # validation draws as the pipeline does
    pipe = WanPipeline.from_pretrained(str(base))
    seen_pipe, seen_kit = [], []
    recorder(pipe.transformer, "t", seen_pipe)
    recorder(comps.denoiser, "t", seen_kit)
    prompt = "a large red zorbic"
    latents = torch.randn(1, 48, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pipe(prompt=prompt, height=64, width=96, num_frames=5, num_inference_steps=2,
             guidance_scale=1.0, latents=latents, max_sequence_length=16, output_type="latent")  # fmt: skip
    cond = wan.encode_text(comps, [prompt])
    assert len(seen_pipe) == 2
    for _, theirs in seen_pipe:
        assert theirs["timestep"].shape == (1, 2 * 2 * 3)  # frames × (h/2) × (w/2) tokens
        seen_kit.clear()
        with torch.no_grad():  # the kit's timesteps are one per sample, as drawn
            wan.predict(comps, theirs["hidden_states"], theirs["timestep"][:, 0], cond)
        ((_, ours),) = seen_kit
        for key in ("hidden_states", "timestep", "encoder_hidden_states"):
            assert torch.equal(ours[key], theirs[key]), key
    # Its validation clips play at 24 fps (the others' at 16), and their sidecars say so.
    import json

    from PIL import Image

    from kit.families.base import ImageSpec
    from kit.sample.validate import run_validation

    assert wan.clip_fps() == 24
    spec = ImageSpec(prompt, "", 0, 1, 1.0, 64, 96)
    run_validation(wan, wan.pipeline(comps), [spec], tmp_path / "val", cols=1, meta={})
    assert json.loads((tmp_path / "val" / "00_seed0.json").read_text())["fps"] == 24
    clip = Image.open(tmp_path / "val" / "00_seed0.webp")
    clip.seek(1)
    clip.load()
    assert clip.info["duration"] == round(1000 / 24)


def test_model_card_loads_each_expert_file_into_its_transformer(experts_base):
    from kit.export.card import diffusers_usage
    from kit.methods import get_method

    wan = wan22(experts_base)
    files = {
        "diffusers": [
            "pytorch_lora_weights_high_noise.safetensors",
            "pytorch_lora_weights_low_noise.safetensors",
        ]
    }
    code = diffusers_usage(wan, get_method(wan.cfg, wan), files, "me/lora", "base", "a zorbic")
    lines = [x for x in code.splitlines() if "load_lora_weights" in x]
    assert lines == [
        'pipe.load_lora_weights("me/lora", weight_name="pytorch_lora_weights_high_noise.safetensors")',
        'pipe.load_lora_weights("me/lora", weight_name="pytorch_lora_weights_low_noise.safetensors", '
        "load_into_transformer_2=True)",
    ]


def test_clips_play_at_the_models_own_frame_rate(tmp_path):
    """Wan 2.1 and 2.2 A14B at 16 fps, TI2V-5B at 24, as their released examples export."""
    from PIL import Image

    from kit.run.folder import RunDir
    from kit.sample.clips import index_run
    from kit.sample.validate import save_drawn

    rates = {
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 16,
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 16,
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": 24,
    }
    for hub_id, fps in rates.items():
        wan = get_family("wan", Config().replace(pretrained_model=hub_id))
        assert wan.clip_fps() == fps, hub_id
    frames = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(5)]
    save_drawn(frames, tmp_path / "a", 24)
    clip = Image.open(tmp_path / "a.webp")
    clip.seek(1)
    clip.load()  # a frame's timing is read with the frame
    assert clip.info["duration"] == round(1000 / 24)
    # The run's index says the rate the sidecars were written at.
    run = RunDir(tmp_path / "run")
    folder = run.validation_step(2)
    folder.mkdir(parents=True)
    save_drawn(frames, folder / "00_seed3", 24)
    Image.new("RGB", (8, 8)).save(folder / "grid.png")
    (folder / "00_seed3.json").write_text('{"prompt": "p", "seed": 3, "frames": 5, "fps": 24}')
    import json

    assert json.loads(index_run(run).read_text())["fps"] == 24


@pytest.mark.slow
def test_experts_swap_their_blocks_train_and_resume(experts_run):
    """blocks_to_swap with both experts: each expert's last block is swapped (hooks on both,
    counted), its frozen weights back in CPU memory between uses; resume bit for bit."""
    from safetensors.torch import load_file

    from kit.run import checkpoint as ckpt
    from kit.train.loop import fit, train
    from kit.train.offload import SwapGroup, attached
    from kit.train.prepare import prepare

    tmp, config, _ = experts_run
    fields = {"blocks_to_swap": 1, "max_train_steps": 4, "checkpointing_steps": 2}
    s = prepare(config("swap", **fields))
    experts = s.comps.denoiser
    swap = attached(experts)
    assert isinstance(swap, SwapGroup) and len(swap.swaps) == 2
    for one, name in zip(swap.swaps, ("high", "low"), strict=True):
        assert one.blocks[-1] is experts.expert(name).blocks[-1] and one.swapped == [1]
    stored = swap.stored_params()
    assert stored and stored == experts.swapped_params
    assert fit(s).step == 4
    for one in swap.swaps:
        # Brought in for every forward and backward of its expert (and validation), and
        # pointing at its CPU copy again after each.
        assert one.forward_loads[1] > 0 and one.resident() == []
        assert all(p.data.data_ptr() == host.data_ptr() for p, host in one._stored[1])
    # A change of places leaves the swapped weights to the swaps.
    moved: list[int] = []
    experts.move = lambda t, d: moved.append(t.data_ptr()) or t
    experts.place("low" if experts.active == "high" else "high", torch.device("cuda"))
    swapped_data = {host.data_ptr() for one in swap.swaps for _, host in one._stored[1]}
    assert moved and not swapped_data & set(moved)
    weights = load_file(str(ckpt.checkpoint_dir(tmp / "swap", 4) / ckpt.ADAPTER_FILE))
    split = config("swap_split", **fields)
    train(split.replace(max_train_steps=2))
    train(split, resume="latest")
    resumed = load_file(str(ckpt.checkpoint_dir(tmp / "swap_split", 4) / ckpt.ADAPTER_FILE))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
