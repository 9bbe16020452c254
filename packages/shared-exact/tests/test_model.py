"""ModelDir: a model directory parsed once; the model hash covers weights, config, tokenizer."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.hashing import dir_sha256
from lockstep_exact.lanes.qwen3 import Geometry, UnsupportedModel
from lockstep_exact.model import TOKENIZER_FILES, ModelDir, lane_contract, model_hash


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("m"), arch="qwen3-moe", hidden=64, vocab=300)


def copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_model_dir_is_parsed_once_into_geometry_contract_and_hash(tiny):
    m = ModelDir(tiny)
    assert m.geometry == Geometry.from_model_dir(tiny) and m.family == "qwen3-moe"
    assert m.config == json.loads((tiny / "config.json").read_text())
    assert m.contract().fingerprint == lane_contract(tiny).fingerprint
    assert m.model_hash == model_hash(tiny) != dir_sha256(tiny)
    assert ModelDir.of(m) is m


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_changed_tokenizer_or_config_file_moves_the_model_hash(tiny, tmp_path, name):
    other = copy(tiny, tmp_path / "other")
    assert model_hash(other) == model_hash(tiny)
    data = json.loads((other / name).read_text())
    # config.json: a key without numerics (the geometry stays); tokenizer: one more field
    data["bos_token_id" if name == "config.json" else "_lockstep_test"] = 7
    (other / name).write_text(json.dumps(data))
    assert model_hash(other) != model_hash(tiny)


def test_every_tokenizer_file_kind_is_hashed(tiny, tmp_path):
    other = copy(tiny, tmp_path / "other")
    before = model_hash(other)
    for name in TOKENIZER_FILES:
        if not (other / name).exists():
            (other / name).write_text("x")
            after = model_hash(other)
            assert after != before, name
            before = after


def test_a_directory_without_config_or_with_bad_json_is_refused(tmp_path):
    with pytest.raises(UnsupportedModel, match="no config.json: not an HF model directory"):
        ModelDir(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(UnsupportedModel, match="config.json is not valid JSON"):
        ModelDir(tmp_path)


def test_a_tokenizer_with_ids_past_the_vocab_size_is_refused(tiny, tmp_path):
    other = copy(tiny, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    tok = json.loads((other / "tokenizer.json").read_text())
    top = max(tok["model"]["vocab"].values())
    cfg["vocab_size"] = top  # one short: the tokenizer's last id has no embedding row
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModel,
        match=f"has token id {top} but config.json vocab_size is {top}: the tokenizer belongs "
        "to another model",
    ):
        ModelDir(other)
    cfg["vocab_size"] = top + 1
    (other / "config.json").write_text(json.dumps(cfg))
    assert ModelDir(other).config["vocab_size"] == top + 1


def test_a_truncated_or_damaged_weight_file_is_refused(tiny, tmp_path):
    import os

    cut = copy(tiny, tmp_path / "cut")
    weights = cut / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(
        UnsupportedModel, match="model.safetensors cannot be read: corrupted or trunc"
    ):
        ModelDir(cut)
    damaged = copy(tiny, tmp_path / "damaged")
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[10:20] = b"\xff" * 10  # inside the JSON header
    (damaged / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(UnsupportedModel, match="cannot be read: corrupted or truncated"):
        ModelDir(damaged)


@pytest.mark.parametrize(("dtype", "name"), [("float32", "F32"), ("float16", "F16")])
def test_weights_other_than_bf16_are_refused(tiny, tmp_path, dtype, name):
    import torch
    from safetensors.torch import load_file, save_file

    other = copy(tiny, tmp_path / "other")
    weights = load_file(str(other / "model.safetensors"))
    save_file(
        {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, other / "model.safetensors"
    )
    with pytest.raises(
        UnsupportedModel, match=rf"is {name} \(\d+ tensor\(s\) not bf16\); the exact"
    ):
        ModelDir(other)
