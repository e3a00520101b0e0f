"""`blocks_to_swap`: swapped blocks train exactly as resident ones, their frozen weights really
leave and come back around each block's forward and backward, and what cannot swap is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kit.config import Config, load_config
from kit.data.buckets import epoch_batches
from kit.errors import ConfigError, KitError
from kit.families import get_family
from kit.families.base import frozen
from kit.methods import get_method
from kit.train.objective import denoising_loss
from kit.train.offload import BlockSwap, attached, block_swap, check_block_swap
from kit.train.prepare import prepare
from kit.train.step import micro_step
from tests.conftest import write_run_config

STEPS = 2
# More blocks than the shared tiny models have, so that some stay resident: flux 2 double +
# 3 single-stream blocks, wan 4.
LAYERS = {"flux": {"num_layers": 2, "num_single_layers": 3}, "wan": {"num_layers": 4}}


@pytest.fixture(scope="module")
def bases(tiny_base):
    """family name → (family, its Components with a deeper random-init denoiser)."""
    out = {}
    for name, layers in LAYERS.items():
        path = str(tiny_base(name))
        family = get_family(name, _cfg(name, path))
        comps = family.load(path, parts=("denoiser",))
        torch.manual_seed(1)
        comps.denoiser = type(comps.denoiser).from_config({**comps.denoiser.config, **layers})
        frozen(comps.denoiser)
        out[name] = (family, comps)
    return out


def _cfg(name: str, path: str, **fields) -> Config:
    return Config().replace(model_family=name, pretrained_model=path, lora_rank=4, **fields)


def _batch(name: str, config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Two samples of made-up latents and text embeddings of the denoiser's sizes."""
    if name == "flux":
        return {
            "latents": torch.randn(2, 16, 8, 8, generator=generator),
            "prompt_embeds": torch.randn(2, 7, config.joint_attention_dim, generator=generator),
            "pooled_prompt_embeds": torch.randn(
                2, config.pooled_projection_dim, generator=generator
            ),
        }
    return {
        "latents": torch.randn(2, config.in_channels, 3, 8, 8, generator=generator),
        "prompt_embeds": torch.randn(2, 7, config.text_dim, generator=generator),
    }


def _poison(blocks: list[nn.Module], swapped: list[int]):
    """A `to_device` that copies from clean weights, then NaN in place of every stored one:
    any computation that reads a swapped weight while it is stored comes out NaN."""
    clean = {}
    for i in swapped:
        for p in blocks[i].parameters():
            if not p.requires_grad:
                clean[p.data_ptr()] = p.data.clone()

    def to_device(host: torch.Tensor) -> torch.Tensor:
        return clean[host.data_ptr()].clone()

    def spoil() -> None:
        for i in swapped:
            for p in blocks[i].parameters():
                if not p.requires_grad:
                    p.data.fill_(float("nan"))

    return to_device, spoil


def _train(bases, name: str, n: int = 0, checkpointing: bool = False, prefetch: bool = True):
    """Train a LoRA for STEPS steps; the losses, the trained weights and the swap (if any)."""
    family, base = bases[name]
    comps = copy.copy(base)
    comps.denoiser = copy.deepcopy(base.denoiser)
    method = get_method(family.cfg, family)
    torch.manual_seed(0)
    method.attach(comps)
    params = [p for g in method.param_groups(comps) for p in g["params"]]
    if checkpointing:
        comps.denoiser.enable_gradient_checkpointing()
    comps.denoiser.train()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    swap = None
    if n:
        blocks = family.swap_blocks(comps.denoiser)
        swapped = list(range(len(blocks) - n, len(blocks)))
        to_device, spoil = _poison(blocks, swapped)
        swap = BlockSwap(blocks, n, "cpu", prefetch=prefetch, to_device=to_device)
        spoil()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        loss = denoising_loss(family, comps, _batch(name, comps.denoiser.config, g), g, "cpu")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in params], swap


_REFERENCE: dict[str, tuple] = {}


def _reference(bases, name: str):
    if name not in _REFERENCE:
        _REFERENCE[name] = _train(bases, name)[:2]
    return _REFERENCE[name]


