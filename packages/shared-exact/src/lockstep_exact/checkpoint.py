"""Training checkpoints: one container for every training job.

A checkpoint is a directory: the trainer session's state files (the trainer plugin's one state
format: fp32 adapter masters, AdamW state, the micro-batch generator, the position) and
``record.json``, what the job that wrote it needs to continue (``kind``: which job wrote it,
``ladder`` for the qualify ladder's training gate or ``train`` for ``lockstep train``; the rest
is that job's own record). Written atomically (``atomic.write_manifested``: a temporary
directory beside the target, every file fsynced, ``manifest.json`` with the sha256 of every
other file written last, then a rename). ``load_checkpoint`` refuses a partial or corrupted
directory, another format, or a checkpoint another kind of job wrote, naming which.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .atomic import read_manifested, write_manifested

FORMAT = "lockstep.checkpoint/1"
RECORD = "record.json"
KINDS = ("ladder", "train")


class CheckpointError(ValueError):
    """A checkpoint that is partial, corrupted, not one of ours, or made for another job."""


def save_checkpoint(
    path: str | Path, state_files: Mapping[str, bytes], kind: str, record: Mapping[str, Any]
) -> Path:
    """Write a session's ``state_files`` and the job's ``record`` to ``path``, atomically;
    never over an existing directory."""
    if kind not in KINDS:
        raise CheckpointError(f"checkpoint kind {kind!r}: one of {KINDS}")
    if RECORD in state_files:
        raise CheckpointError(f"a trainer state file may not be named {RECORD}")
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} exists; checkpoints are never overwritten in place")
    body = {"kind": kind, **record}
    meta = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    return write_manifested(target, {**state_files, RECORD: meta}, FORMAT)


def load_checkpoint(
    path: str | Path, kind: str, error: type[Exception] = CheckpointError
) -> tuple[dict[str, bytes], dict]:
    """(the session's state files, the job's record without ``kind``), or ``error`` naming
    what is damaged or which job the checkpoint belongs to."""
    files = read_manifested(
        path, FORMAT, error, why_format=" (older ones hold another trainer state format)"
    )
    if RECORD not in files:
        raise error(f"{path} has no {RECORD}: not a training checkpoint")
    record = json.loads(files.pop(RECORD))
    found = record.pop("kind", None)
    if found != kind:
        jobs = {"ladder": "the qualify ladder's training gate", "train": "`lockstep train`"}
        raise error(
            f"{path} was written by {jobs.get(found, repr(found))}, not by "
            f"{jobs[kind]}: resume it with the job that wrote it"
        )
    return files, record
