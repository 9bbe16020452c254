"""Checkpoints of a LoRA run: adapters (fp32 masters), AdamW state, RNG, data position, and
the identity of what they train (contract fingerprint, model hash, adapter-in hash).

Written atomically: every file goes into a temporary directory beside the target and is
fsynced, ``manifest.json`` (the sha256 of every other file) is written last, then the
directory is renamed into place. ``load`` refuses a directory without a manifest (a partial
write), a file whose sha256 differs (corruption), or a missing/extra file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load, save

from lockstep_exact.hashing import sha256_bytes

MANIFEST = "manifest.json"
FORMAT = "lockstep.megatron.checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that is partial, corrupted, or not one of ours."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(state: dict) -> dict[str, bytes]:
    meta = {
        "position": state["position"],
        "config": state["config"],
        "identity": state.get("identity", {}),
    }
    return {
        "adapters.safetensors": save({k: v.contiguous() for k, v in state["adapters"].items()}),
        "optimizer.safetensors": save({k: v.contiguous() for k, v in state["optimizer"].items()}),
        "rng.safetensors": save({k: v.contiguous() for k, v in state["rng"].items()}),
        "meta.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode(),
    }


def save_checkpoint(state: dict, path: str | Path) -> Path:
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} exists; checkpoints are never overwritten in place")
    target.parent.mkdir(parents=True, exist_ok=True)
    files = _files(state)
    manifest = {"format": FORMAT, "files": {n: sha256_bytes(b) for n, b in sorted(files.items())}}
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        for name, data in [*files.items(), (MANIFEST, json.dumps(manifest, indent=2).encode())]:
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_checkpoint(path: str | Path) -> dict:
    d = Path(path)
    if not (d / MANIFEST).is_file():
        raise CheckpointError(f"{d} has no {MANIFEST}: a partial or foreign checkpoint")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{d / MANIFEST} is corrupted: {err}") from err
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{d} is not a {FORMAT} checkpoint")
    present = {p.name for p in d.iterdir()} - {MANIFEST}
    listed = set(manifest["files"])
    if present != listed:
        raise CheckpointError(
            f"{d}: files {sorted(present ^ listed)} are missing or not in the manifest"
        )
    blobs = {}
    for name, digest in manifest["files"].items():
        data = (d / name).read_bytes()
        if sha256_bytes(data) != digest:
            raise CheckpointError(f"{d / name} is corrupted: sha256 differs from the manifest")
        blobs[name] = data
    meta = json.loads(blobs["meta.json"])
    return {
        "adapters": load(blobs["adapters.safetensors"]),
        "optimizer": load(blobs["optimizer.safetensors"]),
        "rng": load(blobs["rng.safetensors"]),
        "position": meta["position"],
        "config": meta["config"],
        "identity": meta.get("identity", {}),
    }
