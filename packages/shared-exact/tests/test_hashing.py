"""sha256 helpers: documented framing, stability, and one-ulp sensitivity."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from lockstep_exact.hashing import dir_sha256, sha256_bytes, sha256_file, tensor_sha256


def test_sha256_file_equals_sha256_of_its_bytes(tmp_path):
    data = bytes(range(256)) * 5000  # > 1 MiB: more than one chunk
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == sha256_bytes(data) == hashlib.sha256(data).hexdigest()


def test_tensor_sha256_follows_the_documented_framing():
    t = torch.tensor([[1.0, -2.0, 3.5]], dtype=torch.float32)
    want = hashlib.sha256(
        b"lockstep.tensor.v1\0float32\0" + b"1,3\0" + t.numpy().tobytes()
    ).hexdigest()
    assert tensor_sha256(t) == want
    scalar = torch.tensor(7, dtype=torch.int64)
    want = hashlib.sha256(b"lockstep.tensor.v1\0int64\0\0" + (7).to_bytes(8, "little"))
    assert tensor_sha256(scalar) == want.hexdigest()


def test_tensor_sha256_folds_in_dtype_and_shape():
    t = torch.arange(6, dtype=torch.int32)
    assert tensor_sha256(t) != tensor_sha256(t.reshape(2, 3))  # same bytes, other shape
    assert tensor_sha256(t) != tensor_sha256(t.view(torch.float32))  # same bytes, other dtype
    assert tensor_sha256(t) == tensor_sha256(t.clone())


def test_tensor_sha256_of_a_strided_view_equals_its_contiguous_copy():
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert not t.t().is_contiguous()
    assert tensor_sha256(t.t()) == tensor_sha256(t.t().contiguous())
    assert tensor_sha256(t.t()) != tensor_sha256(t)


def test_tensor_sha256_detects_a_one_ulp_change():
    t = torch.linspace(-3, 3, 101, dtype=torch.float32)
    moved = t.clone()
    moved.view(torch.int32)[50] += 1
    assert tensor_sha256(moved) != tensor_sha256(t)
    neg = torch.tensor([0.0], dtype=torch.float32)
    assert tensor_sha256(neg) != tensor_sha256(-neg)  # +0.0 and -0.0 are other bytes


def _model(d):
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"a": 1}\n')
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 100)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 50)
    return d


def test_dir_sha256_does_not_depend_on_location_or_unmatched_files(tmp_path):
    a = _model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    (b / "README.md").write_text("not part of the model")
    (b / "tokenizer.json").write_text("{}")
    assert dir_sha256(a) == dir_sha256(b)
    assert dir_sha256(a, patterns=("*.json",)) != dir_sha256(a)


def test_dir_sha256_detects_changed_renamed_and_missing_files(tmp_path):
    a = _model(tmp_path / "a")
    base = dir_sha256(a)
    (a / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 49 + b"\x03")
    changed = dir_sha256(a)
    assert changed != base
    (a / "model-00002-of-00002.safetensors").rename(a / "model-2.safetensors")
    assert dir_sha256(a) not in (base, changed)
    (a / "model-2.safetensors").unlink()
    assert dir_sha256(a) not in (base, changed)


def test_dir_sha256_covers_files_in_subdirectories(tmp_path):
    a = _model(tmp_path / "a")
    base = dir_sha256(a)
    (a / "sub").mkdir()
    (a / "sub" / "extra.safetensors").write_bytes(b"x")
    assert dir_sha256(a) != base


def test_dir_sha256_refuses_a_directory_without_matching_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no file under"):
        dir_sha256(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        dir_sha256(tmp_path / "missing")
