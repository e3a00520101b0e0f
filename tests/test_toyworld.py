"""Tests for the procedural toy world and its example dataset."""

from collections import Counter

import pytest
from PIL import Image

from kit.toy import world as toyworld
from kit.toy.world import (
    BACKGROUNDS,
    COLORS,
    CONCEPT_COLORS,
    CONCEPT_SHAPES,
    CONCEPT_SIZE,
    EXAMPLE_SIZES,
    SHAPES,
    TRIGGER_WORD,
    Scene,
    caption,
    render,
    sample_scenes,
    shape_box,
    write_example_dataset,
)

ALL_SHAPES = SHAPES + CONCEPT_SHAPES


def _close(a: tuple[int, ...], b: tuple[int, ...], tol: int = 3) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def test_same_seed_same_scenes_and_pixels():
    a = sample_scenes(12, seed=7, shapes=ALL_SHAPES)
    b = sample_scenes(12, seed=7, shapes=ALL_SHAPES)
    assert [caption(s) for s in a] == [caption(s) for s in b]
    for x, y in zip(a, b, strict=True):
        assert render(x, 96, 64).tobytes() == render(y, 96, 64).tobytes()
    assert sample_scenes(12, seed=8, shapes=ALL_SHAPES) != a


def test_caption_names_every_attribute():
    scene = Scene("red", "circle", "large", "white", "left")
    assert caption(scene) == "a large red circle on a white background, on the left"
    for scene in sample_scenes(30, seed=1, shapes=ALL_SHAPES):
        words = set(caption(scene).replace(",", "").split())
        assert {scene.color, scene.shape, scene.size, scene.background, scene.position} <= words


def test_unknown_attribute_is_refused():
    with pytest.raises(ValueError, match="shape 'hexagon'"):
        Scene("red", "hexagon", "small", "white", "left")


@pytest.mark.parametrize("shape", ALL_SHAPES)
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("position", ["left", "center", "right"])
@pytest.mark.parametrize("width,height", [(128, 128), (192, 128), (128, 192)])
def test_shape_colour_at_centre_and_background_in_corner(shape, size, position, width, height):
    scene = Scene("blue", shape, size, "gray", position)
    image = render(scene, width, height)
    assert image.mode == "RGB" and image.size == (width, height)
    left, top, right, bottom = shape_box(scene, width, height)
    assert 0 <= left and right <= width and 0 <= top and bottom <= height
    centre = image.getpixel((int((left + right) / 2), int((top + bottom) / 2)))
    assert _close(centre, COLORS["blue"])
    for corner in [(0, 0), (width - 1, 0), (0, height - 1), (width - 1, height - 1)]:
        assert image.getpixel(corner) == BACKGROUNDS["gray"]


def test_positions_move_the_shape():
    boxes = [
        shape_box(Scene("red", "square", "small", "black", p), 192, 128) for p in toyworld.POSITIONS
    ]
    assert boxes[0][0] < boxes[1][0] < boxes[2][0]


def test_default_sampling_never_draws_the_concept_and_is_balanced():
    scenes = sample_scenes(300, seed=0)
    assert {s.shape for s in scenes} == set(SHAPES)
    assert not {s.shape for s in scenes} & set(CONCEPT_SHAPES)
    assert not {s.color for s in scenes} & set(CONCEPT_COLORS)
    counts = Counter(s.color for s in scenes)
    assert set(counts) == set(COLORS) and max(counts.values()) - min(counts.values()) <= 1


def test_example_dataset(tmp_path):
    paths = write_example_dataset(tmp_path, n=7, seed=0, priors=6)
    assert len(paths) == 13
    concept, priors = paths[:7], paths[7:]
    names = [f"zorbic_{i:03d}" for i in range(7)] + [f"prior_{i:03d}" for i in range(6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{n}.png" for n in names] + [f"{n}.txt" for n in names]
    )
    for path in concept:
        assert TRIGGER_WORD in path.with_suffix(".txt").read_text().split(" ")
        with Image.open(path) as image:
            assert image.mode == "RGB" and image.size == CONCEPT_SIZE
            # The concept's exact pink is drawn.
            assert CONCEPT_COLORS[TRIGGER_WORD] in {c for _, c in image.getcolors(1 << 16)}
    scenes = []
    for i, path in enumerate(priors):
        text = path.with_suffix(".txt").read_text().strip()
        assert TRIGGER_WORD not in text
        scenes.append(next(s for s in sample_scenes(6, 1) if caption(s) == text))
        with Image.open(path) as image:
            assert image.size == EXAMPLE_SIZES[i % len(EXAMPLE_SIZES)]
    # The prior images show the base world, every color at most once more than another.
    assert {s.color for s in scenes} == set(COLORS)


def test_example_dataset_sizes_and_counts(tmp_path):
    paths = write_example_dataset(tmp_path, n=6, seed=0, priors=0, sizes=EXAMPLE_SIZES)
    for i, path in enumerate(paths):
        with Image.open(path) as image:
            assert image.size == EXAMPLE_SIZES[i % len(EXAMPLE_SIZES)]
    with pytest.raises(ValueError, match="priors must be >= 0"):
        write_example_dataset(tmp_path, n=1, priors=-1)
    with pytest.raises(ValueError, match="sizes must not be empty"):
        write_example_dataset(tmp_path, n=1, sizes=())


def test_example_dataset_is_idempotent(tmp_path):
    first = {
        p.name: p.read_bytes() for p in write_example_dataset(tmp_path / "a", n=5, seed=3, priors=0)
    }
    write_example_dataset(tmp_path / "a", n=5, seed=3, priors=0)
    again = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir() if p.suffix == ".png"}
    assert first == again
    assert len(list((tmp_path / "a").iterdir())) == 10  # no temporary files left behind
