"""`kit push`: a run's exports, a model card and sample images, uploaded to the Hugging Face hub.

The folder to upload is assembled first, in full, and checked: no file in it may hold a local
path of this machine or an access token. A dry run writes exactly that folder and stops, so what
would be shared can be read before it is. The token is read from the environment only
(`HF_TOKEN`, or the login that `hf auth login` stores), and a push without one stops before any
work is done.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from kit.config import Config, load_config
from kit.errors import KitError
from kit.export.card import PROJECT, model_card
from kit.export.edits import edit_examples, edit_figure
from kit.export.writer import export
from kit.families import get_family
from kit.io import atomic_dir
from kit.methods import get_method
from kit.run import checkpoint as ckpt
from kit.run.folder import RunDir, open_run, step_of
from kit.sample.validate import read_sidecar

DRY_RUN_FOLDER = "hub"
"""Under the run's exports: where a dry run writes the folder it would upload."""
IMAGES = "images"
"""Folder of the sample images inside the uploaded repository."""
MAX_SAMPLES = 8
"""Sample images shown as widgets (the grid shows them all)."""
TOKEN_PATTERN = re.compile(rb"hf_[A-Za-z0-9]{30,}")
"""What a Hugging Face access token looks like."""


@dataclass
class PushResult:
    """What was (or would be) uploaded, and where."""

    repo: str
    folder: Path
    """The assembled folder: the dry run's output or `out_dir` (a push without `out_dir`
    assembles in a temporary folder, gone once uploaded)."""
    files: list[str]
    """Its files, relative to it, as they are named in the repository."""
    sizes: dict[str, int]
    step: int
    uploaded: bool
    url: str | None = None

    def lines(self) -> list[str]:
        """What the command line prints: the listing, then what happened."""
        out = [f"{self.sizes[f]:>12,}  {f}" for f in self.files]
        if self.uploaded:
            out.append(f"uploaded {len(self.files)} files (step {self.step}) to {self.url}")
        else:
            out.append(
                f"dry run: these {len(self.files)} files (step {self.step}) would be uploaded to "
                f"{self.repo}; nothing was sent. They are in {self.folder}"
            )
        return out


def check_repo(repo: str) -> str:
    """The repository name, refused with the hub's own rule when it is not `[namespace/]name`."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise KitError(f"--repo '{repo}' is not a valid hub repository name: {e}") from None
    return repo


def hub_token() -> str | None:
    """The access token from the environment: `HF_TOKEN`, else huggingface_hub's login store."""
    from huggingface_hub import get_token

    return get_token()


# ------------------------------------------------------------------ the exports


def _export_meta(path: Path) -> dict[str, str]:
    """The kit metadata of an exported file (safetensors) or folder (a full pipeline)."""
    if path.is_dir():
        record = path / "kit_export.json"
        return json.loads(record.read_text()) if record.is_file() else {}
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def _verified_ok(path: Path) -> bool:
    """False only when an export's verification record says it failed."""
    record = Path(f"{path}.verify.json") if path.is_dir() else path.with_suffix(".verify.json")
    return not record.is_file() or bool(json.loads(record.read_text()).get("passed"))


def current_exports(run: RunDir, fmt: str, source: Path, step: int) -> list[Path]:
    """The files (or folders) of `fmt` already exported from the checkpoint `source` of `step`:
    written after it, naming its step, and not failed verification."""
    folder = run.exports / fmt
    if not folder.is_dir():
        return []
    written = (source / ckpt.MARKER).stat().st_mtime_ns
    found = []
    for path in sorted(folder.iterdir()):
        if not (path.suffix == ".safetensors" or (path / "kit_export.json").is_file()):
            continue
        if (
            _export_meta(path).get("kit.steps") == str(step)
            and path.stat().st_mtime_ns >= written
            and _verified_ok(path)
        ):
            found.append(path)
    return found


def gather_exports(
    run: RunDir, cfg: Config, source: Path, step: int, verify: bool
) -> dict[str, list[Path]]:
    """Every export format of the run's method at `step`: the existing exports, or new ones."""
    family = get_family(cfg.model.model_family, cfg)
    out = {}
    for fmt in get_method(cfg, family).export_formats():
        paths = current_exports(run, fmt, source, step)
        if not paths:
            export(run.root, fmt, checkpoint=source, verify=verify)
            paths = current_exports(run, fmt, source, step)
        if not paths:
            raise KitError(f"exporting {run.root} as {fmt} wrote no file of step {step}")
        out[fmt] = sorted(paths, key=lambda p: _token_order(cfg, p))
    return out


