"""Nothing unbounded, nothing of the user's lost, nothing accepted and then ignored: sizes read
from headers, ranges and counts are checked before anything is allocated; a network read that
never answers times out; one bad pair or clip is skipped alone; keys that do nothing are refused."""

from __future__ import annotations

import io
import math
import os
import signal
import socket
import tarfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kit.config import from_dict, load_config
from kit.data import bounds, video
from kit.data.blob import expand_braces, filesystem, use_remote
from kit.data.buckets import Placement
from kit.data.cache import plan_cache
from kit.data.images import BadImage
from kit.data.pairs import unpaired
from kit.data.pixels import load_pixels
from kit.data.scan import scan
from kit.errors import ConfigError, DataError
from kit.families import get_family
from kit.methods import get_method


@contextmanager
def within(seconds: float):
    """Fail the block when it runs longer than `seconds` (a hang becomes a failure)."""

    def late(*_):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _png(size=(64, 64), seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------- 1. bounds before work


def test_a_tar_header_claiming_60_gib_is_named_and_nothing_is_allocated(tmp_path):
    shard = tmp_path / "train-000000.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        _member(tar, "a.png", _png())
        _member(tar, "a.txt", b"a photo")
    good = shard.read_bytes()
    end = good.rstrip(b"\0")
    end += b"\0" * (-len(end) % 512)
    liar = tarfile.TarInfo("b.png")
    liar.size = 60 << 30  # the header claims 60 GiB; the shard holds a few bytes after it
    shard.write_bytes(end + liar.tobuf(tarfile.GNU_FORMAT) + b"\x89PNG" + b"\0" * 1020)
    with within(20):
        rep = scan(from_dict({"datasets": [{"shards": str(shard)}]}).data)
    assert [s.image.name for s in rep.samples] == ["a.png"]
    ((name, why),) = rep.skipped
    assert "train-000000.tar" in str(name)
    assert "60.00 GiB" in why and "b.png" in why


def test_a_member_larger_than_half_the_free_memory_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(bounds, "free_memory", lambda: 200 << 20)
    bounds.check_member("s.tar", "small.mp4", 80 << 20)
    with pytest.raises(DataError, match=r"s\.tar: member big\.mp4 is 120\.0 MiB"):
        bounds.check_member("s.tar", "big.mp4", 120 << 20)


def test_a_shard_range_too_long_to_hold_is_refused_when_the_config_is_read(tmp_path):
    pattern = str(tmp_path / "train-{000000..99999999}.tar")
    with within(10), pytest.raises(ConfigError, match=r"shards: .*100,000,000 shards"):
        from_dict({"datasets": [{"shards": pattern}]})
    with within(10), pytest.raises(DataError, match="100,000,000 shards"):
        expand_braces(pattern)
    # A range of a few is read as before.
    assert len(expand_braces(str(tmp_path / "t-{0..2}-{a,b}.tar"))) == 6


def _folder(root: Path, n: int = 3, size=(64, 64)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"{i}.png").write_bytes(_png(size, i))
        (root / f"{i}.txt").write_text(f"photo {i}")
    return root


def test_repeats_that_no_memory_can_hold_are_refused_by_name(tmp_path):
    data = _folder(tmp_path / "data")
    cfg = from_dict(
        {
            "datasets": [{"name": "cats", "image_dir": str(data), "repeats": 10**12}],
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
        }
    )
    with within(20), pytest.raises(DataError, match=r"cats.*repeats 1000000000000"):
        plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32)
    assert not (tmp_path / "cache").exists()


def test_frame_windows_far_past_a_clip_give_its_distinct_windows_at_once():
    with within(5):
        starts = video.window_starts(100, 5, sampling="uniform", windows=10**9)
    assert starts == tuple(range(96))