@pytest.mark.parametrize(
    "name, n, checkpointing, prefetch",
    [
        ("flux", 3, False, True),
        ("flux", 5, True, False),
        ("wan", 4, True, True),
        ("wan", 2, False, False),
    ],
)
def test_swapped_training_equals_resident_training(bases, name, n, checkpointing, prefetch):
    ref_losses, ref_params = _reference(bases, name)
    losses, params, swap = _train(bases, name, n, checkpointing, prefetch)
    # Every stored weight is NaN: equal losses and weights mean no forward, recompute or
    # backward ever read one.
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    # Each swapped block came in once per forward and once per backward; a recompute under
    # checkpointing found it already there; the resident blocks were never touched.
    resident = [0] * (len(swap.blocks) - n)
    assert swap.forward_loads == resident + [STEPS] * n
    assert swap.backward_loads == resident + [STEPS] * n
    assert sum(swap.recompute_loads) == 0
    assert swap.resident() == []  # nothing left on the device after the backward
    assert swap.bytes_to_device == 2 * STEPS * swap.stored_bytes
    assert swap.peak_resident == (2 if prefetch else 1)
    # With prefetch every load but the first of each pass started ahead; the forward's first
    # one too, when a resident block runs before it.
    ahead = (n - 1) * 2 + (n < len(swap.blocks))
    assert swap.prefetched == (STEPS * ahead if prefetch else 0)
    # The adapter's own weights stayed where they were: trained, and never stored.
    lora = [p for b in swap.blocks for p in b.parameters() if p.requires_grad]
    assert lora and not any(torch.isnan(p).any() for p in lora)


def test_between_blocks_the_swapped_weights_are_the_stored_ones(bases):
    """Watch every swapped block's frozen weights at each block's forward and backward: only
    the block that runs holds a copy; every other one holds its stored tensor."""
    family, base = bases["wan"]
    comps = copy.copy(base)
    comps.denoiser = copy.deepcopy(base.denoiser)
    method = get_method(family.cfg, family)
    method.attach(comps)
    blocks = family.swap_blocks(comps.denoiser)
    swap = BlockSwap(blocks, 3, "cpu", prefetch=False, to_device=torch.clone)
    stored = {
        i: [p.data_ptr() for p in blocks[i].parameters() if not p.requires_grad]
        for i in swap.swapped
    }
    seen: list[tuple[str, int]] = []

    def check(phase: str, running: int) -> None:
        seen.append((phase, running))
        for i, ptrs in stored.items():
            now = [p.data_ptr() for p in blocks[i].parameters() if not p.requires_grad]
            if i == running:
                assert not set(now) & set(ptrs), f"{phase} of block {i} without its copy"
            else:
                assert now == ptrs, f"block {i} held a copy during the {phase} of {running}"

    def watch(i: int):
        # Registered after the swap's own hooks, so these see what the swap did.
        def before(module, args):
            check("forward", i)

        def after(module, args, output):
            if output.requires_grad:
                output.register_hook(lambda grad: check("backward", i))

        blocks[i].register_forward_pre_hook(before)
        blocks[i].register_forward_hook(after)

    for i in range(len(blocks)):
        watch(i)
    g = torch.Generator().manual_seed(0)
    denoising_loss(family, comps, _batch("wan", comps.denoiser.config, g), g, "cpu").backward()
    check("end", -1)
    # Every block ran forward in order and backward in reverse.
    assert seen == [("forward", i) for i in range(4)] + [
        ("backward", i) for i in reversed(range(4))
    ] + [("end", -1)]
    # No grad: the blocks come and go for the forward only (what sampling does).
    with torch.no_grad():
        denoising_loss(family, comps, _batch("wan", comps.denoiser.config, g), g, "cpu")
    assert swap.forward_loads == [0, 2, 2, 2] and swap.backward_loads == [0, 1, 1, 1]
    swap.remove()
    assert swap.resident() == swap.swapped