def _token_order(cfg: Config, path: Path) -> int:
    """Embedding files in the order of the placeholder tokens they hold (others keep theirs)."""
    tokens = list(cfg.network.placeholder_tokens)
    token = _export_meta(path).get("kit.token")
    return tokens.index(token) if token in tokens else len(tokens)


# ------------------------------------------------------------------ the folder


def sample_images(run: RunDir, step: int) -> tuple[Path | None, list[tuple[str, Path]]]:
    """The validation grid and (prompt, image) pairs drawn at `step`, else at the latest step.

    A clip's pair holds its animated WebP (what the hub shows playing), not its frame strip."""
    steps = run.validation_steps()
    folder = steps.get(step) or (steps[max(steps)] if steps else None)
    if folder is None:
        return None, []
    pairs = []
    for sc in sorted(folder.glob("*.json")):
        png, clip = sc.with_suffix(".png"), sc.with_suffix(".webp")
        if png.is_file():
            pairs.append((read_sidecar(sc)[0].prompt, clip if clip.is_file() else png))
    grid = folder / "grid.png"
    return (grid if grid.is_file() else None), pairs


def _place(src: Path, folder: Path, name: str) -> str:
    dst = folder / name
    if dst.exists():
        raise KitError(f"two files to upload are both named {name}; rename one export")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    return name


def _place_exports(exports: dict[str, list[Path]], folder: Path) -> dict[str, list[str]]:
    """Exports at the repository's top level (where `load_lora_weights(repo)` looks); a full
    pipeline folder's contents become the repository itself."""
    placed: dict[str, list[str]] = {}
    for fmt, paths in exports.items():
        for path in paths:
            if path.is_dir():
                names = [
                    _place(f, folder, f.relative_to(path).as_posix())
                    for f in sorted(path.rglob("*"))
                    if f.is_file()
                ]
                placed.setdefault(fmt, []).append("model_index.json" if names else path.name)
            else:
                placed.setdefault(fmt, []).append(_place(path, folder, path.name))
    return placed


def _check_out(out: Path) -> None:
    """Refuse an `out_dir` that holds anything but an earlier push folder (it is replaced)."""
    if out.exists() and any(out.iterdir()):
        card = out / "README.md"
        if not (card.is_file() and PROJECT in card.read_text(encoding="utf-8", errors="replace")):
            raise KitError(
                f"--out {out} exists and is not an earlier `kit push` folder; choose an empty "
                "or new folder"
            )


def local_strings(run: RunDir, cfg: Config) -> list[str]:
    """Strings that would give away this machine's folders if a shared file held them."""
    found = {str(run.root.resolve()), str(Path.home())}
    for value in (cfg.model.pretrained_model, cfg.data.image_dir, cfg.data.cache_dir):
        if value and Path(value).expanduser().is_absolute():
            found.add(str(Path(value).expanduser()))
    # Only absolute paths: a relative one ("run") is a word that may appear anywhere.
    return sorted(s for s in found if Path(s).is_absolute() and Path(s).parent != Path(s))


def _readable(path: Path) -> bytes:
    """The bytes of a file where text could hide: a safetensors file's header, else all."""
    if path.suffix != ".safetensors":
        return path.read_bytes()
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(min(size, 100_000_000))


def scan(folder: Path, local: list[str], token: str | None) -> None:
    """Refuse to share a folder in which any file holds a local path or a token."""
    needles = [s.encode() for s in local]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = _readable(path)
        if TOKEN_PATTERN.search(data) or (token and token.encode() in data):
            raise KitError(f"{path.name} holds an access token; nothing was uploaded")
        hit = next((n for n in needles if n in data), None)
        if hit is not None:
            raise KitError(
                f"{path.relative_to(folder)} holds a local path ({hit.decode()}); nothing was "
                "uploaded: re-export the run with this version of the kit"
            )


