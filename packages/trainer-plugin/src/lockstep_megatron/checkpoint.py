"""Checkpoints of the ladder's training job (``run.Job``): the policy session's state files
(``session.PolicySession.state_files``: fp32 adapter masters, AdamW state, the micro-batch
generator, the position: the one trainer state format, which ``lockstep train``'s checkpoints
hold too) and ``job.json``: what they continue, the training settings (``settings``: the
trace's sha256, lr, rank, alpha, seed, micro-batch, the advantages) and the job's identity
(``identity``: contract fingerprint, model hash, adapter-in hash, steps, ...). A resume
compares both with the job that resumes (``check_resume``) and refuses, naming the field, a
checkpoint made for anything else.

Written atomically (``lockstep_exact.atomic.write_manifested``): every file goes into a temporary
directory beside the target and is fsynced, ``manifest.json`` (the sha256 of every other file)
is written last, then the directory is renamed into place. ``load`` refuses a directory without
a manifest (a partial write), a file whose sha256 differs (corruption), or a missing/extra file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep_exact.atomic import read_manifested, write_manifested

FORMAT = "lockstep.megatron.checkpoint/3"
JOB = "job.json"


class CheckpointError(ValueError):
    """A checkpoint that is partial, corrupted, not one of ours, or made for another job."""


def save_checkpoint(path: str | Path, trainer_files: Mapping[str, bytes], job: dict) -> Path:
    """Write ``trainer_files`` (a session's ``state_files()``) and ``job`` (``position``,
    ``settings``, ``identity``) to ``path``, atomically; never over an existing one."""
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} exists; checkpoints are never overwritten in place")
    if not isinstance(job.get("settings"), Mapping) or not job["settings"]:
        raise CheckpointError("a checkpoint needs the training settings it was made with")
    meta = (json.dumps(job, indent=2, sort_keys=True) + "\n").encode()
    return write_manifested(target, {**trainer_files, JOB: meta}, FORMAT)


def _canonical(value: Any) -> Any:
    """JSON's view of a value (tuples become lists), so recorded and live values compare."""
    return json.loads(json.dumps(value))


def check_resume(
    recorded: Mapping[str, Any],
    current: Mapping[str, Any],
    where: str,
    free: tuple[str, ...] = (),
) -> None:
    """Refuse to resume when a recorded setting differs from this job's, naming the field.

    A field the job has but the checkpoint lacks (or the reverse) is refused the same way.
    Fields in ``free`` are recorded for the record and may differ (a resumed job may run
    another number of steps: continuing is what resuming is for)."""
    keys = [*current, *(k for k in recorded if k not in current)]  # the job's order first
    for key in (k for k in keys if k not in free):
        if key not in recorded:
            raise CheckpointError(
                f"{where} does not record {key!r} (this job has {current[key]!r}); "
                "refusing to resume"
            )
        if key not in current:
            raise CheckpointError(
                f"{where} records {key!r} = {recorded[key]!r}, which this job does not set; "
                "refusing to resume"
            )
        if _canonical(recorded[key]) != _canonical(current[key]):
            raise CheckpointError(
                f"{where} was made with {key} = {recorded[key]!r}, this job has "
                f"{current[key]!r}; refusing to resume"
            )


def load_checkpoint(path: str | Path) -> tuple[dict[str, bytes], dict]:
    """(the session's state files, the job record), or ``CheckpointError`` naming what is
    damaged."""
    blobs = read_manifested(
        path,
        FORMAT,
        CheckpointError,
        why_format=" (older ones hold another trainer state format)",
    )
    job = json.loads(blobs.pop(JOB))
    return blobs, job
