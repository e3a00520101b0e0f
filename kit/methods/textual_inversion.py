"""Textual inversion: new token embeddings in every text encoder of the family; nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kit.config import Config
from kit.errors import ConfigError
from kit.families import Components, Family
from kit.io import write_with
from kit.methods import register
from kit.methods.base import (
    Apply,
    Method,
    NetworkSummary,
    freeze_all,
    text_encoder_parts,
    unwrap,
)


def _file_stem(token: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in token).strip("_")
    return stem or "embedding"


@register
class TextualInversion(Method):
    """New token embeddings in every text encoder of the family; nothing else changes."""

    name = "textual_inversion"
    title = "textual inversion"
    own_keys = ("placeholder_tokens", "initializer_token")
    base_learning_rate = 5e-3
    modelspec_adapter = "textual-inversion"
    hub_tags = ("textual-inversion",)
    embeddings = True
    live_text = True
    # Only embedding rows train; the denoiser is frozen whole, and accelerate wrapping a module
    # without a trained parameter is an error under DDP.
    trains_denoiser = False

    def __init__(self, cfg: Config, family: Family) -> None:
        super().__init__(cfg, family)
        if not (cfg.network.placeholder_tokens and cfg.network.initializer_token):
            raise ConfigError(
                "network_type textual_inversion needs placeholder_tokens and initializer_token"
            )
        if cfg.train.optimizer == "schedulefree":
            # Every row but the new ones is put back after each step; a schedule-free average
            # of the table would move them all the same (its average point is never put back).
            raise ConfigError(
                "network_type textual_inversion cannot train with optimizer schedulefree (its "
                "averaged weights would move the embedding table's other rows); use adamw, "
                "lion or came"
            )
        self.tokens = list(cfg.network.placeholder_tokens)
        self.ids: list[list[int]] = []
        self.frozen_rows: list[torch.Tensor] = []

    @classmethod
    def unsupported(cls, family: Family) -> str | None:
        import diffusers

        if family.textual_inversion_refusal:
            return family.textual_inversion_refusal
        encoders = len(family.text_subfolders)
        if encoders > 1 and len(family.embedding_names) != encoders:
            return (
                f"the embedding file needs one key per text encoder, and {family.name} names "
                f"{len(family.embedding_names)} for its {encoders} (embedding_names), so the "
                "trained embeddings could not be exported"
            )
        if not hasattr(getattr(diffusers, family.pipeline_class), "load_textual_inversion"):
            return (
                f"{family.pipeline_class} cannot load textual-inversion embeddings, so an "
                "exported embedding could be neither used nor verified"
            )
        return None

    # ------------------------------------------------------------ training

    def attach(self, comps: Components) -> NetworkSummary:
        freeze_all(comps.frozen_modules())
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
        return NetworkSummary(self.name, names, per, n, total)

    def trained_text_encoders(self) -> tuple[int, ...]:
        # Kept fp32 whole, as diffusers' textual-inversion example does: the new rows are fp32,
        # and an encoder in a half dtype around them fails at the first layer.
        return tuple(range(len(self.family.text_subfolders)))

    def _weights(self, comps: Components) -> list[nn.Parameter]:
        # The encoders may be wrapped by accelerate (DDP keeps the module in `.module`).
        return [unwrap(enc).get_input_embeddings().weight for enc in comps.text_encoders]

    def parameters(self, comps: Components) -> list[nn.Parameter]:
        return self._weights(comps)

    def _others(self, ids: list[int], rows: int) -> torch.Tensor:
        """A mask of the rows that are not the new tokens'."""
        keep = torch.ones(rows, dtype=torch.bool)
        keep[ids] = False
        return keep

    @torch.no_grad()
    def before_clip(self, comps: Components) -> None:
        # Every row but the new ones is put back after the step: their gradients would only
        # inflate the norm that clipping and the logged grad_norm see.
        for ids, weight in zip(self.ids, self._weights(comps), strict=True):
            if weight.grad is not None:
                weight.grad[self._others(ids, weight.shape[0]).to(weight.grad.device)] = 0

    @torch.no_grad()
    def after_step(self, comps: Components) -> None:
        # Only the new rows may change: put every other row back exactly.
        for ids, weight, frozen in zip(
            self.ids, self._weights(comps), self.frozen_rows, strict=True
        ):
            keep = self._others(ids, weight.shape[0])
            weight[keep] = frozen[keep].to(weight)

    def state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        out = {}
        for i, (ids, weight) in enumerate(zip(self.ids, self._weights(comps), strict=True)):
            for token, row in zip(self.tokens, ids, strict=True):
                out[f"{i}:{token}"] = weight[row].detach().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, comps: Components, state: dict[str, torch.Tensor]) -> None:
        for i, (ids, weight) in enumerate(zip(self.ids, self._weights(comps), strict=True)):
            for token, row in zip(self.tokens, ids, strict=True):
                weight[row] = state[f"{i}:{token}"].to(weight)

    # ------------------------------------------------------------ memory model

    def mark_trainable(self, parts: dict[str, nn.Module]) -> NetworkSummary:
        freeze_all(parts.values())
        per = {}
        for i, m in enumerate(text_encoder_parts(parts)):
            if hasattr(m, "get_input_embeddings"):
                # The whole table receives gradients and optimizer state; the new rows learn.
                weight = m.get_input_embeddings().weight
                weight.requires_grad_(True)
                for token in self.tokens:
                    per[f"text_encoder_{i}:{token}"] = weight.shape[1]
        total = sum(p.numel() for m in parts.values() for p in m.parameters())
        return NetworkSummary(self.name, list(per), per, sum(per.values()), total)

    # ------------------------------------------------------------ export

    def export_formats(self) -> tuple[str, ...]:
        return ("embedding",)

    def write_export(self, fmt, weights, meta, step, out) -> tuple[Path, Apply]:
        """One file per placeholder token, in the layout A1111, ComfyUI and diffusers load."""
        family = self.family
        encoders = sorted({int(k.split(":", 1)[0]) for k in weights})
        names = family.embedding_names
        files = {}
        for token in self.tokens:
            if len(encoders) == 1:
                tensors = {token: weights[f"0:{token}"][None]}
            else:
                tensors = {names[i]: weights[f"{i}:{token}"][None] for i in encoders}
            path = out / f"{_file_stem(token)}.safetensors"
            write_with(
                path,
                lambda t, tensors=tensors, token=token: save_file(
                    tensors, str(t), metadata={**meta, "kit.token": token}
                ),
            )
            files[token] = path

        def apply(pipe: Any, folder: Path) -> Any:
            attrs = list(family.load_tokenizers(self.cfg.model.pretrained_model))
            for token, path in files.items():
                if len(encoders) == 1:
                    pipe.load_textual_inversion(str(path), token=token)
                    continue
                state = load_file(str(path))
                for i in encoders:
                    pipe.load_textual_inversion(
                        state[names[i]][0],
                        token=token,
                        text_encoder=getattr(pipe, attrs[i]),
                        tokenizer=getattr(pipe, attrs[i].replace("text_encoder", "tokenizer")),
                    )
            return pipe

        return out, apply
