"""Broken and unusual image files: each is converted, or skipped with its reason, never fatal."""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kit.config import DataConfig
from kit.data.buckets import place
from kit.data.images import BadImage, open_rgb, probe
from kit.data.pixels import load_pixels
from kit.data.scan import check_dataset, scan
from kit.errors import ConfigError, DataError


def good(path: Path, size=(64, 64), color=(200, 30, 30), caption: str | None = "a photo") -> Path:
    """Save a plain RGB image (and its caption) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def noisy_png(path: Path) -> bytes:
    """A 64×64 noise PNG (noise so that the compressed data is long); returns its bytes."""
    arr = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return path.read_bytes()


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG that claims a size, without the pixel data to back it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def rgb_at(im: Image.Image, x: int = 0, y: int = 0) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(im)[y, x])


def reasons(report) -> dict[str, str]:
    """File name → reason, for every dropped file."""
    return {p.name: why for p, why in report.dropped()}


# ---------------------------------------------------------------- broken files


def test_corrupt_empty_and_truncated_files(tmp_path):
    good(tmp_path / "fine.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG but then nonsense " * 20)
    (tmp_path / "empty.jpg").write_bytes(b"")
    data = noisy_png(tmp_path / "truncated.png")
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    for name in ("corrupt", "empty", "truncated"):
        (tmp_path / f"{name}.txt").write_text(f"a {name} file")

    report = scan(DataConfig(image_dir=str(tmp_path)))
    why = reasons(report)
    assert set(why) == {"corrupt.png", "empty.jpg"}
    assert "not an image" in why["corrupt.png"]
    assert "empty file (0 bytes)" in why["empty.jpg"]
    # A file cut short keeps a good header: it passes the scan and fails when decoded.
    names = [s.image.name for s in report.samples]
    assert names == ["fine.png", "truncated.png"]
    cut = report.samples[1]
    with pytest.raises(BadImage, match="truncated") as err:
        load_pixels(cut.image, place(cut, (64, 64), center=True, seed=0))
    assert isinstance(err.value, DataError) and str(cut.image) in str(err.value)


def test_probe_reads_only_the_header(tmp_path):
    path = tmp_path / "claims-large.png"
    path.write_bytes(png_header(4000, 3000))
    assert probe(path) == (4000, 3000)  # the pixel data is missing, and never looked at
    with pytest.raises(BadImage, match="decode"):
        open_rgb(path)


def test_decompression_bomb_refused_from_its_header(tmp_path):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(30_000, 30_000))  # 900 million pixels in 100 bytes
    bomb.with_suffix(".txt").write_text("a bomb")
    good(tmp_path / "fine.png")
    start = time.perf_counter()
    report = scan(DataConfig(image_dir=str(tmp_path)))
    assert time.perf_counter() - start < 5  # refused from the header, nothing decoded
    assert [s.image.name for s in report.samples] == ["fine.png"]
    assert "decompression bomb" in reasons(report)["bomb.png"]
    assert "max_image_pixels" in reasons(report)["bomb.png"]
    with pytest.raises(BadImage, match="decompression bomb"):
        open_rgb(bomb)
    # The limit is the config's: a lower one refuses an ordinary image too.
    report = scan(DataConfig(image_dir=str(tmp_path), max_image_pixels=1000))
    assert "4,096 pixels" in reasons(report)["fine.png"]


def test_tiny_images_are_skipped(tmp_path):
    good(tmp_path / "thin.png", size=(16, 64))
    good(tmp_path / "fine.png", size=(64, 32))
    report = scan(DataConfig(image_dir=str(tmp_path)))
    assert [s.image.name for s in report.samples] == ["fine.png"]
    assert "too small: 16x64" in reasons(report)["thin.png"]
    report = scan(DataConfig(image_dir=str(tmp_path), min_image_size=8))
    assert len(report.samples) == 2


def test_default_limits_keep_the_example_dataset(dataset):
    report = scan(DataConfig(image_dir=str(dataset)))
    assert len(report.samples) == 24 and not report.dropped() and not report.entries()


# ---------------------------------------------------------------- colour modes


def test_cmyk_becomes_rgb(tmp_path):
    path = tmp_path / "print.jpg"
    Image.new("CMYK", (40, 40), (0, 255, 255, 0)).save(path, quality=100)  # pure red ink
    im = open_rgb(path)
    assert im.mode == "RGB"
    r, g, b = rgb_at(im, 20, 20)
    assert r > 230 and g < 25 and b < 25


def test_sixteen_bit_keeps_its_range(tmp_path):
    path = tmp_path / "scan16.png"
    arr = np.array([[0, 32896, 65535, 1000]], dtype=np.uint16).repeat(4, axis=0)
    Image.fromarray(arr).save(path)
    assert Image.open(path).mode.startswith("I")
    im = open_rgb(path)
    assert im.mode == "RGB"
    # Scaled, not clipped: a plain convert would make everything above 255 white.
    assert [rgb_at(im, x)[0] for x in range(4)] == [0, 128, 255, 4]


def test_palette_images(tmp_path):
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    pal.putpixel((0, 0), 0)
    plain = tmp_path / "plain.png"
    pal.save(plain)
    im = open_rgb(plain, "white")
    assert rgb_at(im, 1, 1) == (10, 200, 30) and rgb_at(im, 0, 0) == (0, 0, 0)
    # Palette entry 0 transparent: the background shows through there.
    clear = tmp_path / "clear.png"
    pal.save(clear, transparency=0)
    im = open_rgb(clear, "#102030")
    assert rgb_at(im, 0, 0) == (16, 32, 48) and rgb_at(im, 1, 1) == (10, 200, 30)


def test_alpha_is_composited_on_the_background(tmp_path):
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((1, 1), (0, 0, 0, 128))  # half-transparent black
    rgba.putpixel((2, 2), (0, 0, 255, 255))  # opaque blue
    path = tmp_path / "cutout.png"
    rgba.save(path)
    im = open_rgb(path)  # white by default
    assert rgb_at(im, 0, 0) == (255, 255, 255)
    assert all(abs(v - 127) <= 1 for v in rgb_at(im, 1, 1))
    assert rgb_at(im, 2, 2) == (0, 0, 255)
    assert rgb_at(open_rgb(path, "black"), 0, 0) == (0, 0, 0)
    assert rgb_at(open_rgb(path, "#00ff00"), 0, 0) == (0, 255, 0)

    la = Image.new("LA", (4, 4), (50, 0))
    la.putpixel((3, 3), (50, 255))
    la_path = tmp_path / "gray.png"
    la.save(la_path)
    im = open_rgb(la_path, "#ff8800")
    assert rgb_at(im, 0, 0) == (255, 136, 0) and rgb_at(im, 3, 3) == (50, 50, 50)


def test_alpha_background_reaches_the_training_pixels(tmp_path):
    Image.new("RGBA", (64, 64), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    (tmp_path / "clear.txt").write_text("nothing at all")
    cfg = DataConfig(image_dir=str(tmp_path), alpha_background="black")
    (s,) = check_dataset(cfg).samples
    pixels = load_pixels(s.image, place(s, (64, 64), True, 0), cfg.alpha_background)
    assert pixels.min() == pixels.max() == -1.0  # black in [-1, 1]
    pixels = load_pixels(s.image, place(s, (64, 64), True, 0), "white")
    assert pixels.min() == 1.0


@pytest.mark.parametrize("value", ["#fff", "rgb(1,2,3)", "notacolour", "#12345g"])
def test_alpha_background_is_checked(value):
    with pytest.raises(ConfigError, match="alpha_background") as err:
        DataConfig(alpha_background=value)
    assert repr(value) in str(err.value)


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (80, 40), (255, 0, 0))
    im.paste((0, 0, 255), (40, 0, 80, 40))  # stored: red left, blue right
    exif = Image.Exif()
    exif[274] = 6  # displayed rotated 90° clockwise: red on top
    path = tmp_path / "phone.jpg"
    im.save(path, exif=exif, quality=95)
    assert probe(path) == (40, 80)
    upright = open_rgb(path)
    assert upright.size == (40, 80)
    assert rgb_at(upright, 20, 5)[0] > 200 and rgb_at(upright, 20, 75)[2] > 200


# ---------------------------------------------------------------- names and captions


def test_caption_that_is_not_utf8_is_kept_with_a_warning(tmp_path):
    good(tmp_path / "cafe.png", caption=None)
    cap = tmp_path / "cafe.txt"
    cap.write_bytes("a photo in a café".encode("latin-1"))
    report = scan(DataConfig(image_dir=str(tmp_path)))
    (s,) = report.samples
    assert s.caption == "a photo in a caf\ufffd"
    ((path, why),) = report.warnings
    assert path == cap and "not UTF-8" in why
    (entry,) = report.entries()
    assert entry == {"file": str(cap), "reason": why, "skipped": False}


def test_non_ascii_file_names(tmp_path):
    for name in ("café_ü.png", "日本の猫.png", "ñandú.jpg"):
        good(tmp_path / name, caption=f"a picture called {name}")
    report = scan(DataConfig(image_dir=str(tmp_path)))
    assert not report.dropped()
    by_name = {s.image.name: s for s in report.samples}
    assert by_name["日本の猫.png"].caption == "a picture called 日本の猫.png"
    s = by_name["café_ü.png"]
    assert load_pixels(s.image, place(s, (64, 64), True, 0)).shape == (3, 64, 64)


def test_duplicate_stems_skip_both(tmp_path):
    good(tmp_path / "cat.png")
    good(tmp_path / "cat.jpg", caption="which one am I")
    good(tmp_path / "dog.png")
    report = scan(DataConfig(image_dir=str(tmp_path)))
    assert [s.image.name for s in report.samples] == ["dog.png"]
    why = reasons(report)
    assert set(why) == {"cat.png", "cat.jpg"}
    assert "ambiguous caption" in why["cat.png"] and "cat.jpg, cat.png" in why["cat.png"]
    assert not report.orphan_captions  # cat.txt is accounted for by the skipped pair
    # Captions from the file name are not ambiguous: both images train.
    report = scan(DataConfig(image_dir=str(tmp_path), caption_strategy="filename"))
    assert len(report.samples) == 3


# ---------------------------------------------------------------- folders


def test_symlink_loop_terminates(tmp_path):
    root = tmp_path / "data"
    good(root / "a.png")
    good(root / "sub" / "b.png")
    os.symlink(root, root / "sub" / "back-to-root")
    report = scan(DataConfig(image_dir=str(root)))
    assert sorted(s.image.name for s in report.samples) == ["a.png", "b.png"]
    assert "folder link" in reasons(report)["back-to-root"]


def test_linked_folder_outside_is_read(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    good(elsewhere / "c.png")
    root = tmp_path / "data"
    good(root / "a.png")
    os.symlink(elsewhere, root / "more")
    report = scan(DataConfig(image_dir=str(root)))
    assert sorted(s.image.name for s in report.samples) == ["a.png", "c.png"]


def test_no_usable_file_is_a_clear_error(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    good(tmp_path / "b.png", size=(8, 8))
    with pytest.raises(DataError) as err:
        check_dataset(DataConfig(image_dir=str(tmp_path)))
    msg = str(err.value)
    assert "no usable images" in msg and "all 2 file(s)" in msg
    assert "empty file" in msg and "too small" in msg


def test_summary_and_entries(tmp_path):
    good(tmp_path / "fine.png")
    (tmp_path / "zero.png").write_bytes(b"")
    good(tmp_path / "nocap.png", caption=None)
    report = scan(DataConfig(image_dir=str(tmp_path)))
    line = report.summary()
    assert "1 of 3 file(s) usable" in line and "2 skipped" in line and "\n" not in line
    entries = report.entries()
    assert {e["file"] for e in entries} == {str(tmp_path / "zero.png"), str(tmp_path / "nocap.png")}
    assert all(e["skipped"] and e["reason"] for e in entries)
