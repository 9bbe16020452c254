"""Atomic writes: a file or a directory appears whole at its path, or not at all.

One writer for every artefact Lockstep saves (traces, adapters, checkpoints, model files).
A directory is filled in a temporary directory beside the target (same file system), every
file in it is fsynced, then it is renamed into place and the parent directory is fsynced.
Replacing an existing directory moves the old one aside first and deletes it only after the
new one is in place; if anything fails, the temporary directory is removed and the old
directory is put back. A single file goes through a temporary file beside it and
``os.replace``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from .hashing import sha256_bytes

__all__ = [
    "MANIFEST",
    "fsync_dir",
    "read_manifested",
    "write_dir",
    "write_file",
    "write_manifested",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory (its entries); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_dir(
    target: str | os.PathLike[str],
    files: Mapping[str, bytes] | None = None,
    *,
    fill: Callable[[Path], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Create directory ``target`` atomically and return it.

    Its content is ``files`` (name -> bytes, written in the mapping's order) and whatever
    ``fill(tmp_dir)`` writes into the temporary directory (called after ``files`` are
    written). An existing ``target`` raises ``FileExistsError`` unless ``overwrite``; then the
    old directory is replaced as a whole, never mixed with the new files."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old: Path | None = None
    try:
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        if fill is not None:
            fill(tmp)
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                _fsync_file(path)
        fsync_dir(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rmdir(old)
            os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.rename(old, target)  # put the previous directory back
            old = None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def write_file(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (replacing a file that is there) and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


MANIFEST = "manifest.json"


def write_manifested(target: str | os.PathLike[str], files: Mapping[str, bytes], fmt: str) -> Path:
    """``write_dir`` of ``files`` plus ``manifest.json`` (``fmt`` and the sha256 of every other
    file), written last: it vouches for the rest. Checkpoints are written this way."""
    manifest = {"format": fmt, "files": {n: sha256_bytes(b) for n, b in sorted(files.items())}}
    return write_dir(target, {**files, MANIFEST: json.dumps(manifest, indent=2).encode()})


def read_manifested(
    path: str | os.PathLike[str],
    fmt: str,
    error: type[Exception] = ValueError,
    *,
    what: str = "checkpoint",
    why_format: str = "",
) -> dict[str, bytes]:
    """The files of a ``write_manifested`` directory, each checked against the manifest.

    Raises ``error`` naming the problem: no manifest (a partial or foreign ``what``), a
    corrupted manifest, another format (``why_format`` appended), a file missing or not listed,
    a file whose sha256 differs."""
    d = Path(path)
    if not (d / MANIFEST).is_file():
        raise error(f"{d} has no {MANIFEST}: a partial or foreign {what}")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{d / MANIFEST} is corrupted: {err}") from err
    if manifest.get("format") != fmt:
        raise error(f"{d} is a {manifest.get('format')!r} {what}, not {fmt!r}{why_format}")
    present = {p.name for p in d.iterdir()} - {MANIFEST}
    listed = set(manifest["files"])
    if present != listed:
        raise error(f"{d}: files {sorted(present ^ listed)} are missing or not in the manifest")
    blobs = {}
    for name, digest in manifest["files"].items():
        data = (d / name).read_bytes()
        if sha256_bytes(data) != digest:
            raise error(f"{d / name} is corrupted: sha256 differs from the manifest")
        blobs[name] = data
    return blobs
