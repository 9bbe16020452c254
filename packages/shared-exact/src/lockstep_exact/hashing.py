"""SHA-256 helpers: bytes, files, tensors and model/adapter directories.

Every function returns a lowercase hex digest. The tensor and directory digests are framed
(a domain tag, then length-free fields separated by NUL bytes) so that two different inputs
cannot produce the same byte stream:

``tensor_sha256(t)`` hashes::

    b"lockstep.tensor.v1\\0" + dtype + b"\\0" + shape + b"\\0" + raw bytes

where ``dtype`` is the short torch name (``float32``, ``bfloat16``, ``int64`` ...), ``shape`` is
the sizes in decimal joined by ``,`` (empty for a 0-d tensor), and the raw bytes are the
tensor's elements in row-major (C-contiguous) order, in the machine's native byte order
(little-endian on every platform Lockstep runs on). The tensor is moved to the CPU and made
contiguous first, so a strided view and its contiguous copy hash the same, and two tensors with
the same bytes but another dtype or shape do not.

``dir_sha256(path, patterns)`` hashes::

    b"lockstep.dir.v1\\0" + for each file, in sorted order of its relative POSIX name:
        name + b"\\0" + size in decimal + b"\\0" + sha256(file bytes) (32 raw bytes)

over the files below ``path`` (recursively) whose name matches one of ``patterns``. Absolute
paths, timestamps and permissions are not part of it, so the digest is the same on any machine.
"""

from __future__ import annotations

import ctypes
import fnmatch
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_DIR_PATTERNS",
    "dir_sha256",
    "sha256_bytes",
    "sha256_file",
    "tensor_bytes",
    "tensor_sha256",
]

_CHUNK = 1 << 20
_TENSOR_TAG = b"lockstep.tensor.v1\0"
_DIR_TAG = b"lockstep.dir.v1\0"
DEFAULT_DIR_PATTERNS: tuple[str, ...] = ("*.safetensors", "config.json")


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.digest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    return _file_digest(Path(path)).hex()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw element bytes of ``t``: CPU, C-contiguous, native byte order."""
    flat = t.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return b""
    return ctypes.string_at(flat.data_ptr(), nbytes)


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's dtype, shape and raw bytes (see the module docstring)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_sha256 needs a torch.Tensor, got {type(t).__name__}")
    h = hashlib.sha256(_TENSOR_TAG)
    h.update(_dtype_name(t.dtype).encode("ascii") + b"\0")
    h.update(",".join(str(s) for s in t.shape).encode("ascii") + b"\0")
    h.update(tensor_bytes(t))
    return h.hexdigest()


def _matching_files(root: Path, patterns: Iterable[str]) -> list[tuple[str, Path]]:
    pats = tuple(patterns)
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fname in filenames:
            if any(fnmatch.fnmatchcase(fname, p) for p in pats):
                full = Path(dirpath) / fname
                found[full.relative_to(root).as_posix()] = full
    # Sort on the UTF-8 bytes of the name: the same order under every locale.
    return sorted(found.items(), key=lambda kv: kv[0].encode("utf-8"))


def dir_sha256(
    path: str | os.PathLike[str],
    patterns: Iterable[str] = DEFAULT_DIR_PATTERNS,
) -> str:
    """Hex sha256 of a model or adapter directory (see the module docstring).

    Files are matched on their base name (``fnmatch``, case-sensitive) anywhere below ``path``.
    Raises ``FileNotFoundError`` when ``path`` is not a directory or no file matches: the hash
    of nothing would silently identify every empty directory.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"dir_sha256: {root} is not a directory")
    pats = tuple(patterns)
    if not pats:
        raise ValueError("dir_sha256: patterns is empty")
    files = _matching_files(root, pats)
    if not files:
        raise FileNotFoundError(f"dir_sha256: no file under {root} matches {list(pats)}")
    h = hashlib.sha256(_DIR_TAG)
    for name, full in files:
        h.update(name.encode("utf-8") + b"\0")
        h.update(str(full.stat().st_size).encode("ascii") + b"\0")
        h.update(_file_digest(full))
    return h.hexdigest()