def assemble(
    run: RunDir, cfg: Config, folder: Path, repo: str, license: str | None, verify: bool
) -> int:
    """Write the folder to upload (exports, model card, sample images); return its step."""
    source = ckpt.resolve_resume(run.root, "latest")
    if source is None:
        raise KitError(f"{run.root} has no complete checkpoint to push")
    step = int(json.loads((source / ckpt.PROGRESS_FILE).read_text())["step"])
    files = _place_exports(gather_exports(run, cfg, source, step, verify), folder)
    grid_src, pairs = sample_images(run, step)
    grid = _place(grid_src, folder, f"{IMAGES}/grid.png") if grid_src else None
    samples = [(p, _place(png, folder, f"{IMAGES}/{png.name}")) for p, png in pairs[:MAX_SAMPLES]]
    # An edit run: control → base → result at the grid's step, as one figure.
    edits = edit_examples(run, [step_of(grid_src.parent)]) if grid_src else []
    figure = edit_figure(edits)
    edit_image = f"{IMAGES}/edits.png" if figure is not None else None
    if figure is not None:
        figure.save(folder / edit_image)
    # A clip's MP4 travels beside its WebP, for players and editors that take no WebP.
    videos = {
        url: _place(mp4, folder, f"{IMAGES}/{mp4.name}")
        for (_, src), (_, url) in zip(pairs, samples, strict=False)
        if (mp4 := src.with_suffix(".mp4")).is_file() and src.suffix == ".webp"
    }
    card = model_card(
        run,
        cfg,
        files,
        grid,
        samples=samples,
        repo=repo,
        step=step,
        license=license,
        edits=edits,
        edit_image=edit_image,
        videos=videos,
    )
    (folder / "README.md").write_text(card, encoding="utf-8")
    return step


def push(
    run_dir: str | Path,
    repo: str,
    *,
    dry_run: bool,
    out_dir: str | Path | None = None,
    private: bool = False,
    license: str | None = None,
    verify: bool = True,
) -> PushResult:
    """Upload a run to the hub repository `repo` (created when missing), or with `dry_run`
    write what would be uploaded to `out_dir` (default: the run's `exports/hub`).

    Formats the run has not exported at its latest checkpoint are exported (and verified)
    first. A real push assembles in a temporary folder unless `out_dir` is given.
    """
    check_repo(repo)
    token = hub_token()
    if not dry_run and not token:
        raise KitError(
            "kit push needs a Hugging Face access token: set HF_TOKEN or run `hf auth login` "
            "(nothing was exported or uploaded); --dry-run shows what would be uploaded"
        )
    if license is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", license):
        raise KitError(f"--license '{license}' is not a hub license id (such as apache-2.0)")
    run = open_run(run_dir)
    cfg = load_config(run.config)
    if out_dir is None and not dry_run:
        with tempfile.TemporaryDirectory(prefix="kit-push-") as tmp:
            step = assemble(run, cfg, Path(tmp), repo, license, verify)
            scan(Path(tmp), local_strings(run, cfg), token)
            files, sizes = _listing(Path(tmp))
            url = _upload(Path(tmp), repo, token, private, step)
        return PushResult(repo, Path(tmp), files, sizes, step, True, url)
    folder = Path(out_dir) if out_dir is not None else run.exports / DRY_RUN_FOLDER
    _check_out(folder)
    with atomic_dir(folder) as tmp:  # a failed or refused assembly leaves no folder behind
        step = assemble(run, cfg, tmp, repo, license, verify)
        scan(tmp, local_strings(run, cfg), token)
    files, sizes = _listing(folder)
    if dry_run:
        return PushResult(repo, folder, files, sizes, step, uploaded=False)
    url = _upload(folder, repo, token, private, step)
    return PushResult(repo, folder, files, sizes, step, True, url)


def _listing(folder: Path) -> tuple[list[str], dict[str, int]]:
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return files, {f: (folder / f).stat().st_size for f in files}


def _upload(folder: Path, repo: str, token: str, private: bool, step: int) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=str(folder),
            commit_message=f"{PROJECT}: step {step}",
        )
    except (OSError, ValueError) as e:
        raise KitError(f"upload to {repo} failed: {e}") from None
    return str(url)


__all__ = [
    "DRY_RUN_FOLDER",
    "PushResult",
    "assemble",
    "check_repo",
    "current_exports",
    "gather_exports",
    "hub_token",
    "local_strings",
    "push",
    "sample_images",
    "scan",
]
