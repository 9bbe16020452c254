"""The safetensors writer: the same tensors and metadata give the same file bytes in every
process (the library's own writer ordered ``__metadata__`` differently per process), files load
with the safetensors library to equal tensors and metadata, and one ulp changes the bytes."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save

from lockstep_exact.safetensors_io import (
    SafetensorsWriteError,
    safetensors_bytes,
    write_safetensors,
)

META = {f"key{i:02d}": f"value {i}" for i in range(12)} | {"format": "pt", "Ä": "ü"}


def _content() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 5, generator=g)
    return {
        "w.bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "odd.bf16": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: alignment
        "w.fp32": torch.randn(2, 3, generator=g),
        "ids.int32": torch.arange(-3, 4, dtype=torch.int32),
        "ids.int64": torch.tensor([2**40, -1, 7], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "empty.bf16": torch.zeros(3, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "scalar.int64": torch.tensor(-9, dtype=torch.int64),
        "strided.t": wide.t(),  # non-contiguous: a transpose
        "strided.step": wide[::2, 1:4],  # non-contiguous: a strided slice
        "mask": torch.tensor([True, False, True]),
    }


def _header(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_layout_follows_the_spec():
    data = safetensors_bytes(_content(), META)
    n, header = _header(data)
    assert n % 8 == 0 and data[8 + n - 1 : 8 + n] in (b" ", b"}")
    keys = list(header)
    assert keys[0] == "__metadata__"
    assert list(header["__metadata__"]) == sorted(META)
    assert header["__metadata__"] == META
    # tensors widest dtype first, then by name; bytes back to back in header order, no gaps
    assert keys[1:] == [
        "ids.int64", "scalar.int64",
        "empty", "scalar", "strided.step", "strided.t", "w.fp32",
        "ids.int32",
        "empty.bf16", "odd.bf16", "w.bf16",
        "mask",
    ]  # fmt: skip
    size = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "BOOL": 1}
    end = 0
    for name in keys[1:]:
        info = header[name]
        assert list(info) == ["dtype", "shape", "data_offsets"]
        begin, stop = info["data_offsets"]
        assert begin == end and begin % size[info["dtype"]] == 0, name
        end = stop
    assert 8 + n + end == len(data)


def test_bytes_equal_the_library_where_it_is_deterministic():
    """No metadata or one key: the library's bytes were already stable, and ours are the same,
    so no existing file (tiny models: ``model_hash``) changes its hash."""
    content = {k: v.contiguous() for k, v in _content().items()}
    assert safetensors_bytes(content) == save(content)
    assert safetensors_bytes(content, {"format": "pt"}) == save(content, metadata={"format": "pt"})
    assert safetensors_bytes({}) == save({})
    # the library writes '{},"__metadata__":{}}' (not JSON) for no tensors and empty metadata
    # and cannot read it back; ours is valid and loads
    assert _header(safetensors_bytes({}, {}))[1] == {"__metadata__": {}}
    assert load(safetensors_bytes({}, {})) == {}


def test_loads_with_the_safetensors_library(tmp_path):
    content = _content()
    path = write_safetensors(tmp_path / "x.safetensors", content, META)
    for loaded in (load_file(str(path)), load(path.read_bytes())):
        assert sorted(loaded) == sorted(content)
        for name, t in content.items():
            assert _same(loaded[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == META
        assert sorted(f.keys()) == sorted(content)
        for name, t in content.items():
            assert _same(f.get_tensor(name), t), name


def test_lazy_views_are_written_as_their_values():
    z = torch.tensor([1 + 2j, -3 - 0.5j], dtype=torch.complex64)
    loaded = load(safetensors_bytes({"conj": z.conj(), "neg": z.conj().imag}))
    assert torch.equal(loaded["conj"], z.conj().resolve_conj())
    assert torch.equal(loaded["neg"], torch.tensor([-2.0, 0.5]))


def test_old_library_files_load_the_same(tmp_path):
    """Files written before (by the library) and now (by this writer) hold the same content."""
    content = {k: v.contiguous() for k, v in _content().items()}
    old = tmp_path / "old.safetensors"
    old.write_bytes(save(content, metadata=META))
    new = write_safetensors(tmp_path / "new.safetensors", content, META)
    a, b = load_file(str(old)), load_file(str(new))
    assert sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)
    with safe_open(str(old), framework="pt") as f, safe_open(str(new), framework="pt") as g:
        assert f.metadata() == g.metadata() == META


def test_one_ulp_changes_the_bytes():
    content = _content()
    base = safetensors_bytes(content, META)
    assert safetensors_bytes(dict(reversed(list(content.items()))), META) == base
    assert safetensors_bytes(content, dict(reversed(list(META.items())))) == base
    bumped = dict(content)
    t = content["w.bf16"].clone()
    t.view(torch.int16)[1, 2] += 1  # one ulp
    assert not torch.equal(t, content["w.bf16"])
    bumped["w.bf16"] = t
    assert safetensors_bytes(bumped, META) != base
    assert safetensors_bytes(content, META | {"format": "pt2"}) != base


_CHILD = r"""
import hashlib, sys
sys.path.insert(0, sys.argv[1])
from test_safetensors_io import META, _content
from lockstep_exact.adapters import make_adapter
from lockstep_exact.safetensors_io import safetensors_bytes
out = sys.argv[3]
make_adapter(sys.argv[2], out, seed=1)
content = _content()
if sys.argv[4] == "ulp":
    content["w.bf16"].view(__import__("torch").int16)[0, 0] += 1
