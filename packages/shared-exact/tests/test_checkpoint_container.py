"""The one training checkpoint container: every training job (the qualify ladder's gate and
`lockstep train`) writes its trainer state and its record the same way, and a checkpoint is
resumed only by the kind of job that wrote it."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.checkpoint import (
    FORMAT,
    RECORD,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)

STATE = {"adapter.safetensors": b"\x00\x01", "optimizer.safetensors": b"\x02"}


def test_a_checkpoint_round_trips_its_state_and_record(tmp_path):
    path = save_checkpoint(tmp_path / "step-0001", STATE, "train", {"step": 1, "seed": 7})
    files, record = load_checkpoint(path, "train")
    assert files == STATE and record == {"step": 1, "seed": 7}
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and set(manifest["files"]) == {*STATE, RECORD}
    with pytest.raises(FileExistsError):
        save_checkpoint(path, STATE, "train", {"step": 1})


def test_a_checkpoint_is_resumed_only_by_the_kind_of_job_that_wrote_it(tmp_path):
    ladder = save_checkpoint(tmp_path / "l", STATE, "ladder", {"position": 3})
    train = save_checkpoint(tmp_path / "t", STATE, "train", {"step": 3})
    with pytest.raises(CheckpointError, match=r"qualify ladder's training gate, not by `lockstep"):
        load_checkpoint(ladder, "train")
    with pytest.raises(CheckpointError, match=r"written by `lockstep train`, not by the qualify"):
        load_checkpoint(train, "ladder")
    assert load_checkpoint(ladder, "ladder")[1] == {"position": 3}


def test_damage_and_misuse_are_refused_by_name(tmp_path):
    path = save_checkpoint(tmp_path / "c", STATE, "train", {"step": 2})
    (path / RECORD).write_bytes((path / RECORD).read_bytes().replace(b"2", b"3"))
    with pytest.raises(CheckpointError, match=r"record.json is corrupted: sha256 differs"):
        load_checkpoint(path, "train")
    with pytest.raises(CheckpointError, match=r"checkpoint kind 'eval'"):
        save_checkpoint(tmp_path / "d", STATE, "eval", {})
    with pytest.raises(CheckpointError, match=r"may not be named record.json"):
        save_checkpoint(tmp_path / "e", {RECORD: b"{}"}, "train", {})
    # the error type is the caller's (lockstep train raises its own set-up error)
    with pytest.raises(KeyError):
        load_checkpoint(tmp_path / "missing", "train", KeyError)
