"""`kit caption`: a tagger or a captioning model writes captions through the plan → diff →
backup → apply path, only after --apply, and a restore undoes it (caption files it created go).

The captioners are tiny and built here, offline: a WD14-style ONNX tagger whose probabilities
are set by its biases (so which tags pass the thresholds is known), and a random-init BLIP.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from PIL import Image

from kit.cli import main
from kit.config import load_config
from kit.data.captioners import (
    CaptionOptions,
    caption_dataset,
    load_captioner,
    tag_text,
    with_prefix,
)
from kit.data.captions import list_backups
from tests.conftest import lazy_module

onnx = lazy_module("onnx")
lazy_module("onnxruntime")

# (name, category, probability); "blue_background" instead follows the image's blue channel.
TAGS = [
    ("general", 9, 0.99),  # ratings are never written
    ("sensitive", 9, 0.9),
    ("1girl", 0, 0.9),
    ("long_hair", 0, 0.5),
    ("simple_background", 0, 0.4),
    ("blurry", 0, 0.2),  # under the general threshold
    ("^_^", 0, 0.95),  # a kaomoji keeps its underscore
    ("zorb", 0, 0.6),  # the trigger word, also given as --prefix: written once
    ("hatsune_miku", 4, 0.9),
    ("someone_(series)", 4, 0.7),  # a character under the character threshold
    ("blue_background", 0, None),
]
SIZE = 16


def write_tagger(folder: Path) -> Path:
    """model.onnx + selected_tags.csv: mean of each BGR channel → MatMul + bias → Sigmoid."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    n = len(TAGS)
    weight = np.zeros((3, n), np.float32)
    bias = np.zeros(n, np.float32)
    for i, (_, _, p) in enumerate(TAGS):
        if p is None:
            weight[0, i] = 20 / 255  # channel 0 of BGR: blue. Blue image → 10, red → -10.
            bias[i] = -10
        else:
            bias[i] = math.log(p / (1 - p))
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1, 2], keepdims=0),
            helper.make_node("MatMul", ["mean", "weight"], ["logits0"]),
            helper.make_node("Add", ["logits0", "bias"], ["logits"]),
            helper.make_node("Sigmoid", ["logits"], ["output"]),
        ],
        "tiny_tagger",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    rows = ["tag_id,name,category,count"]
    rows += [f"{i},{name},{cat},{100 - i}" for i, (name, cat, _) in enumerate(TAGS)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n")
    return folder


def write_blip(folder: Path) -> Path:
    """A random-init BLIP captioner with a word-level vocabulary, saved with its processor."""
    import torch
    from transformers import (
        BertTokenizer,
        BlipConfig,
        BlipForConditionalGeneration,
        BlipImageProcessor,
        BlipProcessor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "red", "blue", "star"]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(words)}, bos_token="[DEC]")
    processor = BlipProcessor(BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer)
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    config = BlipConfig(
        text_config={
            **small,
            "vocab_size": len(words),
            "num_attention_heads": 2,
            "encoder_hidden_size": 16,
            "max_position_embeddings": 32,
            "bos_token_id": 5,
            "sep_token_id": 3,
            "eos_token_id": 3,
            "pad_token_id": 0,
        },
        vision_config={**small, "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
    )
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(config).eval()
    with torch.no_grad():  # every step says "star": a known, non-empty caption
        model.text_decoder.cls.predictions.bias[words.index("star")] = 100.0
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_florence2(folder: Path) -> Path:
    """A random-init Florence-2 (native transformers classes) whose decoder can only say "star"."""
    import torch
    from transformers import (
        BartTokenizer,
        CLIPImageProcessor,
        Florence2Config,
        Florence2ForConditionalGeneration,
        Florence2Processor,
    )

    words = ["<s>", "<pad>", "</s>", "<unk>", "a", "star", "\u0120a", "\u0120star", "<image>"]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = BartTokenizer(
        vocab=vocab, merges=[], extra_special_tokens={"image_token": "<image>"}
    )
    side = {"height": 64, "width": 64}
    # 64 px through strides 4·2·2·2 is a 2×2 grid, and one pooled token: 5 image tokens.
    images = CLIPImageProcessor(size=side, crop_size=side, do_center_crop=False, image_seq_length=5)
    text = {"vocab_size": len(words), "d_model": 16, "max_position_embeddings": 64}
    for part in ("encoder", "decoder"):
        text |= {f"{part}_layers": 1, f"{part}_attention_heads": 2, f"{part}_ffn_dim": 32}
    text |= {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}
    vision = {
        "depths": [1, 1, 1, 1],
        "embed_dim": [8, 8, 16, 16],
        "num_heads": [1, 1, 2, 2],
        "num_groups": [1, 1, 2, 2],
        "window_size": 2,
        "projection_dim": 16,
        "drop_path_rate": 0.0,
    }
    config = Florence2Config(
        text_config=text, vision_config=vision, image_token_id=vocab["<image>"]
    )
    torch.manual_seed(0)
    model = Florence2ForConditionalGeneration(config).eval()
    gen = model.generation_config
    gen.suppress_tokens = [i for w, i in vocab.items() if w not in ("\u0120star", "<s>", "</s>")]
    gen.min_new_tokens = 3  # not an empty caption
    model.save_pretrained(folder)
    Florence2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tagger(tmp_path_factory) -> Path:
    return write_tagger(tmp_path_factory.mktemp("captioners") / "wd14")


@pytest.fixture()
def folder(tmp_path) -> Path:
    """Four images: two without captions, one with an empty one, one captioned by hand."""
    data = tmp_path / "data"
    data.mkdir()
    for name, colour in [("a", "blue"), ("b", "red"), ("c", "blue"), ("d", "red")]:
        Image.new("RGB", (48, 40), colour).save(data / f"{name}.png")
    (data / "c.txt").write_text("")
    (data / "d.txt").write_text("zorb, drawn by hand\n")
    return data


def _config(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "config.json"
    fields = {
        "model_family": "sd15",
        "resolution": 64,
        "output_dir": str(tmp_path / "run"),
        **fields,
    }
    path.write_text(json.dumps(fields))
    return path


def _texts(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("*.txt"))}


def test_tags_follow_thresholds_prefix_and_spelling(tagger):
    tags = load_captioner("wd14", str(tagger), "cpu", CaptionOptions(prefix="zorb"))
    blue, red = Image.new("RGB", (30, 20), "blue"), Image.new("RGB", (20, 30), "red")
    a, b = tags.caption([blue, red])
    assert a.split(", ") == [
        "hatsune miku",  # character tags first, then each kind most likely first
        "blue background",
        "^_^",
        "1girl",
        "zorb",
        "long hair",
        "simple background",
    ]
    assert "blue background" not in b  # the BGR order and the image reach the model
    assert with_prefix(a, "zorb").split(", ")[:2] == ["zorb", "hatsune miku"]
    assert with_prefix(a, "zorb").count("zorb") == 1
    o = CaptionOptions(general_threshold=0.45, character_threshold=0.6, max_tags=3)
    o.exclude_tags = ["hatsune_miku"]
    (c,) = load_captioner("wd14", str(tagger), "cpu", o).caption([red])
    assert c == "someone (series), ^_^, 1girl"
    assert tag_text("someone_(series)", escape_parens=True) == r"someone \(series\)"


def test_kit_caption_writes_only_with_apply_and_restore_undoes_it(tmp_path, tagger, folder, capsys):
    config = _config(tmp_path, image_dir=str(folder))
    before = _texts(folder)
    args = ["caption", str(config), "--captioner", "wd14", "--model", str(tagger)]
    assert main([*args, "--prefix", "zorb", "--threshold", "0.55"]) == 0
    out = capsys.readouterr().out
    assert "+zorb, hatsune miku, blue background, ^_^, 1girl" in out
    assert "--- /dev/null" in out and "(dry run)" in out
    assert _texts(folder) == before and not list_backups(load_config(config))

    assert main([*args, "--prefix", "zorb", "--threshold", "0.55", "--apply"]) == 0
    out = capsys.readouterr().out
    after = _texts(folder)
    assert after["a.txt"] == "zorb, hatsune miku, blue background, ^_^, 1girl\n"
    assert after["b.txt"] == "zorb, hatsune miku, ^_^, 1girl\n"
    assert after["c.txt"] == "zorb, hatsune miku, blue background, ^_^, 1girl\n"
    assert after["d.txt"] == before["d.txt"]  # a hand-written caption is kept
    (backup,) = list_backups(load_config(config))
    assert str(backup) in out and "2 new caption(s), 1 replaced, 1 kept" in out

    # Nothing left to caption: no model is needed, and nothing changes.
    assert main(["caption", str(config), "--captioner", "wd14", "--model", "/nowhere"]) == 0
    assert "no caption file would change" in capsys.readouterr().out

    assert main(["captions", str(config), "--restore", str(backup)]) == 0
    capsys.readouterr()
    assert _texts(folder) == before  # the two created caption files are gone again

    assert main([*args, "--overwrite", "--max-tags", "1", "--apply"]) == 0
    capsys.readouterr()
    assert set(_texts(folder).values()) == {"hatsune miku\n"}


def test_blip_captions_each_dataset(tmp_path, folder):
    other = tmp_path / "other"
    other.mkdir()
    Image.new("RGB", (32, 32), "green").save(other / "e.png")
    path = _config(
        tmp_path,
        datasets=[{"image_dir": str(folder)}, {"image_dir": str(other), "name": "reg"}],
    )
    cfg = load_config(path)
    blip = write_blip(tmp_path / "blip")
    run = caption_dataset(cfg, "blip", str(blip), CaptionOptions(prefix="zorb", max_new_tokens=3))
    assert [p.name for p in run.plans] == ["data", "reg"]
    assert {c.path.name: c.new for p in run.plans for c in p.changes} == {
        "a.txt": "zorb, star star star\n",
        "b.txt": "zorb, star star star\n",
        "c.txt": "zorb, star star star\n",
        "e.txt": "zorb, star star star\n",
    }
    assert not (other / "e.txt").exists()
    # The command line: --max-new-tokens reaches the model; one backup per dataset folder.
    argv = ["caption", str(path), "--captioner", "blip", "--model", str(blip)]
    assert main([*argv, "--max-new-tokens", "2", "--apply"]) == 0
    assert (other / "e.txt").read_text() == "star star\n"
    assert all((d / ".caption-backups").is_dir() for d in (folder, other))


def test_florence2_captions_every_image_with_overwrite(tmp_path, folder):
    model = write_florence2(tmp_path / "florence2")
    cfg = load_config(_config(tmp_path, image_dir=str(folder)))
    o = CaptionOptions(prefix="zorb", overwrite=True, max_new_tokens=4, task="<CAPTION>")
    run = caption_dataset(cfg, "florence2", str(model), o, apply=True)
    assert "2 new caption(s), 2 replaced, 0 kept" in run.summary() and len(run.backups) == 1
    texts = _texts(folder)
    assert set(texts) == {"a.txt", "b.txt", "c.txt", "d.txt"}
    for text in texts.values():
        prefix, sentence = text.rstrip("\n").split(", ")
        assert prefix == "zorb" and set(sentence.split()) == {"star"}


def test_unloadable_captioners_say_how_to_get_one(tmp_path, tagger, folder, capsys, monkeypatch):
    config = _config(tmp_path, image_dir=str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["wd14", "--model", str(tmp_path / "missing")], ["no such folder", "model.onnx"]),
        (["wd14", "--model", str(empty)], ["has no model.onnx", "selected_tags.csv"]),
        (["blip", "--model", str(empty)], ["cannot load", "save_pretrained", "hub id"]),
        (["florence2", "--model", str(tmp_path / "nope")], ["no such folder", "Florence-2"]),
        (["clip"], ["unknown 'clip'", "wd14"]),
    ]
    for args, words in cases:
        assert main(["caption", str(config), "--captioner", *args]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), (args, err)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["caption", str(config), "--captioner", "wd14", "--model", str(tagger)]) == 2
    assert "pip install onnxruntime" in capsys.readouterr().err
    (tagger_csv,) = [tagger / "selected_tags.csv"]
    assert tagger_csv.is_file()