def test_each_transformer_family_lists_its_blocks_in_run_order(bases, tiny_base):
    flux = bases["flux"][1].denoiser
    assert bases["flux"][0].swap_blocks(flux) == [
        *flux.transformer_blocks,
        *flux.single_transformer_blocks,
    ]
    wan = bases["wan"][1].denoiser
    assert bases["wan"][0].swap_blocks(wan) == list(wan.blocks)
    sd3 = get_family("sd3")
    denoiser = sd3.load(str(tiny_base("sd3")), parts=("denoiser",)).denoiser
    assert sd3.swap_blocks(denoiser) == list(denoiser.transformer_blocks)


# ---------------------------------------------------------------- refusals


def test_refusals_name_the_reason(bases, tiny_base):
    family, comps = bases["flux"]  # 5 blocks
    lora = get_method(family.cfg, family)
    too_many = _cfg("flux", "x", blocks_to_swap=6)
    with pytest.raises(KitError, match=r"blocks_to_swap: 6 .* 5 transformer blocks .* at most 5"):
        check_block_swap(too_many, family, lora, comps.denoiser)
    assert len(check_block_swap(_cfg("flux", "x", blocks_to_swap=5), family, lora, comps.denoiser))
    assert check_block_swap(_cfg("flux", "x"), family, lora, comps.denoiser) == []
    with pytest.raises(ConfigError, match="blocks_to_swap: -1"):
        check_block_swap(_cfg("flux", "x", blocks_to_swap=-1), family, lora, comps.denoiser)
    full_cfg = _cfg("flux", "x", blocks_to_swap=1, network_type="full")
    with pytest.raises(KitError, match="network_type full trains every weight"):
        check_block_swap(full_cfg, family, get_method(full_cfg, family), comps.denoiser)
    quantized = _cfg("flux", "x", blocks_to_swap=1, base_quantization="int8")
    with pytest.raises(KitError, match="blocks_to_swap: 1 with base_quantization: int8"):
        check_block_swap(quantized, family, lora, comps.denoiser)
    sd15 = get_family("sd15")
    with pytest.raises(KitError, match="the sd15 denoiser has no stack of transformer blocks"):
        sd15.swap_blocks(nn.Module())
    with pytest.raises(KitError, match="between 1 and the 5 blocks"):
        BlockSwap(family.swap_blocks(comps.denoiser), 6, "cpu")


def test_a_run_refuses_a_unet_before_caching(tmp_path, tiny_base, family_dataset):
    path = write_run_config(
        tmp_path / "c.json", base=tiny_base("sd15"), data=family_dataset("sd15"), blocks_to_swap=2
    )
    with pytest.raises(KitError, match="sd15 denoiser has no stack"):
        prepare(load_config(path))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


# ---------------------------------------------------------------- a real run


def test_a_run_with_swapped_blocks_trains_as_one_without(tmp_path, tiny_base, family_dataset):
    """Through `prepare` and `micro_step`: the config key swaps the tiny flux's last block,
    gradient checkpointing on, and the run's losses and weights are the unswapped run's."""
    runs = {}
    for n in (0, 1):
        path = write_run_config(
            tmp_path / f"c{n}.json",
            base=tiny_base("flux"),
            data=family_dataset("flux"),
            family="flux",
            output_dir=str(tmp_path / f"run{n}"),
            blocks_to_swap=n,
            gradient_checkpointing=True,
        )
        s = prepare(load_config(path))
        batches = epoch_batches(s.data.plan, 2, s.cfg.train.seed, 0, 1)
        losses = [micro_step(s, batches[i], i)[0] for i in range(2)]
        runs[n] = (losses, [p.detach().clone() for p in s.params], attached(s.denoiser))
    (ref, ref_params, none), (got, params, swap) = runs[0], runs[1]
    assert none is None and swap is not None
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert swap.swapped == [1] and swap.forward_loads == [0, 2] and swap.backward_loads == [0, 2]


def test_block_swap_is_none_without_the_key(bases):
    family, comps = bases["wan"]
    lora = get_method(family.cfg, family)
    assert block_swap(family.cfg, family, lora, comps.denoiser, "cpu") is None
    assert attached(comps.denoiser) is None
