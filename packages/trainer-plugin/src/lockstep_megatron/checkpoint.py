"""Checkpoints of the ladder's training job (``run.Job``), in the one training checkpoint
container (``lockstep_exact.checkpoint``, kind ``ladder``; ``lockstep train`` writes kind
``train``): the policy session's state files (``session.PolicySession.state_files``) and the
job's record: ``position``, the training settings (``settings``: the trace's sha256, lr, rank,
alpha, seed, micro-batch, the advantages) and the job's identity (``identity``: contract
fingerprint, model hash, adapter-in hash, steps, ...). A resume compares both with the job
that resumes (``check_resume``) and refuses, naming the field, a checkpoint made for anything
else; the container refuses a partial, corrupted or foreign directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep_exact import checkpoint as container
from lockstep_exact.checkpoint import CheckpointError

KIND = "ladder"


def save_checkpoint(path: str | Path, trainer_files: Mapping[str, bytes], job: dict) -> Path:
    """Write ``trainer_files`` (a session's ``state_files()``) and ``job`` (``position``,
    ``settings``, ``identity``) to ``path``, atomically; never over an existing one."""
    if not isinstance(job.get("settings"), Mapping) or not job["settings"]:
        raise CheckpointError("a checkpoint needs the training settings it was made with")
    return container.save_checkpoint(path, trainer_files, KIND, job)


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
    return container.load_checkpoint(path, KIND)
