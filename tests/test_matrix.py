"""Every method on every family: the pair trains, resumes bit for bit and exports each format it
offers, or it is refused when the method is resolved, with a message naming both.

Pairs that another test already trains end to end are listed in ELSEWHERE and only checked for
being accepted here; every other accepted pair trains in this file. A new family or method
therefore lands in the matrix without an edit here.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit.config import from_dict, load_config
from kit.errors import ConfigError
from kit.export.writer import export, formats_for
from kit.families import family_names, get_family
from kit.methods import get_method, method_names
from kit.run import checkpoint as ckpt
from kit.train.loop import train
from tests.conftest import TEXTUAL_INVERSION, short_clips, write_run_config

FAMILIES = family_names()
METHODS = method_names()

# What each method needs in the config besides its name.
METHOD_FIELDS = {
    "full": {"network_type": "full", "learning_rate": 1e-4},
    "textual_inversion": TEXTUAL_INVERSION,
}


def _fields(method: str) -> dict:
    return METHOD_FIELDS.get(method, {"network_type": method, "lora_alpha": 2})


# Pairs trained, resumed and exported (every format) by another test.
ELSEWHERE = {
    **{
        (f, "lora"): "test_families.py::test_trains_resumes_exports_and_reproduces"
        for f in FAMILIES
    },
    **{
        ("sd15", m): "test_methods.py::test_adapter_kind_trains_resumes_and_exports"
        for m in ("dora", "loha", "lokr")
    },
    **{
        ("sdxl", m): "test_full_and_ti.py::test_adapter_kinds_on_sdxl"
        for m in ("dora", "loha", "lokr")
    },
    **{
        (f, "full"): "test_full_and_ti.py::test_full_fine_tune_with_text_encoder"
        for f in ("sd15", "sdxl")
    },
    **{
        (
            f,
            "textual_inversion",
        ): "test_full_and_ti.py::test_textual_inversion_trains_resumes_and_exports"
        for f in ("sd15", "sdxl")
    },
}

SHORT = {"max_train_steps": 2, "checkpointing_steps": 1}
"""Two steps, a checkpoint after each (the split run resumes from step 1)."""


def _resolve(family_name: str, method: str):
    """The method on the family, or the ConfigError that refuses the pair."""
    cfg = from_dict({"model_family": family_name, **_fields(method)})
    family = get_family(family_name, cfg)
    try:
        return cfg, family, get_method(cfg, family)
    except ConfigError as e:
        return cfg, family, e


PAIRS = [(f, m) for f in FAMILIES for m in METHODS]
ACCEPTED = [(f, m) for f, m in PAIRS if not isinstance(_resolve(f, m)[2], ConfigError)]

# LoHa and LoKr reach a family through the same code (its LyCORIS key writer and the LyCORIS
# readers' checks); what differs between them is peft's own module, which LoHa trains on SD1.5
# (test_methods.py) and SDXL (test_full_and_ti.py). Where a family trains LoKr here, its LoHa
# is checked for being accepted with the same export formats (below) rather than trained again.
SAME_PATH_AS = {"loha": "lokr"}

TRAINED_HERE = [
    (f, m)
    for f, m in ACCEPTED
    if (f, m) not in ELSEWHERE and not (m in SAME_PATH_AS and (f, SAME_PATH_AS[m]) in ACCEPTED)
]


@pytest.mark.parametrize(("family_name", "method"), [p for p in ACCEPTED if p[1] in SAME_PATH_AS])
def test_a_method_on_the_path_of_another_exports_the_same_formats(family_name, method):
    """A pair left out of training for sharing its family's code with another method's pair
    is accepted with the same export formats, so it goes through the same writers and checks."""
    cfg, family, _ = _resolve(family_name, method)
    twin = SAME_PATH_AS[method]
    twin_cfg, twin_family, resolved = _resolve(family_name, twin)
    if (family_name, method) in ELSEWHERE or isinstance(resolved, ConfigError):
        pytest.skip(f"{method} trains on {family_name} itself")
    assert formats_for(cfg, family) == formats_for(twin_cfg, twin_family)


def test_the_matrix_names_every_method():
    assert {"lora", "dora", "loha", "lokr", "full", "textual_inversion"} <= set(METHODS)
    assert set(ELSEWHERE) <= set(PAIRS), set(ELSEWHERE) - set(PAIRS)
    # A renamed test would leave its pairs untrained: each one named must still be there.
    here = Path(__file__).parent
    for where in set(ELSEWHERE.values()):
        file, name = where.split("::")
        tree = ast.parse((here / file).read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), where


@pytest.mark.parametrize(("family_name", "method"), PAIRS)
def test_pair_is_accepted_with_formats_or_refused_by_name(
    family_name, method, tmp_path, tiny_base, family_dataset
):
    cfg, family, resolved = _resolve(family_name, method)
    if not isinstance(resolved, ConfigError):
        assert formats_for(cfg, family), "accepted, but nothing to export"
        return
    assert (family_name, method) not in ELSEWHERE, "refused, yet another test trains it"
    message = str(resolved)
    assert method in message and family_name in message, message
    # Training refuses it too, before it caches or trains anything.
    path = write_run_config(
        tmp_path / "c.json",
        base=tiny_base(family_name),
        data=family_dataset(family_name),
        family=family_name,
        **_fields(method),
    )
    with pytest.raises(ConfigError, match=family_name):
        train(load_config(path))
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _trained(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.checkpoint_dir(run, step) / ckpt.ADAPTER_FILE))


@pytest.fixture(scope="session")
def family_cache(tmp_path_factory):
    """`family_cache(name)`: one latent and text cache per family for the pairs trained here.
    Entries are keyed by content (the sample, the base's weights, the encoders as the method
    leaves them), so a family's pairs share what they encode alike and encode the rest anew."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"cache-{name}")
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("family_name", "method"), TRAINED_HERE)
def test_pair_trains_resumes_and_exports(
    family_name, method, tmp_path, tiny_base, family_dataset, family_cache
):
    data = family_dataset(family_name)
    if method == "textual_inversion":  # the captions call the concept by its placeholder
        shutil.copytree(data, tmp_path / "data")
        data = tmp_path / "data"
        for p in data.glob("*.txt"):
            p.write_text(p.read_text().replace("zorbic", "<zorb>"))

    def config(run: str):
        return write_run_config(
            tmp_path / f"{run}.json",
            base=tiny_base(family_name),
            data=data,
            family=family_name,
            output_dir=str(tmp_path / run),
            cache_dir=str(family_cache(family_name)),
            **{**SHORT, **short_clips(family_name), **_fields(method)},
        )

    straight = load_config(config("straight"))
    assert train(straight).step == 2
    weights = _trained(tmp_path / "straight", 2)
    assert weights

    split = config("split")
    train(load_config(split, {"max_train_steps": 1}))
    train(load_config(split), resume="latest")
    resumed = _trained(tmp_path / "split", 2)
    assert weights.keys() == resumed.keys()
    changed = [k for k in weights if not torch.equal(weights[k], resumed[k])]
    assert not changed, f"resumed weights differ: {changed[:3]}"

    formats = formats_for(straight, get_family(family_name, straight))
    assert formats
    for fmt in formats:
        result = export(tmp_path / "straight", fmt)
        assert result.verification.passed, (fmt, result.verification)
