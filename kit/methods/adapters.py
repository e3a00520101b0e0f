"""Adapters on the denoiser through peft: LoRA, DoRA, LoHa and LoKr; everything else frozen.

One place decides which modules are adapted. The same code builds the preview (`kit network`),
the memory estimate and the real run, so what the preview lists is what trains.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kit.config import Config
from kit.errors import ConfigError, DiskError, disk_problem
from kit.families import Components, Family, adapter_keys
from kit.io import save_tensors
from kit.methods import register
from kit.methods.base import (
    Apply,
    Method,
    NetworkSummary,
    freeze_all,
    load_lora,
    text_encoder_parts,
    trainable_count,
    trainable_parameters,
    unwrap,
)


def _matches(name: str, targets: list[str]) -> bool:
    # peft's rule: a target is the full name or a dotted suffix of it.
    return any(name == t or name.endswith("." + t) for t in targets)


def target_modules(cfg: Config, family: Family, denoiser: nn.Module) -> list[str]:
    """Full names of the modules to adapt, after the substring filters (ignore wins)."""
    net = cfg.network
    targets = net.lora_target_modules or list(family.default_lora_targets)
    names = []
    for name, module in denoiser.named_modules():
        if not isinstance(module, nn.Linear | nn.Conv2d) or not _matches(name, targets):
            continue
        if net.only_if_contains and not any(s in name for s in net.only_if_contains):
            continue
        if any(s in name for s in net.ignore_if_contains):
            continue
        names.append(name)
    if not names:
        raise ConfigError(
            f"no module of the {family.name} denoiser matches lora_target_modules={targets} "
            f"with only_if_contains={net.only_if_contains} and "
            f"ignore_if_contains={net.ignore_if_contains}"
        )
    return names


TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
"""Text-encoder modules adapted when the config names none: the attention projections."""


def summarize(
    module: nn.Module, kind: str, text: dict[str, nn.Module] | None = None
) -> NetworkSummary:
    """Which modules carry an adapter and how many parameters train in each; text-encoder
    modules are named under their part (`text_encoder.text_model…`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    parts = {"": module, **{f"{sub}.": enc for sub, enc in (text or {}).items()}}
    per_module = {
        prefix + name: trainable_count(m)
        for prefix, part in parts.items()
        for name, m in part.named_modules()
        if isinstance(m, BaseTunerLayer)
    }
    total = sum(p.numel() for part in parts.values() for p in part.parameters())
    trainable = sum(trainable_count(part) for part in parts.values())
    return NetworkSummary(kind, sorted(per_module), per_module, trainable, total)


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights in peft naming (no adapter name in the keys)."""
    from peft.utils import get_peft_model_state_dict

    return {
        k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module).items()
    }


def load_adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put saved adapter weights back into an adapted module, refusing any mismatch."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigError(f"checkpoint holds adapter weights this network lacks: {unexpected[:3]}")


class Adapter(Method):
    """A peft adapter on the denoiser (and, for the LoRA kinds, optionally on the text
    encoders). Subclasses give the peft config and the kohya layout."""

    kohya_network_module = "networks.lora"
    """`ss_network_module` of the kohya file."""
    modelspec_adapter = "lora"
    hub_tags = ("lora",)
    low_rank = True
    text_adapters = False
    """This kind can adapt text encoders too (`train_text_encoder`)."""

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        self.text_ids = self._text_encoder_ids()
        self.live_text = bool(self.text_ids)
        # SDXL conditions on its encoders' penultimate layer: the last layer's adapters get no
        # gradient, which DDP must be told to expect.
        self.leaves_unused = bool(self.text_ids)

    def _text_encoder_ids(self) -> tuple[int, ...]:
        """The text encoders that get an adapter; refuses what no client could load."""
        net, family = self.cfg.network, self.family
        if not net.train_text_encoder:
            for key in ("text_encoders", "text_encoder_lr", "text_encoder_target_modules"):
                if getattr(net, key):
                    raise ConfigError(
                        f"{key}: {getattr(net, key)} is set but train_text_encoder is false; "
                        f"set train_text_encoder: true to train them, or remove {key}"
                    )
            return ()
        if not self.text_adapters:
            raise ConfigError(
                f"train_text_encoder with network_type {self.name}: text-encoder adapters are "
                "written only as LoRA (lora, dora), which is what diffusers, ComfyUI and A1111 "
                "load for text encoders; use network_type lora, or train_text_encoder: false"
            )
        available = list(range(len(family.kohya_text_prefixes)))
        if not available:
            raise ConfigError(
                f"train_text_encoder with network_type {self.name} on {family.name}: no client "
                f"loads a LoRA into {family.name}'s text encoders ({family.pipeline_class} has no "
                "text-encoder LoRA); set train_text_encoder: false"
            )
        chosen = sorted(set(net.text_encoders)) or available
        wrong = [i for i in chosen if i not in available]
        if wrong:
            names = ", ".join(f"{i}: {family.text_subfolders[i]}" for i in available)
            raise ConfigError(
                f"text_encoders: {wrong} on {family.name}: the encoders a LoRA can be loaded "
                f"into are {names}"
            )
        return tuple(chosen)

    def peft_config(self, targets: list[str], alpha: float) -> Any:
        """The peft config of this adapter on `targets`."""
        raise NotImplementedError

    def adapter_config(self, denoiser: nn.Module) -> Any:
        """The peft config on the modules the config's filters select in `denoiser`."""
        return self.peft_config(target_modules(self.cfg, self.family, denoiser), self.alpha())

    def text_config(self) -> Any:
        """The peft config of the text-encoder adapters."""
        targets = self.cfg.network.text_encoder_target_modules or list(TEXT_TARGETS)
        return self.peft_config(list(targets), self.alpha())

    def alpha(self) -> float:
        """The update scale's numerator: `lora_alpha`, or the rank when unset (as configured)."""
        net = self.cfg.network
        return net.lora_alpha if net.lora_alpha is not None else net.lora_rank

    # ------------------------------------------------------------ training

    def _text_parts(self, encoders: list[nn.Module]) -> dict[str, nn.Module]:
        """Subfolder name → the (unwrapped) text encoders that carry an adapter."""
        subs = self.family.text_subfolders
        return {subs[i]: unwrap(encoders[i]) for i in self.text_ids}

    def _attach(self, denoiser: nn.Module, encoders: list[nn.Module]) -> NetworkSummary:
        from peft import inject_adapter_in_model

        denoiser.add_adapter(self.adapter_config(denoiser))
        text = self._text_parts(encoders)
        for sub, enc in text.items():
            config = self.text_config()
            try:
                inject_adapter_in_model(config, enc, adapter_name="default")
            except ValueError as e:
                raise ConfigError(
                    f"text_encoder_target_modules: no module of {sub} matches "
                    f"{self.text_config().target_modules} ({e})"
                ) from None
            # What `add_adapter` records, so peft's state-dict helpers find the adapter.
            enc.peft_config = {"default": config}
        return summarize(denoiser, self.name, text)

    def attach(self, comps: Components) -> NetworkSummary:
        freeze_all(comps.frozen_modules())
        return self._attach(comps.denoiser, comps.text_encoders)

    def trained_text_encoders(self) -> tuple[int, ...]:
        return self.text_ids

    def param_groups(self, comps: Components) -> list[dict[str, Any]]:
        if not self.text_ids:
            return super().param_groups(comps)
        lr = self.cfg.network.text_encoder_lr
        denoiser = list(trainable_parameters(unwrap(comps.denoiser)))
        text = [
            p
            for enc in self._text_parts(comps.text_encoders).values()
            for p in trainable_parameters(enc)
        ]
        return [{"params": denoiser}, {"params": text, **({"lr": lr} if lr is not None else {})}]

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        out = adapter_state_dict(unwrap(comps.denoiser))
        for sub, enc in self._text_parts(comps.text_encoders).items():
            out.update({f"{sub}.{k}": v for k, v in adapter_state_dict(enc).items()})
        return out

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        text = self._text_parts(comps.text_encoders)
        own = {k: v for k, v in state.items() if k.split(".", 1)[0] not in text}
        load_adapter_state_dict(unwrap(comps.denoiser), own)
        for sub, enc in text.items():
            prefix = f"{sub}."
            load_adapter_state_dict(
                enc, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )

    def mark_trainable(self, parts: dict[str, nn.Module]) -> NetworkSummary:
        freeze_all(parts.values())
        return self._attach(parts["denoiser"], text_encoder_parts(parts))

    switchable = True

    @contextmanager
    def adapter_off(self, comps: Components) -> Iterator[None]:
        """Every adapter layer of the denoiser and text encoders disabled (peft's
        `enable_adapters(False)`, as `disable_adapter()` does), then enabled again with each
        parameter's `requires_grad` as it was (peft's enabling would set it on them all)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        roots = [unwrap(comps.denoiser), *self._text_parts(comps.text_encoders).values()]
        layers = [m for r in roots for m in r.modules() if isinstance(m, BaseTunerLayer)]
        flags = [(p, p.requires_grad) for m in layers for p in m.parameters()]
        was = [m.disable_adapters for m in layers]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m, off in zip(layers, was, strict=True):
                m.enable_adapters(not off)
            for p, grad in flags:
                p.requires_grad_(grad)

    @contextmanager
    def adapter_scaled(self, comps: Components, scale: float) -> Iterator[None]:
        """Every adapter layer's update multiplied by `scale` (peft's `scale_layer`, as
        diffusers' `cross_attention_kwargs={"scale": ...}`); each layer's own scaling is put
        back exactly afterwards."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        roots = [unwrap(comps.denoiser), *self._text_parts(comps.text_encoders).values()]
        layers = [m for r in roots for m in r.modules() if isinstance(m, BaseTunerLayer)]
        saved = [dict(m.scaling) for m in layers]
        for m in layers:
            m.scale_layer(scale)
        try:
            yield
        finally:
            for m, scaling in zip(layers, saved, strict=True):
                m.scaling.update(scaling)

    # ------------------------------------------------------------ export

    def export_formats(self) -> tuple[str, ...]:
        return self.family.export_formats

    def split(self, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Checkpoint weights by part: `denoiser` and each adapted text encoder's subfolder."""
        text = {self.family.text_subfolders[i] for i in self.text_ids}
        parts: dict[str, dict[str, torch.Tensor]] = {"denoiser": {}, **{sub: {} for sub in text}}
        for k, v in weights.items():
            head, _, rest = k.partition(".")
            if head in text:
                parts[head][adapter_keys.clip_key(rest)] = v
            else:
                parts["denoiser"][k] = v
        return parts

    def kohya_tensors(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights in the kohya / LyCORIS key layout that A1111, Forge and ComfyUI load."""
        parts = self.split(weights)
        alpha = float(self.alpha())
        out = self.family.kohya_state_dict(parts.pop("denoiser"), alpha)
        subs = list(self.family.text_subfolders)
        for sub, state in parts.items():
            prefix = self.family.kohya_text_prefixes[subs.index(sub)]
            out.update(adapter_keys.lora_keys(state, prefix, alpha))
        return out

    def kohya_apply(self) -> Apply | None:
        """How diffusers applies the kohya file to redraw the kit's images, or None where
        diffusers does not read this family's kohya files (the client checks still run)."""
        return load_lora if self.family.diffusers_reads_kohya else None

    def kohya_network_args(self) -> dict[str, str]:
        """`ss_network_args` of the kohya file."""
        return {}

    def write_export(self, fmt, weights, meta, step, out, part: str = "") -> tuple[Path, Apply]:
        """`part`: the file of one model of a denoiser of several (`Family.denoiser_files`),
        whose `weights` are named as for that model alone; its name ends in `_<part>`."""
        family = self.family
        parts = family.empty_parts(self.cfg.model.pretrained_model)
        parts["denoiser"] = family.denoiser_part(parts["denoiser"], part)
        alpha, rank = float(self.alpha()), int(self.cfg.network.lora_rank)
        meta = {**meta, "kit.rank": str(rank), "kit.alpha": str(alpha)}
        if fmt == "diffusers":
            # alpha / rank is folded into lora_B and the file says alpha = rank: diffusers reads
            # alpha from the metadata, ComfyUI and Forge from no metadata at all (scale 1), and
            # both then apply the trained update.
            configs = {"denoiser": self.adapter_config(parts["denoiser"]).to_dict()}
            configs.update(
                {
                    sub: self.text_config().to_dict()
                    for sub in self._text_parts(text_encoder_parts(parts))
                }
            )
            for config in configs.values():
                config["lora_alpha"] = config["r"]
            layers = {
                part: fold_scale(state, alpha / rank) for part, state in self.split(weights).items()
            }
            apply = partial(load_lora, **family.lora_load_kwargs(part))
            return _write_diffusers(family, layers, configs, meta, out, part), apply
        path = self._write_kohya(self.kohya_tensors(weights), alpha, rank, meta, step, out, part)
        kohya = self.kohya_apply()
        return path, kohya and partial(kohya, **family.lora_load_kwargs(part))

    def _write_kohya(
        self, tensors, alpha: float, rank: int, meta, step: int, out: Path, part: str = ""
    ) -> Path:
        cfg = self.cfg
        name = (Path(cfg.train.output_dir).name or "lora") + (f"_{part}" if part else "")
        metadata = {
            **meta,
            "ss_network_module": self.kohya_network_module,
            "ss_network_dim": str(rank),
            "ss_network_alpha": str(alpha),
            "ss_network_args": json.dumps(self.kohya_network_args()),
            "ss_steps": str(step),
            "ss_output_name": name,
            "ss_resolution": f"({cfg.data.resolution}, {cfg.data.resolution})",
            "ss_text_encoder_lr": str(cfg.network.text_encoder_lr or cfg.train.learning_rate)
            if self.text_ids
            else "",
            "modelspec.title": name,
        }
        metadata = {k: v for k, v in metadata.items() if v != ""}
        path = out / f"{name}.safetensors"
        save_tensors(path, tensors, metadata)
        return path


def _write_diffusers(family: Family, layers, configs, meta, out: Path, part: str = "") -> Path:
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        try:
            written = family.save_diffusers_lora(layers, configs, Path(tmp))
        except Exception as e:  # diffusers writes it: a full disk is safetensors' own error
            why = disk_problem(e, out)
            if why is None:
                raise
            raise DiskError(f"could not write {LORA_FILE} in {out}: {why}") from None
        with safe_open(str(written), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = {**(f.metadata() or {}), **meta}
        path = out / (f"{written.stem}_{part}{written.suffix}" if part else written.name)
        save_tensors(path, tensors, metadata)
    return path


LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file diffusers' `save_lora_weights` writes."""


def fold_scale(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """peft LoRA weights with the update scale multiplied into `lora_B` (the rest unchanged)."""
    return {k: v * scale if ".lora_B." in k else v for k, v in state.items()}


@register
class Lora(Adapter):
    """Low-rank update of each adapted weight (LoRA)."""

    name = "lora"
    title = "LoRA"
    own_keys = ("lora_dropout", "use_dora", "text_encoder_lr", "text_encoder_target_modules")
    size_per_rank = True
    base_learning_rate = 1e-4
    dora = False
    text_adapters = True
    rank_bounded = True
    zero_factors = ("lora_A", "lora_B")  # peft starts lora_B at zero

    def peft_config(self, targets, alpha):
        from peft import LoraConfig

        net = self.cfg.network
        return LoraConfig(
            r=net.lora_rank,
            lora_alpha=alpha,
            lora_dropout=net.lora_dropout,
            target_modules=targets,
            use_dora=self.dora,
            init_lora_weights=True,
        )


@register
class Dora(Lora):
    """LoRA with a learned per-row magnitude (DoRA); `use_dora` turns LoRA into this."""

    name = "dora"
    title = "DoRA"
    dora = True
    hub_tags = ("lora", "dora")
    rank_bounded = False  # the magnitudes rescale whole rows: W' − W is full rank

    kohya_network_module = "lycoris.kohya"  # kohya's own networks.lora has no DoRA

    def kohya_apply(self) -> Apply | None:
        return None  # diffusers drops kohya DoRA magnitudes: the client checks decide

    def kohya_network_args(self) -> dict[str, str]:
        # LyCORIS' DoRA is weight-decomposed per output row, peft's convention.
        return {"algo": "lora", "dora_wd": "True"}

    def export_formats(self) -> tuple[str, ...]:
        # One magnitude per row of a fused weight would need the untrained parts' norms.
        formats = self.family.export_formats
        return formats if self.family.kohya_dora else tuple(f for f in formats if f != "kohya")

    def quantization_refusal(self, kind: str) -> str | None:
        if kind in ("int8", "fp8"):
            # DoRA reads the base weight to normalise its rows; peft unpacks quantized weights
            # only of bitsandbytes and torchao (a quanto weight refuses DoRA's half cast).
            return (
                "DoRA normalises each row by the base weight, which peft cannot unpack from an "
                "optimum-quanto weight; use network_type lora, or base_quantization: nf4 (CUDA), "
                "or none"
            )
        return super().quantization_refusal(kind)

    def client_gaps(self) -> dict[str, str]:
        way_out = "for a plain LoRA that loads everywhere: kit resize RUN --rank R"
        return {
            "ComfyUI": "ComfyUI divides DoRA's magnitude by the norm of the base weight, not of "
            f"the updated one, so it applies an approximation ({way_out})",
            "A1111": "A1111 normalises DoRA per input column, not per output row as DoRA does "
            f"({way_out})",
            "sd-scripts": "sd-scripts' networks.lora reads no DoRA magnitude; load the file with "
            "--network_module lycoris.kohya",
        }


class Lycoris(Adapter):
    """LoHa and LoKr: exported only as LyCORIS keys in the kohya naming."""

    kohya_network_module = "lycoris.kohya"
    hub_tags = ("lycoris", "lora")
    base_learning_rate = 2e-4

    @classmethod
    def unsupported(cls, family: Family) -> str | None:
        if "kohya" in family.export_formats:
            return None
        return (
            f"{cls.title} is exported only as LyCORIS weights in the kohya naming, and "
            f"{family.name} has no kohya export (its formats: {', '.join(family.export_formats)})"
        )

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        # A dropped module's factors get no gradient that step; DDP must be told to expect it.
        self.leaves_unused = cfg.network.module_dropout > 0

    def export_formats(self) -> tuple[str, ...]:
        return tuple(f for f in self.family.export_formats if f == "kohya")

    def kohya_tensors(self, weights):
        rank = int(self.cfg.network.lora_rank)
        prefix, rename = self.family.lycoris_naming()
        return adapter_keys.lycoris_keys(weights, float(self.alpha()), rank, prefix, rename)

    def kohya_apply(self) -> Apply | None:
        return None  # diffusers reads no LyCORIS file: the client checks decide

    def quantization_refusal(self, kind: str) -> str | None:
        if kind == "nf4":
            # bitsandbytes packs a 4-bit weight into a column of bytes.
            return (
                f"{self.name} sizes its factors from the base weight's shape, which the 4-bit "
                "format packs; use network_type lora or dora, or base_quantization: int8"
            )
        return super().quantization_refusal(kind)

    def client_gaps(self) -> dict[str, str]:
        return {
            "sd-scripts": "sd-scripts' networks.lora reads LoRA keys only; load LyCORIS files "
            "with --network_module lycoris.kohya",
        }

    def kohya_network_args(self) -> dict[str, str]:
        return {"algo": self.name}


@register
class LoHa(Lycoris):
    """Hadamard product of two low-rank products (LoHa)."""

    name = "loha"
    title = "LoHa"
    own_keys = ("module_dropout",)
    zero_factors = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")  # peft: w2_b at zero
    size_per_rank = True

    def peft_config(self, targets, alpha):
        from peft import LoHaConfig

        net = self.cfg.network
        return LoHaConfig(
            r=net.lora_rank, alpha=alpha, module_dropout=net.module_dropout, target_modules=targets
        )


@register
class LoKr(Lycoris):
    """Kronecker product of two factors, one optionally low-rank (LoKr)."""

    name = "lokr"
    title = "LoKr"
    own_keys = ("module_dropout", "lokr_factor", "lokr_decompose_both")
    zero_factors = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")

    def peft_config(self, targets, alpha):
        from peft import LoKrConfig

        net = self.cfg.network
        return LoKrConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            decompose_factor=net.lokr_factor,
            decompose_both=net.lokr_decompose_both,
            target_modules=targets,
        )
