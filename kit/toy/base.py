"""The toy base model: a small SD1.5-architecture pipeline trained from scratch on the toy world.

Run `python -m kit.toy.base models/toy-sd15` to rebuild the committed base. The recipe is this one
file, read top to bottom:

1. Data. The toy world at 64x64 px has exactly 324 distinct scenes (6 colors x 3 shapes x 2 sizes
   x 3 backgrounds x 3 positions), so every image is rendered once and kept in memory.
2. VAE (AutoencoderKL, 4x downscale, 4 latent channels) trained on reconstruction with a tiny KL
   weight, the shape's pixels weighted above the background's. Half of each batch is random
   polygons of random colors: a codec should code any flat shape in any color, so that a later
   fine-tune can teach a color (the pink `zorbic`) that the denoiser has never drawn. Trained on
   the six toy colors alone, it decoded every other color as the nearest of them.
   Three latent channels are also held to the image's colors (`vae_color_weight`), so that the
   latents are linear in color, as SD's nearly are: without it the VAE coded a color it had not
   seen in its first few hundred steps only after thousands, and brought the pink back pale
   (models/toy-sd15/RECIPE.md, "A deeper pink").
3. Text encoder (a 2-layer CLIP) and UNet trained together from scratch on the v objective
   with the original DDPM noise schedule (linear betas: almost no signal left at t = T, so a
   plain-white or plain-black image can be drawn from pure noise). Not epsilon: at high noise
   predicting the noise is nearly free (it is almost the input), so an epsilon model learns
   little where the layout is decided, and its samples ignore the prompt; v asks for the clean
   image there. 10% of captions are dropped to "" so classifier-free guidance works. An EMA of
   the weights is what gets saved. Each shape is painted in a color around its name rather
   than at it (`color_jitter`, `Recolor`), so that a color word names a region, as it does for
   a real base that has drawn many reds for "red".
4. The VAE's decoder alone trains a little more on the frozen encoder's latents (the UNet's
   latents stay valid), slightly noised so that it forgives the UNet's errors; half of its batch
   is random polygons too, so that it keeps every color.

Single-threaded torch (`OMP_NUM_THREADS=1`) ran it fastest on a shared 2-core machine.

The text encoder trains jointly rather than staying random: a random encoder mixes words through
its causal attention, and the UNet then has to untangle them; training it lets each word's token
carry its own meaning after a few minutes. Its token embeddings get no weight decay, so words the
toy world never uses (such as the letters of `zorbic`) keep the same scale as the rest.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import platform
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from kit.families import tiny
from kit.families.noise import ddpm_noise_and_target
from kit.io import atomic_dir, write_json
from kit.toy import world as toyworld

SIZE = 64
"""Side of the training images in pixels."""
BETAS = {"beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear"}
"""The original DDPM schedule (see the module docstring)."""
TOKENS = 32
"""Token slots per caption: the longest toy caption takes 25 with its start and end marks."""
RECIPE = {
    "seed": 0,
    "vae_steps": 4000,
    "vae_batch": 8,
    "vae_lr": 3e-3,
    "vae_kl_weight": 1e-6,
    "vae_color_weight": 1.0,
    "vae_polygon_share": 0.5,
    "unet_steps": 4000,
    "unet_batch": 24,
    "unet_lr": 1.5e-3,
    "warmup_steps": 50,
    "caption_dropout": 0.1,
    "color_jitter": 60.0,
    "color_hole": 80.0,
    "color_margin": 60.0,
    "decoder_steps": 300,
    "decoder_lr": 2e-3,
    "ema_decay": 0.995,
    "prediction_type": "v_prediction",
}
"""Every number that decides the result; `--vae-steps`, `--unet-steps`, `--decoder-steps` override
the step counts (for a quick try; the committed base uses these). `color_jitter` (RGB units,
0 = off) repaints the shapes the denoiser trains on in colors around their names (`Recolor`)."""


def scenes() -> list[toyworld.Scene]:
    """Every distinct scene of the toy world (no concept shapes)."""
    return [
        toyworld.Scene(color=c, shape=sh, size=si, background=b, position=p)
        for c, sh, si, b, p in itertools.product(
            toyworld.COLORS,
            toyworld.SHAPES,
            toyworld.SIZES,
            toyworld.BACKGROUNDS,
            toyworld.POSITIONS,
        )
    ]


def to_tensor(images: Sequence[Image.Image]) -> torch.Tensor:
    """RGB images as a float tensor in [-1, 1], shape (n, 3, h, w)."""
    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])
    return torch.from_numpy(arr).permute(0, 3, 1, 2) / 127.5 - 1.0


def random_polygon(rng: random.Random, size: int = SIZE) -> Image.Image:
    """A random flat polygon of a random color on a plain background (VAE training only)."""
    k = 4
    bg = rng.choice(list(toyworld.BACKGROUNDS.values()))
    image = Image.new("RGB", (size * k, size * k), bg)
    n = rng.randint(3, 12)
    cx, cy = rng.uniform(0.2, 0.8) * size * k, rng.uniform(0.3, 0.7) * size * k
    radius = rng.uniform(0.1, 0.35) * size * k
    angles = sorted(rng.uniform(0, 2 * math.pi) for _ in range(n))
    points = [
        (
            cx + radius * rng.uniform(0.3, 1.0) * math.cos(a),
            cy + radius * rng.uniform(0.3, 1.0) * math.sin(a),
        )
        for a in angles
    ]
    fill = tuple(rng.randrange(256) for _ in range(3))
    ImageDraw.Draw(image).polygon(points, fill=fill)
    return image.reduce(k)


class Recolor:
    """The world's scenes repainted in jittered shape colors, encoded as the denoiser's latents.

    Each shape's color is drawn uniformly from a ball of `radius` RGB units around its named
    color, kept only where the judge would still read that name, at least `RECIPE["color_hole"]`
    from every concept color (the base never draws anything near the pink a fine-tune teaches)
    and `RECIPE["color_margin"]` from every background (a shape stays visible). A color word then
    names a region of colors, as real words do, not one point.

    A flat shape on a flat background is `background * (1 - coverage) + fill * coverage`, so the
    coverage of each pixel is read back once from the rendered image, and any fill can be painted
    in exactly without rendering again.
    """

    CANDIDATES = 16
    """Colors drawn per shape; the first that keeps every rule is used (the named color if none)."""

    def __init__(self, world: Sequence[toyworld.Scene], images: torch.Tensor, vae, radius: float):
        pixels = (images + 1.0) * 127.5
        self.backgrounds = torch.tensor(
            [toyworld.BACKGROUNDS[s.background] for s in world], dtype=torch.float32
        )[:, :, None, None]
        self.fills = torch.tensor([toyworld.COLORS[s.color] for s in world], dtype=torch.float32)
        step = self.fills[:, :, None, None] - self.backgrounds
        coverage = ((pixels - self.backgrounds) * step).sum(1, keepdim=True) / (step**2).sum(
            1, keepdim=True
        )
        self.coverage = coverage.clamp(0, 1)
        self.names = torch.tensor(list(toyworld.COLORS.values()), dtype=torch.float32)
        self.label = torch.tensor([list(toyworld.COLORS).index(s.color) for s in world])
        # (colors, the least distance a jittered fill keeps from each of them)
        self.avoid = [
            (list(toyworld.CONCEPT_COLORS.values()), RECIPE["color_hole"]),
            (list(toyworld.BACKGROUNDS.values()), RECIPE["color_margin"]),
        ]
        self.vae, self.radius = vae, radius

    def jittered_fills(self, idx: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """The scenes' shape colors, each drawn from the ball around its name (class docstring)."""
        n, k = len(idx), self.CANDIDATES
        direction = F.normalize(torch.randn(n, k, 3, generator=g), dim=-1)
        length = self.radius * torch.rand(n, k, 1, generator=g) ** (1 / 3)
        fills = (self.fills[idx, None] + direction * length).clamp(0, 255)
        ok = torch.cdist(fills, self.names.expand(n, -1, -1)).argmin(-1) == self.label[idx, None]
        for colors, least in self.avoid:
            far = torch.tensor(colors, dtype=torch.float32).expand(n, -1, -1)
            ok &= torch.cdist(fills, far).amin(-1) >= least
        # The named color itself, appended last, keeps every rule.
        fills = torch.cat([fills, self.fills[idx, None]], dim=1)
        ok = torch.cat([ok, torch.ones(n, 1, dtype=torch.bool)], dim=1)
        first = ok.float().argmax(dim=1)
        return fills[torch.arange(n), first]

    def paint(self, idx: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """The scenes `idx` with their shapes in `fill` (RGB 0-255, one per scene), in [-1, 1]."""
        cover = self.coverage[idx]
        x = self.backgrounds[idx] * (1 - cover) + fill[:, :, None, None] * cover
        return x / 127.5 - 1

    def latents(self, idx: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """Scaled latents of the scenes `idx`, each shape in a jittered color."""
        x = self.paint(idx, self.jittered_fills(idx, g))
        with torch.no_grad():
            z = self.vae.encode(x).latent_dist.mean
        return z * self.vae.config.scaling_factor


def build_vae():
    """A 4x-downscale AutoencoderKL with 4 latent channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        # One group: with a channel per group, GroupNorm wipes each channel's level over the
        # image, and a flat background's color is nothing but that level.
        norm_num_groups=1,
        sample_size=SIZE,
    )


def build_text_encoder(tokenizer):
    """A 2-layer CLIP text encoder, 64 wide."""
    from transformers import CLIPTextModel

    return CLIPTextModel(tiny.clip_text_config(tokenizer, hidden=64, projection=64))


def build_unet():
    """A UNet of about 1M parameters on 16x16 latents."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=SIZE // 4,
        in_channels=4,
        out_channels=4,
        # Attention only at 8x8: cheap on a CPU, and still wide enough to place a shape.
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=64,
        attention_head_dim=8,
        # Few channels per group lose the latents' levels (the background); 4 to 8 keep them.
        norm_num_groups=8,
    )


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine down to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _weighted(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """L1 + MSE where the shape's pixels count four times the background's.

    A shape covers a tenth of the image or less; unweighted, the VAE learns the layout long
    before it learns to tell the six colors apart.
    """
    background = x[:, :, :1, :1]
    weight = 1.0 + 3.0 * ((x - background).abs().amax(dim=1, keepdim=True) > 0.1).float()
    err = (recon - x).abs() + (recon - x) ** 2
    return (weight * err).mean() / weight.mean()


def _polygons(rng: random.Random, n: int) -> torch.Tensor:
    """n random polygons as a batch in [-1, 1]."""
    return to_tensor([random_polygon(rng) for _ in range(n)])


def train_vae(
    images: torch.Tensor, steps: int, seed: int, color_weight: float | None = None, log=print
):
    """Reconstruction (weighted L1 + MSE) with a tiny KL term; part of each batch is random polygons.

    `color_weight` (default: the recipe's) adds a term that makes the latents linear in color.
    """
    color_weight = RECIPE["vae_color_weight"] if color_weight is None else color_weight
    torch.manual_seed(seed)
    rng = random.Random(seed)
    vae = build_vae()
    opt = torch.optim.AdamW(vae.parameters(), lr=RECIPE["vae_lr"], weight_decay=0.0)
    batch = RECIPE["vae_batch"]
    polygons = round(batch * RECIPE["vae_polygon_share"])
    g = torch.Generator().manual_seed(seed)
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, RECIPE["vae_lr"], 50)
        idx = torch.randint(0, len(images), (batch - polygons,), generator=g)
        x = torch.cat([images[idx], _polygons(rng, polygons)])
        dist = vae.encode(x).latent_dist
        recon = vae.decode(dist.sample(generator=g)).sample
        kl = dist.kl().mean() / x[0].numel()
        loss = _weighted(recon, x) + RECIPE["vae_kl_weight"] * kl
        if color_weight:
            # Hold the first three latent channels to the image's colors at the latents'
            # resolution: latents nearly linear in color, as SD's are (a 4x3 matrix previews
            # them), where an unseen color's latents lie between those of known ones.
            loss = loss + color_weight * F.mse_loss(dist.mean[:, :3], F.avg_pool2d(x, 4))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(x).latent_dist.mean for x in images.split(64)])
    # Unit variance for the denoiser, as SD1.5's 0.18215 does for its VAE.
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    return vae, latents * vae.config.scaling_factor


