"""One safetensors writer for every file Lockstep writes, so that a file's bytes are a function
of its tensors and metadata alone.

The safetensors library keeps the ``__metadata__`` dict in a hash map whose iteration order
changes from process to process: two saves of the same adapter could differ in their header
bytes although every tensor was equal, and a file's sha256 is what users compare. This module
writes the format itself; reading stays with the safetensors library.

The layout ``safetensors_bytes`` writes::

    8 bytes: N, the header length, unsigned little-endian
    N bytes: the JSON header, UTF-8, compact (no spaces), padded with spaces so N % 8 == 0
    the tensor bytes, one tensor after another in header order, with no gaps

The header is a JSON object. Its first key is ``__metadata__`` (only when metadata is given),
whose value is the metadata with its keys sorted; then one key per tensor, in the order
the library itself uses: by dtype, widest first (``U64``, ``I64``, ``F64``, ... ``BOOL``), then
by name (UTF-8 byte order). That order keeps every tensor aligned to its element size inside
the data section, and makes the output byte-identical to the library's whenever the library's
was already deterministic (no metadata or a single key), so no existing file changes its
hash. Each tensor's value is ``{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}``
with offsets relative to the start of the data section. The raw bytes are the tensor's
elements in row-major order, little-endian (``hashing.tensor_bytes``: CPU, contiguous), so
strided views are written as their contiguous copy.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from .hashing import tensor_bytes

__all__ = ["SafetensorsWriteError", "safetensors_bytes", "write_safetensors"]

METADATA_KEY = "__metadata__"

# torch dtype -> safetensors dtype name, narrowest first: the rank is the library's dtype
# order (its ``Dtype`` enum), which sorts the tensors of a file widest first.
_DTYPES: tuple[tuple[torch.dtype, str], ...] = (
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.complex64, "C64"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
)
_NAME = {dt: name for dt, name in _DTYPES}
_RANK = {dt: i for i, (dt, _) in enumerate(_DTYPES)}


class SafetensorsWriteError(ValueError):
    """Input that cannot be written as a safetensors file (the message names it)."""


def _check(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> None:
    if not isinstance(tensors, Mapping):
        raise SafetensorsWriteError(
            f"safetensors needs a dict of name -> tensor, got {type(tensors).__name__}"
        )
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise SafetensorsWriteError(
                f"tensor name {name!r} is {type(name).__name__}; safetensors names are str"
            )
        if name == METADATA_KEY:
            raise SafetensorsWriteError(
                f"tensor name {METADATA_KEY!r} is reserved for the file's metadata"
            )
        if not isinstance(t, torch.Tensor):
            raise SafetensorsWriteError(f"{name!r} is {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise SafetensorsWriteError(
                f"{name!r} has layout {t.layout}; only dense tensors can be written"
            )
        if t.dtype not in _NAME:
            raise SafetensorsWriteError(f"{name!r} has dtype {t.dtype}, which safetensors lacks")
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise SafetensorsWriteError(
            f"safetensors metadata must be a dict of str -> str, got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SafetensorsWriteError(
                f"safetensors metadata must map str -> str; {key!r}: {value!r} is "
                f"{type(key).__name__} -> {type(value).__name__}"
            )


def safetensors_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` and ``metadata`` (see the module
    docstring for the layout); the same inputs give the same bytes in every process.

    Raises ``SafetensorsWriteError`` naming the entry for a non-str name, the reserved name
    ``__metadata__``, a non-tensor or sparse value, a dtype safetensors lacks, or metadata that
    is not str -> str."""
    if sys.byteorder != "little":  # tensor_bytes gives native order; the format is little-endian
        raise SafetensorsWriteError("safetensors writing needs a little-endian machine")
    _check(tensors, metadata)
    order = sorted(tensors, key=lambda n: (-_RANK[tensors[n].dtype], n.encode("utf-8")))
    header: dict[str, object] = {}
    if metadata is not None:
        header[METADATA_KEY] = {k: metadata[k] for k in sorted(metadata, key=str.encode)}
    chunks: list[bytes] = []
    offset = 0
    for name in order:
        t = tensors[name]
        data = tensor_bytes(t.resolve_conj().resolve_neg())  # lazy conj/neg views
        header[name] = {
            "dtype": _NAME[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``safetensors_bytes(tensors, metadata)`` to ``path`` (plainly, not atomically:
    callers write into a temporary directory that ``atomic.write_dir`` renames); returns it."""
    out = Path(path)
    out.write_bytes(safetensors_bytes(tensors, metadata))
    return out