def test_a_clip_whose_frames_overflow_memory_is_refused_before_encoding(tmp_path, monkeypatch):
    clip = tmp_path / "data" / "clip01"
    clip.mkdir(parents=True)
    for i in range(9):
        Image.new("RGB", (64, 64), (i * 20, 0, 0)).save(clip / f"{i:04d}.png")
    (tmp_path / "data" / "clip01.txt").write_text("a clip")
    cfg = from_dict(
        {
            "model_family": "wan",
            "image_dir": str(tmp_path / "data"),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "num_frames": 9,
        }
    )
    family = get_family("wan", cfg)
    monkeypatch.setattr(bounds, "free_memory", lambda: 64 << 10)  # a machine of 64 KiB free
    with pytest.raises(DataError, match=r"num_frames 9: .*clip01"):
        plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32, family=family)


# ---------------------------------------------------------------- 2. network reads


@contextmanager
def silent_server():
    """A port on loopback that accepts connections and never answers: its address."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for c in held:
            c.close()
        server.close()


@pytest.fixture()
def silent_endpoint(monkeypatch):
    """An S3 endpoint on loopback that accepts connections and never answers."""
    pytest.importorskip("s3fs")
    import s3fs

    with silent_server() as address:
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": address,
        }.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        filesystem.cache_clear()
        yield
    s3fs.S3FileSystem.clear_instance_cache()
    filesystem.cache_clear()


@pytest.mark.parametrize("source", ["image_dir", "shards"])
def test_an_endpoint_that_never_answers_times_out_and_says_what_it_waited_for(
    silent_endpoint, tmp_path, monkeypatch, source, capsys
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    url = "s3://kit-data/cats" if source == "image_dir" else "s3://kit-data/train-{0..1}.tar"
    cfg = from_dict({"datasets": [{source: url}], "remote_timeout": 1.0, "remote_retries": 1}).data
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            scan(cfg)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 — handed to the test's thread
            done.append(e)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert done, "the scan still waits on an endpoint that never answers"
    assert time.monotonic() - started < 20
    (error,) = done
    assert isinstance(error, DataError), error
    assert "kit-data" in str(error) and "remote_timeout" in str(error)
    assert "no answer" in str(error)
    assert "waiting" in capsys.readouterr().err


def test_a_streamed_dataset_whose_server_never_answers_times_out(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with silent_server() as address:
        url = f"{address}/train.parquet"
        data = from_dict(
            {
                "datasets": [
                    {
                        "hf_dataset": url,
                        "streaming": True,
                        "split": "train",
                        "image_column": "image",
                        "caption_column": "text",
                    }
                ],
                "remote_timeout": 1.0,
                "remote_retries": 1,
            }
        ).data
        done: list[BaseException | None] = []

        def run() -> None:
            try:
                scan(data)
                done.append(None)
            except BaseException as e:  # noqa: BLE001 — handed to the test's thread
                done.append(e)

        started = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(30)
        assert done, "the stream still waits on a server that never answers"
    assert time.monotonic() - started < 20
    (error,) = done
    assert isinstance(error, DataError), error
    assert url in str(error) and "remote_timeout" in str(error) and "no answer" in str(error)


def test_hub_reads_take_the_remote_timeout(monkeypatch):
    from huggingface_hub import constants

    for key in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.setattr(constants, key, getattr(constants, key))
        monkeypatch.delenv(key, raising=False)
    use_remote(7.5, 2)
    try:
        assert constants.HF_HUB_ETAG_TIMEOUT == constants.HF_HUB_DOWNLOAD_TIMEOUT == 8
        assert os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] == "8"  # and processes it starts
    finally:
        use_remote(60.0, 3)


def test_network_settings_are_checked_when_the_config_is_read():
    for bad in ({"remote_timeout": 0}, {"remote_timeout": -1}, {"remote_retries": -1}):
        with pytest.raises(ConfigError, match="remote_"):
            from_dict(bad)
    cfg = from_dict({"remote_timeout": 5, "remote_retries": 0})
    assert cfg.data.remote_timeout == 5.0 and cfg.data.remote_retries == 0


# ---------------------------------------------------------------- 3. one bad file


def test_a_corrupt_control_is_named_and_its_pair_skipped_in_batches_of_two(tmp_path):
    data, controls = _folder(tmp_path / "data", 4), tmp_path / "controls"
    controls.mkdir()
    for i in range(4):
        (controls / f"{i}.png").write_bytes(_png(seed=10 + i))
    (controls / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image at all" * 4)
    cfg = from_dict(
        {
            "model_family": "flux_kontext",
            "image_dir": str(data),
            "control_dir": str(controls),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "train_batch_size": 2,
        }
    )
    family = get_family("flux_kontext", cfg)
    planned = plan_cache(cfg, {"vae": "v", "text": "t"}, torch.float32, family=family)
    assert sorted(s.image.name for s in planned.samples) == ["0.png", "1.png", "3.png"]
    rep = scan(cfg.data, family)
    ((name, why),) = unpaired(rep)
    assert name.name == "2.png" and "unreadable control image" in why and "2.png" in why


def test_a_truncated_frame_fails_its_clip_alone_as_a_bad_image(tmp_path):
    clip = tmp_path / "clip01"
    clip.mkdir()
    for i in range(5):
        (clip / f"{i:04d}.png").write_bytes(_png((32, 32), i))
    raw = (clip / "0003.png").read_bytes()
    (clip / "0003.png").write_bytes(raw[: len(raw) // 2])
    placement = Placement((32, 32), (32, 32), (0, 0), (32, 32), frames=(0, 1, 2, 3, 4))
    with pytest.raises(BadImage, match=r"clip01.*0003\.png"):
        load_pixels(clip, placement)


def test_a_clip_with_a_truncated_frame_is_skipped_and_counted_the_rest_cached(tmp_path, tiny_base):
    from kit.data.cache import build_cache
    from kit.toy.world import write_example_clips

    base = tiny_base("wan")
    clips = write_example_clips(tmp_path / "data", n=3, frames=5, seed=0)
    frame = clips[1] / "0002.png"
    raw = frame.read_bytes()
    frame.write_bytes(raw[: len(raw) // 2])
    cfg = from_dict(
        {
            "model_family": "wan",
            "pretrained_model": str(base),
            "image_dir": str(tmp_path / "data"),
            "cache_dir": str(tmp_path / "cache"),
            "resolution": 64,
            "bucket_step": 32,
            "num_frames": 5,
        }
    )
    family = get_family("wan", cfg)
    data = build_cache(cfg, family, family.load(str(base)))
    assert sorted(s.image.name for s in data.samples) == sorted(c.name for c in clips[::2])
    ((name, why),) = data.skipped
    assert name == clips[1] and "0002.png" in why
    assert (clips[1], why) in data.plan.dropped


# ---------------------------------------------------------------- 4. accepted, then ignored


@pytest.mark.parametrize(
    "fields",
    [
        {"text_encoder_lr": math.nan},
        {"learning_rate": math.nan},
        {"slider": {"target": "a", "positive": "b", "negative": "c", "scales": [0, math.nan]}},
        {"datasets": [{"image_dir": "x", "loss_weight": math.nan}]},
        {"lora_alpha": math.inf},
    ],
)
def test_nan_or_infinity_is_refused_wherever_a_number_is_read(fields):
    named = r"(text_encoder_lr|learning_rate|scales|loss_weight|lora_alpha).*(nan|inf)"
    with pytest.raises(ConfigError, match=named):
        from_dict(fields)


def test_nan_in_a_config_file_is_refused_naming_the_file_and_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"text_encoder_lr": NaN}')
    with pytest.raises(ConfigError, match=r"config\.json: text_encoder_lr: nan"):
        load_config(path)


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"train_experts": "high"}, "train_experts"),
        ({"text_encoder_lr": 1e-5}, "text_encoder_lr"),
        ({"text_encoder_target_modules": ["q_proj"]}, "text_encoder_target_modules"),
        ({"lokr_factor": 4}, "lokr_factor"),
        ({"module_dropout": 0.1}, "module_dropout"),
        ({"placeholder_tokens": ["<x>"]}, "placeholder_tokens"),
    ],
)
def test_keys_that_do_nothing_for_the_family_or_method_are_refused_by_name(fields, key):
    cfg = from_dict({"model_family": "sd15", **fields})
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        get_method(cfg, get_family("sd15", cfg))


def test_the_same_keys_pass_where_they_act():
    for fields in (
        {"network_type": "lokr", "lokr_factor": 4, "module_dropout": 0.1},
        {"train_text_encoder": True, "text_encoder_lr": 1e-5},
    ):
        cfg = from_dict({"model_family": "sd15", **fields})
        get_method(cfg, get_family("sd15", cfg))


CLIP_KEYS = [
    ({"num_frames": 5}, "num_frames"),
    ({"frame_stride": 2}, "frame_stride"),
    ({"frame_start": "center"}, "frame_start"),
    ({"frame_sampling": "chunk"}, "frame_sampling"),
    ({"frame_windows": 2}, "frame_windows"),
    ({"window_stride": 3}, "window_stride"),
    ({"condition_frame": 1}, "condition_frame"),
    ({"datasets": [{"image_dir": "x", "num_frames": 9}]}, r"datasets\[0\]\.num_frames"),
]


@pytest.mark.parametrize(("fields", "key"), CLIP_KEYS)
def test_frame_keys_on_a_family_of_images_are_refused_by_name(fields, key):
    cfg = from_dict({"model_family": "sdxl", **fields})
    with pytest.raises(
        ConfigError,
        match=rf"^{key}: .* does nothing for model_family sdxl, "
        r"which trains on images; remove it",
    ):
        get_method(cfg, get_family("sdxl", cfg))


def test_frame_keys_pass_on_a_family_of_clips():
    for fields, _ in CLIP_KEYS[:-2]:
        cfg = from_dict({"model_family": "wan", **fields})
        get_method(cfg, get_family("wan", cfg))


FLOW_KEYS = {
    "timestep_sampling": "uniform",
    "logit_mean": 0.5,
    "logit_std": 2.0,
    "mode_scale": 1.0,
    "loss_weighting": "cosmap",
    "flow_shift": 3.0,
}
DDPM_KEYS = {"min_snr_gamma": 5.0, "noise_offset": 0.05}


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [("sd15", k, v) for k, v in FLOW_KEYS.items()]
    + [("sdxl", "loss_weighting", "sigma_sqrt")]
    + [(f, k, v) for f in ("flux", "sd3") for k, v in DDPM_KEYS.items()],
)
def test_objective_keys_of_the_other_draw_are_refused_by_name(family, key, value):
    cfg = from_dict({"model_family": family, key: value})
    with pytest.raises(
        ConfigError, match=rf"^{key}: .* does nothing for model_family {family}, which trains by "
    ):
        get_method(cfg, get_family(family, cfg))


def test_objective_keys_pass_on_the_draw_that_reads_them():
    for family, fields in (("sd15", DDPM_KEYS), ("flux", FLOW_KEYS), ("wan", FLOW_KEYS)):
        cfg = from_dict({"model_family": family, **fields})
        get_method(cfg, get_family(family, cfg))


def test_a_preservation_trigger_found_in_no_caption_is_refused_by_name(tmp_path):
    from kit.train.preserve import check_triggers

    data = _folder(tmp_path / "data")
    keep = {"kind": "output", "class_words": {"photo": "picture", "zorbic": "pink"}}
    cfg = from_dict({"image_dir": str(data), "preservation": keep})
    samples = scan(cfg.data).samples
    with pytest.raises(ConfigError, match=r"class_words: 'zorbic' .*no caption"):
        check_triggers(cfg, samples)
    fine = from_dict(
        {"image_dir": str(data), "preservation": {**keep, "class_words": {"photo": "x"}}}
    )
    check_triggers(fine, samples)
