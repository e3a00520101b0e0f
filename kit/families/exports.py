"""What a family answers about its exported files: the diffusers LoRA file, the kohya / ComfyUI
naming, the clients that read it, and the merged single-file checkpoint. A mixin of `Family`
(`kit.families.base`), kept apart so that each file stays readable."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kit.errors import KitError
from kit.families.adapter_keys import lora_keys

if TYPE_CHECKING:
    from kit.families.base import Components


class FamilyExports:
    """The export questions of a family; the attributes they read are `Family`'s."""

    name: str
    pipeline_class: str
    pipeline_kwargs: dict[str, Any]
    lora_layers_kwarg: str
    kohya_prefix: str

    client_versions: dict[str, str] = {}
    """Client → its first release that loads this family's files, where older ones do not
    (measured; each family keeps it beside its key layout)."""
    client_title: str = ""
    """The model's name beside such a release: `ComfyUI ≥ 0.8 (Z-Image)`."""
    part_titles: dict[str, str] = {}
    """How prose names the model each file part (`denoiser_files`) is loaded on."""

    def client_label(self, client: str) -> str:
        """A client as a file's `use_in` and the model card name it: with the release its
        support of this family starts at, where one is known."""
        since = self.client_versions.get(client)
        return f"{client} ≥ {since} ({self.client_title or self.name})" if since else client

    def part_title(self, part: str) -> str:
        """The model that file `part` of `denoiser_files` is loaded on, for prose."""
        return self.part_titles.get(part, part)

    # ------------------------------------------------------------ export

    def save_diffusers_lora(
        self,
        layers: dict[str, dict[str, torch.Tensor]],
        adapter_configs: dict[str, dict[str, Any]],
        out_dir: Path,
    ) -> Path:
        """Write `pytorch_lora_weights.safetensors` as the family's pipeline saves it.

        `layers` holds each adapted part's weights in peft naming, under `denoiser` or a text
        encoder's subfolder name. The keys stay in peft's style for every target: diffusers'
        older renaming covers only the attention projections, and a file that mixes both
        styles loads only in part.
        """
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        kwargs: dict[str, Any] = {}
        for part, state in layers.items():
            name = (
                self.lora_layers_kwarg.removesuffix("_lora_layers") if part == "denoiser" else part
            )
            kwargs[f"{name}_lora_layers"] = state
            kwargs[f"{name}_lora_adapter_metadata"] = adapter_configs[part]
        cls.save_lora_weights(out_dir, **kwargs, safe_serialization=True)
        return Path(out_dir) / "pytorch_lora_weights.safetensors"

    def denoiser_files(self, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Adapter weights by exported file: a name part → its weights, named as for one model."""
        return {"": state}

    def part_metadata(self, part: str) -> dict[str, str]:
        """Metadata that file `part` (of `denoiser_files`) carries beside the run's: what
        tells it from the other parts' files; none for a denoiser of one model."""
        return {}

    def denoiser_part(self, denoiser: nn.Module, part: str) -> nn.Module:
        """The model within the denoiser that file `part` (of `denoiser_files`) adapts."""
        return denoiser

    def host_resident(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """Models of the denoiser whose frozen weights wait in host RAM while another trains."""
        return {}

    def lora_load_kwargs(self, part: str) -> dict[str, Any]:
        """The `load_lora_weights` arguments that load file `part` into its model."""
        return {}

    def kohya_module(self, module: str) -> str:
        """A denoiser module's path as the kohya file names it (the clients' model naming):
        the diffusers path here; families whose clients use the original layout rename it."""
        return module

    def kohya_state_dict(
        self, state: dict[str, torch.Tensor], alpha: float
    ) -> dict[str, torch.Tensor]:
        """The denoiser's LoRA / DoRA weights in the kohya naming that A1111, Forge and ComfyUI
        load (families whose original layout fuses modules override this)."""
        return lora_keys(state, self.kohya_prefix, alpha, self.kohya_module)

    def client_models(self, comps: Components) -> dict[str, Any]:
        """The loaded model as each client that reads this family's kohya files holds it:
        client name → (state dict in that client's own naming, the aliases the client derives
        itself, or None), or → a sentence saying why that client cannot be checked here.

        The export applies its file to these with each client's rules (`kit.export.clients`).
        """
        return {}

    def lycoris_naming(self) -> tuple[str, Any]:
        """(key prefix, module renaming) of the denoiser's LoHa / LoKr file."""
        return self.kohya_prefix, self.kohya_module

    # ------------------------------------------------------------ single file

    def single_file_state_dict(self, comps: Components) -> dict[str, torch.Tensor]:
        """The whole model as one checkpoint in the original layout that A1111, Forge and
        ComfyUI load (see `kit.families.ldm`); families without such a layout refuse."""
        raise KitError(
            f"{self.name} has no single-file checkpoint layout yet; "
            "write a diffusers folder instead (--format diffusers)"
        )

    def single_file_pipeline(self, path: str | Path, config_source: str | Path) -> Any:
        """The family's diffusers pipeline read back from a single-file checkpoint by diffusers'
        own `from_single_file`, the diffusers folder (or hub id) `config_source` giving the
        configs: an independent reading of what `single_file_state_dict` wrote."""
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        return cls.from_single_file(str(path), config=str(config_source), **self.pipeline_kwargs)

    def transformer_file_pipeline(
        self, transformer_class: str, path: str | Path, config_source: str | Path
    ) -> Any:
        """The pipeline of a family whose single file holds the transformer alone (as Flux,
        SD3 and Wan files in ComfyUI's `diffusion_models` folder do): the transformer read by
        diffusers' `from_single_file`, every other part from the base model."""
        import diffusers

        transformer = getattr(diffusers, transformer_class).from_single_file(
            str(path), config=str(config_source), subfolder="transformer", local_files_only=True
        )
        cls = getattr(diffusers, self.pipeline_class)
        return cls.from_pretrained(
            str(config_source), transformer=transformer, **self.pipeline_kwargs
        )
