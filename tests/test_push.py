"""`kit push`: the folder that would be uploaded, its model card, and the token rules.

Nothing here reaches the network: the dry run writes the folder, a push without a token stops
before any work, and the upload itself is checked against a stand-in for the hub client.
"""

from __future__ import annotations

import re

import pytest
import yaml

from kit.cli import main
from kit.config import load_config
from kit.errors import KitError
from kit.export.card import model_card
from kit.export.push import push, scan
from kit.run.folder import RunDir
from kit.train.loop import train
from tests.conftest import write_run_config

FAKE = "hf_KitFakeSecret0123456789abcdefXYZ"
TOKEN_LIKE = re.compile(rb"hf_[A-Za-z0-9]{20,}")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_sd15, family_dataset) -> RunDir:
    """A 3-step LoRA run with validation images at its last step and no exports yet."""
    tmp = tmp_path_factory.mktemp("push")
    path = write_run_config(
        tmp / "config.json",
        base=tiny_sd15,
        data=family_dataset("sd15"),
        trigger_words=["zorbstar"],
        lora_alpha=2,
        learning_rate=2e-2,
        train_batch_size=1,
        max_train_steps=3,
        checkpointing_steps=3,
        validation_steps=3,
        validation_prompt=["a red zorbstar", "a blue zorbstar"],
        validation_seeds=[0, 7],
    )
    train(load_config(path))
    return RunDir(tmp / "run")


@pytest.fixture()
def token(monkeypatch) -> str:
    """A recognisable fake token where the hub client reads one."""
    monkeypatch.setenv("HF_TOKEN", FAKE)
    return FAKE


@pytest.fixture()
def no_token(monkeypatch, tmp_path):
    """No token anywhere: not in the environment, not in the login store."""
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def front_matter(card: str) -> dict:
    head, sep, _ = card.removeprefix("---\n").partition("\n---\n")
    assert card.startswith("---\n") and sep
    return yaml.safe_load(head)