print(hashlib.sha256(safetensors_bytes(content, META)).hexdigest())
print(hashlib.sha256(open(out + "/adapter_model.safetensors", "rb").read()).hexdigest())
"""


def _child(tmp_path, tiny_dir, tag: str, mode: str = "same") -> list[str]:
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, here, str(tiny_dir), str(tmp_path / tag), mode],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


@pytest.mark.slow
def test_two_processes_write_the_same_bytes(tmp_path):
    """The library's metadata order varied per process, so the check needs two processes: a
    many-key header and a real adapter export give the same sha256 in both; one ulp does not."""
    from lockstep_exact.app.tiny import make_tiny

    tiny_dir = make_tiny(tmp_path / "tiny")
    first = _child(tmp_path, tiny_dir, "a")
    second = _child(tmp_path, tiny_dir, "b")
    assert first == second and len(first) == 2
    here = hashlib.sha256(safetensors_bytes(_content(), META)).hexdigest()
    assert first[0] == here
    bumped = _child(tmp_path, tiny_dir, "c", "ulp")
    assert bumped[0] != first[0] and bumped[1] == first[1]


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ([], None, "safetensors needs a dict of name -> tensor, got list"),
        ({1: torch.zeros(1)}, None, "tensor name 1 is int; safetensors names are str"),
        (
            {"__metadata__": torch.zeros(1)},
            None,
            "tensor name '__metadata__' is reserved for the file's metadata",
        ),
        ({"a": [1.0]}, None, "'a' is list, not a torch.Tensor"),
        (
            {"a": torch.zeros(2, 2).to_sparse()},
            None,
            "'a' has layout torch.sparse_coo; only dense tensors can be written",
        ),
        (
            {"a": torch.zeros(1, dtype=torch.complex128)},
            None,
            "'a' has dtype torch.complex128, which safetensors lacks",
        ),
        (
            {},
            [("a", "b")],
            "safetensors metadata must be a dict of str -> str, got list",
        ),
        (
            {},
            {"step": 3},
            "safetensors metadata must map str -> str; 'step': 3 is str -> int",
        ),
    ],
)
def test_refusals_name_the_problem(tensors, metadata, message):
    with pytest.raises(SafetensorsWriteError) as err:
        safetensors_bytes(tensors, metadata)
    assert str(err.value) == message
