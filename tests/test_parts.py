"""Every family's parts table: declared once, complete, and read the way diffusers names parts."""

from __future__ import annotations

import pytest

from kit.families import family_class, family_names, get_family
from kit.families.flow import FlowFamily
from kit.families.parts import ROLES, Part

FAMILIES = family_names()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_table_has_one_denoiser_vae_and_scheduler_and_a_tokenizer_per_encoder(name):
    parts = family_class(name).parts
    roles = [p.role for p in parts]
    assert all(roles.count(r) == 1 for r in ("denoiser", "vae", "scheduler"))
    assert roles.count("text_encoder") == roles.count("tokenizer") >= 1
    assert len({p.name for p in parts}) == len(parts)
    assert parts[roles.index("denoiser")].trainable


@pytest.mark.parametrize("name", FAMILIES)
def test_every_part_class_imports(name):
    for part in family_class(name).parts:
        assert isinstance(part.cls(), type), part


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cached_encoders_are_the_tables(name):
    family = get_family(name)
    assert family.text_subfolders == tuple(
        p.folder for p in family.active_parts() if p.role == "text_encoder"
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_the_trainable_encoders_are_those_clients_load_adapters_for(name):
    cls = family_class(name)
    trainable = [p for p in cls.parts if p.role == "text_encoder" and p.trainable]
    assert len(trainable) == len(cls.kohya_text_prefixes)


def test_the_dit_families_share_the_flow_base():
    flow = [n for n in FAMILIES if issubclass(family_class(n), FlowFamily)]
    assert len(flow) >= 9


def test_a_part_is_refused_with_an_unknown_role_or_an_undotted_class():
    with pytest.raises(ValueError, match="role"):
        Part("transformer", "diffusers.X", "unet")
    with pytest.raises(ValueError, match="module.Class"):
        Part("transformer", "FluxTransformer2DModel", "denoiser")
    assert "processor" in ROLES