@pytest.fixture(scope="module")
def dry_run(run, tmp_path_factory):
    """One dry run (with a token in the environment, which must not reach any file)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", FAKE)
        out = tmp_path_factory.mktemp("hub") / "upload"
        return push(run.root, "someone/zorbstar-lora", dry_run=True, out_dir=out)


@pytest.mark.slow
def test_dry_run_writes_exactly_the_upload_folder(run, dry_run):
    folder = dry_run.folder
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert on_disk == dry_run.files and not dry_run.uploaded
    names = set(dry_run.files)
    assert {"README.md", "pytorch_lora_weights.safetensors", "run.safetensors"} <= names
    assert "images/grid.png" in names and sum(n.startswith("images/") for n in names) == 5
    # The formats were missing, so the push exported (and verified) them in the run first.
    assert (run.exports / "diffusers" / "pytorch_lora_weights.safetensors").is_file()
    assert (run.exports / "kohya" / "run.verify.json").is_file()
    lines = dry_run.lines()
    assert lines[-1].startswith("dry run:") and "nothing was sent" in lines[-1]
    assert all(any(line.endswith(f"  {f}") for line in lines) for f in dry_run.files)


@pytest.mark.slow
def test_no_file_holds_a_local_path_or_a_token(run, dry_run, tmp_path_factory):
    local = [
        str(tmp_path_factory.getbasetemp()).encode(),
        str(run.root).encode(),
        load_config(run.config).model.pretrained_model.encode(),
    ]
    for path in dry_run.folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s in data for s in local), path
            assert FAKE.encode() not in data and not TOKEN_LIKE.search(data), path


def test_the_card_says_what_it_is_and_how_to_use_it(dry_run):
    card = (dry_run.folder / "README.md").read_text()
    meta = front_matter(card)
    # A local base model has no hub id: no base_model link, and no license to inherit.
    assert "base_model" not in meta and meta["license"] == "other"
    assert {"lora", "diffusers", "text-to-image", "sd15"} <= set(meta["tags"])
    assert meta["pipeline_tag"] == "text-to-image" and meta["instance_prompt"] == "zorbstar"
    assert [w["text"] for w in meta["widget"]] == ["a red zorbstar"] * 2 + ["a blue zorbstar"] * 2
    for w in meta["widget"]:
        assert (dry_run.folder / w["output"]["url"]).is_file()
    assert "from diffusers import StableDiffusionPipeline" in card
    assert 'load_lora_weights("someone/zorbstar-lora", weight_name="pytorch_lora_weights' in card
    assert "ComfyUI/models/loras/" in card and "<lora:run:1>" in card
    # Which file for which client, as each export's check recorded it (its verify.json).
    assert "| file | format | load it in |" in card
    diffusers_row = next(line for line in card.splitlines() if "| diffusers |" in line)
    assert "diffusers (pipe.load_lora_weights)" in diffusers_row
    assert "other clients: use the kohya file" in diffusers_row
    kohya_row = next(line for line in card.splitlines() if "| kohya |" in line)
    assert "ComfyUI" in kohya_row
    assert "| network | LoRA, rank 4, alpha 2 |" in card and "| steps | 3 |" in card
    assert "![validation images at step 3](images/grid.png)" in card


def test_a_hub_base_model_is_named_and_its_license_carried(run):
    cfg = load_config(run.config).replace(
        pretrained_model="stable-diffusion-v1-5/stable-diffusion-v1-5"
    )
    files = {"diffusers": ["pytorch_lora_weights.safetensors"]}
    meta = front_matter(model_card(run, cfg, files, None, repo="a/b"))
    assert meta["base_model"] == "stable-diffusion-v1-5/stable-diffusion-v1-5"
    assert meta["license"] == "creativeml-openrail-m"
    card = model_card(run, cfg, files, None, repo="a/b", license="mit")
    assert front_matter(card)["license"] == "mit"
    assert 'from_pretrained("stable-diffusion-v1-5/stable-diffusion-v1-5"' in card


def test_a_second_dry_run_reuses_the_exports_and_replaces_its_folder(run, dry_run, token):
    export = run.exports / "diffusers" / "pytorch_lora_weights.safetensors"
    before = export.stat().st_mtime_ns
    again = push(run.root, "someone/zorbstar-lora", dry_run=True, out_dir=dry_run.folder)
    assert export.stat().st_mtime_ns == before and again.files == dry_run.files
    default = push(run.root, "someone/zorbstar-lora", dry_run=True)
    assert default.folder == run.exports / "hub" and (default.folder / "README.md").is_file()


def test_push_without_a_token_stops_before_any_work(run, no_token, capsys):
    exports = sorted(p for p in run.exports.rglob("*")) if run.exports.is_dir() else []
    with pytest.raises(KitError, match="HF_TOKEN"):
        push(run.root, "someone/zorbstar-lora", dry_run=False)
    assert main(["push", str(run.root), "--repo", "someone/x"]) == 2
    err = capsys.readouterr().err
    assert "kit: error: kit push needs a Hugging Face access token" in err
    assert "nothing was exported or uploaded" in err
    now = sorted(p for p in run.exports.rglob("*")) if run.exports.is_dir() else []
    assert now == exports


def test_bad_input_is_refused(run, tmp_path, token):
    for repo in ("not a name", "a/b/c", "x--y", "name.git"):
        with pytest.raises(KitError, match="is not a valid hub repository name"):
            push(run.root, repo, dry_run=True, out_dir=tmp_path / "out")
    with pytest.raises(KitError, match="not a hub license id"):
        push(run.root, "a/b", dry_run=True, license="My License")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(KitError, match="not an earlier `kit push` folder"):
        push(run.root, "a/b", dry_run=True, out_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_scan_refuses_a_local_path_or_a_token(tmp_path):
    (tmp_path / "a.json").write_text('{"base": "/home/someone/models/sd"}')
    with pytest.raises(KitError, match="a.json holds a local path"):
        scan(tmp_path, ["/home/someone"], None)
    (tmp_path / "a.json").write_text(f'{{"t": "{FAKE}"}}')
    with pytest.raises(KitError, match="holds an access token"):
        scan(tmp_path, [], None)
    (tmp_path / "a.json").write_text("{}")
    scan(tmp_path, ["/home/someone"], FAKE)


def test_a_push_uploads_the_checked_folder(run, token, monkeypatch):
    """The upload, against a stand-in for the hub client: the token, the repository and the
    folder it is handed are the ones checked."""
    import huggingface_hub

    calls = {}

    class Url(str):
        repo_id = "someone/zorbstar-lora"

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls["repo"] = (repo_id, private, exist_ok)
            return Url(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, commit_message):
            from pathlib import Path

            calls["files"] = sorted(
                p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*")
            )
            calls["message"] = commit_message

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    result = push(run.root, "someone/zorbstar-lora", dry_run=False, private=True)
    assert calls["token"] == FAKE and calls["repo"] == ("someone/zorbstar-lora", True, True)
    assert "README.md" in calls["files"] and "pytorch_lora_weights.safetensors" in calls["files"]
    assert result.uploaded and result.url == "https://huggingface.co/someone/zorbstar-lora"
    assert "step 3" in calls["message"]


def test_kit_push_dry_run_command(run, tmp_path, token, capsys):
    out = tmp_path / "hub"
    assert main(["push", str(run.root), "--repo", "someone/x", "--dry-run", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "README.md" in shown and "dry run" in shown and FAKE not in shown
    assert (out / "README.md").is_file()


def test_a_textual_inversion_card(tmp_path, tiny_sd15, family_dataset, token):
    import shutil

    from tests.conftest import TEXTUAL_INVERSION

    data = tmp_path / "data"
    shutil.copytree(family_dataset("sd15"), data)
    for p in data.glob("*.txt"):  # the concept is called by the placeholder
        p.write_text(p.read_text().replace("zorbic", "<zorb>"))
    cfg = write_run_config(
        tmp_path / "config.json",
        base=tiny_sd15,
        data=data,
        max_train_steps=2,
        validation_steps=2,
        validation_prompt=["a <zorb> on a white background"],
        **TEXTUAL_INVERSION,
    )
    train(load_config(cfg))
    result = push(tmp_path / "run", "someone/zorb-embedding", dry_run=True)
    assert "zorb.safetensors" in result.files
    card = (result.folder / "README.md").read_text()
    meta = front_matter(card)
    assert "textual-inversion" in meta["tags"] and "lora" not in meta["tags"]
    assert meta["instance_prompt"] == "<zorb>"
    assert (
        'pipe.load_textual_inversion("someone/zorb-embedding", weight_name="zorb.safetensors", '
        'token="<zorb>")'
    ) in card
    assert "ComfyUI/models/embeddings/" in card and "embedding:zorb" in card
