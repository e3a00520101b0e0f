"""What is trained: adapters attached through peft (LoRA, DoRA, LoHa, LoKr), everything else frozen.

One place decides which parameters train. The same code builds the preview (`kit network`),
the memory estimate and the real run, so what the preview lists is what trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kit.config import Config
from kit.errors import ConfigError
from kit.families import Components, Family

ADAPTERS = ("lora", "dora", "loha", "lokr")


@dataclass
class NetworkSummary:
    """The adapted modules, with trainable parameters per module, and the totals."""

    kind: str
    modules: list[str]
    per_module: dict[str, int]
    trainable: int
    total: int

    def rows(self) -> list[dict[str, Any]]:
        """One row per adapted module: name and trainable parameters (for tables)."""
        return [{"module": m, "trainable": self.per_module[m]} for m in self.modules]


def adapter_kind(cfg: Config) -> str:
    """`lora`, `dora`, `loha` or `lokr` (`use_dora` turns LoRA into DoRA)."""
    kind = cfg.network.network_type
    return "dora" if kind == "lora" and cfg.network.use_dora else kind


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


def adapter_config(cfg: Config, family: Family, denoiser: nn.Module) -> Any:
    """The peft config of the configured adapter kind, on the filtered modules."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    net = cfg.network
    kind = adapter_kind(cfg)
    targets = target_modules(cfg, family, denoiser)
    alpha = net.lora_alpha if net.lora_alpha is not None else net.lora_rank
    if kind in ("lora", "dora"):
        return LoraConfig(
            r=net.lora_rank,
            lora_alpha=alpha,
            lora_dropout=net.lora_dropout,
            target_modules=targets,
            use_dora=kind == "dora",
            init_lora_weights=True,
        )
    if kind == "loha":
        return LoHaConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            target_modules=targets,
        )
    if kind == "lokr":
        return LoKrConfig(
            r=net.lora_rank,
            alpha=alpha,
            module_dropout=net.module_dropout,
            decompose_factor=net.lokr_factor,
            decompose_both=net.lokr_decompose_both,
            target_modules=targets,
        )
    raise ConfigError(f"network_type '{net.network_type}' is not an adapter (one of {ADAPTERS})")


def alpha_and_rank(peft_config: Any) -> tuple[float, int]:
    """(alpha, rank) of any of the peft adapter configs."""
    alpha = getattr(peft_config, "lora_alpha", None)
    if alpha is None:
        alpha = peft_config.alpha
    return float(alpha), int(peft_config.r)


def attach(cfg: Config, family: Family, comps: Components) -> NetworkSummary:
    """Add the configured adapter to the denoiser; freeze all else."""
    for m in comps.frozen_modules():
        m.requires_grad_(False)
    comps.denoiser.add_adapter(adapter_config(cfg, family, comps.denoiser))
    return summarize(comps.denoiser, adapter_kind(cfg))


def preview(cfg: Config) -> NetworkSummary:
    """The modules the configured adapter would adapt, built on the meta device (no weights)."""
    from kit.families import get_family

    family = get_family(cfg.model.model_family, cfg)
    denoiser = family.empty_parts(cfg.model.pretrained_model)["denoiser"]
    denoiser.requires_grad_(False)
    denoiser.add_adapter(adapter_config(cfg, family, denoiser))
    return summarize(denoiser, adapter_kind(cfg))


def trainable_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters that receive gradients, in a fixed order."""
    return (p for p in module.parameters() if p.requires_grad)


def summarize(module: nn.Module, kind: str = "lora") -> NetworkSummary:
    """Which modules carry an adapter and how many parameters train in each."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    per_module = {
        name: sum(p.numel() for p in m.parameters() if p.requires_grad)
        for name, m in module.named_modules()
        if isinstance(m, BaseTunerLayer)
    }
    trainable = sum(p.numel() for p in trainable_parameters(module))
    total = sum(p.numel() for p in module.parameters())
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


# ---------------------------------------------------------------- what trains, by network_type


class Network:
    """What a run trains. Subclasses decide the parameters, their saved form and their upkeep."""

    live_text = False
    """True when gradients reach the text encoders: captions are encoded every step, not cached."""

    def __init__(self, cfg: Config, family: Family) -> None:
        self.cfg = cfg
        self.family = family
        self.kind = cfg.network.network_type

    def attach(self, comps: Components) -> NetworkSummary:
        """Freeze the base model, then make the trained parts trainable."""
        raise NotImplementedError

    def parameters(self, comps: Components) -> list[nn.Parameter]:
        """The trained parameters, in a fixed order."""
        return [p for m in comps.frozen_modules() for p in m.parameters() if p.requires_grad]

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        """The trained weights, as saved in checkpoints and read by export."""
        raise NotImplementedError

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        """Put saved trained weights back."""
        raise NotImplementedError

    def after_step(self, comps: Components) -> None:
        """Upkeep after each optimizer step (nothing by default)."""


class AdapterNetwork(Network):
    """LoRA, DoRA, LoHa or LoKr on the denoiser (peft)."""

    def attach(self, comps: Components) -> NetworkSummary:
        return attach(self.cfg, self.family, comps)

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        return adapter_state_dict(_unwrap(comps.denoiser))

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        load_adapter_state_dict(_unwrap(comps.denoiser), state)