def train_denoiser(
    latents: torch.Tensor,
    captions: list[str],
    tokenizer,
    steps: int,
    seed: int,
    log=print,
    recolor: Recolor | None = None,
):
    """Text encoder and UNet together on the v objective; returns their EMA copies.

    With `recolor`, each batch's shapes are repainted in jittered colors (`Recolor`): the
    denoiser then draws each color word as a region of colors, not as one point, and the way it
    draws colors is a continuum an adapter can move along to a color it never drew."""
    from diffusers import DDPMScheduler

    torch.manual_seed(seed)
    text_encoder, unet = build_text_encoder(tokenizer), build_unet()
    scheduler = DDPMScheduler(
        num_train_timesteps=1000, prediction_type=RECIPE["prediction_type"], **BETAS
    )
    ids = tokenizer(
        captions + [""],
        padding="max_length",
        max_length=TOKENS,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    empty = len(captions)
    embed_params = [p for n, p in text_encoder.named_parameters() if "embeddings" in n]
    embed_ids = {id(p) for p in embed_params}
    rest = [
        p
        for p in itertools.chain(text_encoder.parameters(), unet.parameters())
        if id(p) not in embed_ids
    ]
    opt = torch.optim.AdamW(
        [{"params": embed_params, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.01}],
        lr=RECIPE["unet_lr"],
    )
    ema = [
        copy.deepcopy(text_encoder).requires_grad_(False),
        copy.deepcopy(unet).requires_grad_(False),
    ]
    g = torch.Generator().manual_seed(seed + 1)
    batch = RECIPE["unet_batch"]
    start, avg = time.time(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, RECIPE["unet_lr"], RECIPE["warmup_steps"])
        idx = torch.randint(0, len(captions), (batch,), generator=g)
        clean = latents[idx] if recolor is None else recolor.latents(idx, g)
        drop = torch.rand(batch, generator=g) < RECIPE["caption_dropout"]
        tok = ids[torch.where(drop, torch.full_like(idx, empty), idx)]
        draw = ddpm_noise_and_target(scheduler, clean, g)
        cond = text_encoder(tok)[0]
        pred = unet(draw.noisy, draw.timesteps, encoder_hidden_states=cond).sample
        loss = F.mse_loss(pred, draw.target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(
            list(text_encoder.parameters()) + list(unet.parameters()), 1.0
        )
        opt.step()
        # Warm the EMA up: early on it would otherwise hold mostly the random init.
        decay = min(RECIPE["ema_decay"], (1 + step) / (10 + step))
        with torch.no_grad():
            for live, slow in zip((text_encoder, unet), ema, strict=True):
                for p, q in zip(live.parameters(), slow.parameters(), strict=True):
                    q.lerp_(p, 1 - decay)
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            log(f"unet step {step}/{steps} loss {avg:.4f} ({time.time() - start:.0f}s)")
    return ema[0].eval(), ema[1].eval()


def finetune_decoder(vae, images: torch.Tensor, steps: int, seed: int, log=print):
    """Train the decoder alone on the frozen encoder's latents (as SD's ft-MSE VAE was made).

    The encoder, and so every latent the UNet learned, stays as it is; the decoder gets more
    steps to learn colors, on slightly noised latents so that it forgives the UNet's errors.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 2)
    rng = random.Random(seed + 2)
    with torch.no_grad():
        latents = torch.cat([vae.encode(x).latent_dist.mean for x in images.split(64)])
    decoder = [vae.decoder, vae.post_quant_conv]
    params = [p for m in decoder for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=RECIPE["decoder_lr"], weight_decay=0.0)
    batch, start = RECIPE["vae_batch"] * 2, time.time()
    polygons = round(batch * RECIPE["vae_polygon_share"])
    noise_scale = 0.05 * float(latents.std())
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, RECIPE["decoder_lr"], 20)
        idx = torch.randint(0, len(images), (batch - polygons,), generator=g)
        extra = _polygons(rng, polygons)
        with torch.no_grad():
            z = torch.cat([latents[idx], vae.encode(extra).latent_dist.mean])
        z = z + noise_scale * torch.randn(z.shape, generator=g)
        recon = vae.decode(z).sample
        loss = _weighted(recon, torch.cat([images[idx], extra]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"decoder step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")
    vae.eval().requires_grad_(False)
    return vae


def build(
    out_dir: str | Path,
    seed: int = 0,
    vae_steps: int | None = None,
    unet_steps: int | None = None,
    decoder_steps: int | None = None,
    vae_color_weight: float | None = None,
    color_jitter: float | None = None,
) -> Path:
    """Train every part from scratch and save a StableDiffusionPipeline (safetensors) in out_dir."""
    import diffusers
    import transformers
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    given = {
        "vae_steps": vae_steps,
        "unet_steps": unet_steps,
        "decoder_steps": decoder_steps,
        "vae_color_weight": vae_color_weight,
        "color_jitter": color_jitter,
    }
    chosen = {key: RECIPE[key] if value is None else value for key, value in given.items()}
    torch.manual_seed(seed)
    start = time.time()
    world = scenes()
    images = to_tensor([toyworld.render(s, SIZE, SIZE) for s in world])
    captions = [toyworld.caption(s) for s in world]
    vae, latents = train_vae(images, chosen["vae_steps"], seed, chosen["vae_color_weight"])
    vae_minutes = (time.time() - start) / 60
    tokenizer = tiny.clip_tokenizer(TOKENS)  # every toy-world word is one token
    jitter = chosen["color_jitter"]
    recolor = Recolor(world, images, vae, jitter) if jitter else None
    text_encoder, unet = train_denoiser(
        latents, captions, tokenizer, chosen["unet_steps"], seed, recolor=recolor
    )
    vae = finetune_decoder(vae, images, chosen["decoder_steps"], seed)
    sampler = DDIMScheduler(
        num_train_timesteps=1000,
        clip_sample=False,
        set_alpha_to_one=True,
        timestep_spacing="trailing",
        prediction_type=RECIPE["prediction_type"],
        **BETAS,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=sampler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    recipe = {
        **RECIPE,
        "seed": seed,
        **chosen,
        "image_size": SIZE,
        "noise_schedule": BETAS,
        "vae_minutes": round(vae_minutes, 1),
        "total_minutes": round((time.time() - start) / 60, 1),
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "command": " ".join(
            [f"python -m kit.toy.base {out_dir} --seed {seed}"]
            + [
                f"--{key.replace('_', '-')} {value}"
                for key, value in chosen.items()
                if value != RECIPE[key]
            ]
        ),
    }
    with atomic_dir(out_dir) as tmp_dir:
        pipe.save_pretrained(tmp_dir, safe_serialization=True)
        write_json(Path(tmp_dir) / "recipe.json", recipe)
    print(json.dumps(recipe, indent=2))
    return Path(out_dir)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: train the toy base model into OUT_DIR."""
    parser = argparse.ArgumentParser(prog="python -m kit.toy.base", description=build.__doc__)
    parser.add_argument("out_dir", help="folder for the pipeline (diffusers layout)")
    parser.add_argument("--seed", type=int, default=RECIPE["seed"], help="random seed")
    parser.add_argument("--vae-steps", type=int, default=None, help="VAE steps (default: recipe)")
    parser.add_argument("--unet-steps", type=int, default=None, help="UNet steps (default: recipe)")
    parser.add_argument(
        "--decoder-steps", type=int, default=None, help="decoder steps (default: recipe)"
    )
    parser.add_argument(
        "--vae-color-weight",
        type=float,
        default=None,
        help="weight of the VAE's linear-in-color latents term (default: recipe, 0 = off)",
    )
    parser.add_argument(
        "--color-jitter",
        type=float,
        default=None,
        help="radius in RGB units of the denoiser's shape colors around their names (default: recipe, 0 = off)",
    )
    args = parser.parse_args(argv)
    build(
        args.out_dir,
        seed=args.seed,
        vae_steps=args.vae_steps,
        unet_steps=args.unet_steps,
        decoder_steps=args.decoder_steps,
        vae_color_weight=args.vae_color_weight,
        color_jitter=args.color_jitter,
    )


if __name__ == "__main__":
    main()