class FullNetwork(Network):
    """Every weight of the denoiser (and, if asked, of the first text encoder)."""

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        self.live_text = cfg.network.train_text_encoder

    def _trained(self, comps: Components) -> dict[str, nn.Module]:
        parts = {"denoiser": _unwrap(comps.denoiser)}
        if self.live_text:
            parts["text_encoder"] = comps.text_encoders[0]
        return parts

    def attach(self, comps: Components) -> NetworkSummary:
        for m in comps.frozen_modules():
            m.requires_grad_(False)
        for m in self._trained(comps).values():
            m.requires_grad_(True)
        trainable = sum(p.numel() for p in self.parameters(comps))
        total = sum(p.numel() for m in comps.frozen_modules() for p in m.parameters())
        names = list(self._trained(comps))
        return NetworkSummary(
            "full", names, {n: _count(m) for n, m in self._trained(comps).items()}, trainable, total
        )

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        return {
            f"{part}.{k}": v.detach().clone().contiguous()
            for part, m in self._trained(comps).items()
            for k, v in m.state_dict().items()
        }

    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        for part, m in self._trained(comps).items():
            prefix = f"{part}."
            m.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )


class TextualInversion(Network):
    """New token embeddings in every text encoder of the family; nothing else changes."""

    live_text = True

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        self.tokens = list(cfg.network.placeholder_tokens)
        self.ids: list[list[int]] = []
        self.frozen_rows: list[torch.Tensor] = []

    def attach(self, comps: Components) -> NetworkSummary:
        for m in comps.frozen_modules():
            m.requires_grad_(False)
        init = self.cfg.network.initializer_token
        self.ids, self.frozen_rows = [], []
        for tok, enc in zip(comps.tokenizers, comps.text_encoders, strict=True):
            init_ids = tok(init, add_special_tokens=False).input_ids
            if len(init_ids) != 1:
                raise ConfigError(
                    f"initializer_token '{init}' is {len(init_ids)} tokens for {type(tok).__name__}; "
                    "choose a word that is one token"
                )
            for token in self.tokens:
                if len(tok(token, add_special_tokens=False).input_ids) == 1:
                    raise ConfigError(
                        f"placeholder token '{token}' is already a token of {type(tok).__name__}; "
                        f"training it would change that word everywhere: choose e.g. '<{token.strip('<>')}>'"
                    )
            before = len(tok)
            tok.add_tokens(self.tokens)
            ids = tok.convert_tokens_to_ids(self.tokens)
            for token, new_id in zip(self.tokens, ids, strict=True):
                got = tok(token, add_special_tokens=False).input_ids
                if got != [new_id] or new_id < before:
                    raise ConfigError(
                        f"placeholder token '{token}' is not one new token in "
                        f"{type(tok).__name__} (got {got}); choose another, e.g. '<{token.strip('<>')}>'"
                    )
            enc.resize_token_embeddings(len(tok))
            emb = enc.get_input_embeddings()
            emb.weight.data = emb.weight.data.float()
            with torch.no_grad():
                emb.weight[ids] = emb.weight[init_ids[0]].clone()
            emb.weight.requires_grad_(True)
            self.ids.append(ids)
            self.frozen_rows.append(emb.weight.detach().clone())
        n = sum(
            len(ids) * enc.get_input_embeddings().weight.shape[1]
            for ids, enc in zip(self.ids, comps.text_encoders, strict=True)
        )
        names = [f"text_encoder_{i}:{t}" for i in range(len(self.ids)) for t in self.tokens]
        per = {name: n // len(names) for name in names}
        total = sum(p.numel() for m in comps.frozen_modules() for p in m.parameters())
        return NetworkSummary("textual_inversion", names, per, n, total)

    def parameters(self, comps: Components) -> list[nn.Parameter]:
        return [enc.get_input_embeddings().weight for enc in comps.text_encoders]

    @torch.no_grad()
    def after_step(self, comps: Components) -> None:
        # Only the new rows may change: put every other row back exactly.
        for ids, enc, frozen in zip(self.ids, comps.text_encoders, self.frozen_rows, strict=True):
            weight = enc.get_input_embeddings().weight
            keep = torch.ones(weight.shape[0], dtype=torch.bool)
            keep[ids] = False
            weight[keep] = frozen[keep].to(weight)

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        out = {}
        for i, (ids, enc) in enumerate(zip(self.ids, comps.text_encoders, strict=True)):
            weight = enc.get_input_embeddings().weight
            for token, row in zip(self.tokens, ids, strict=True):
                out[f"{i}:{token}"] = weight[row].detach().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        for i, (ids, enc) in enumerate(zip(self.ids, comps.text_encoders, strict=True)):
            weight = enc.get_input_embeddings().weight
            for token, row in zip(self.tokens, ids, strict=True):
                weight[row] = state[f"{i}:{token}"].to(weight)


def build_network(cfg: Config, family: Family) -> Network:
    """The Network for `network_type`."""
    kind = cfg.network.network_type
    if kind in ADAPTERS:
        return AdapterNetwork(cfg, family)
    if kind == "full":
        return FullNetwork(cfg, family)
    return TextualInversion(cfg, family)


def _unwrap(module: nn.Module) -> nn.Module:
    # accelerate may wrap the denoiser (DDP); the weights live in `.module`.
    return getattr(module, "module", module)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
