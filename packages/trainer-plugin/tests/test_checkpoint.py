"""Checkpoints of the ladder's training job (the trainer session's state and the job's record):
atomic, verified, and a cold resume in a new process is byte-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep_exact.requests import TrainRequest
from lockstep_exact.trace import Trace
from lockstep_megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lockstep_megatron.run import open_job

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
SETTINGS = dict(rank=4, alpha=8.0, lr=1e-2, micro_batch=3, seed=11)


def _request(model_dir, trace_dir, **change):
    return TrainRequest(
        model_dir=model_dir, trace_dir=trace_dir, adapter_in=None, adapter_out=Path("unused"),
        **{**SETTINGS, **change},
    )  # fmt: skip


RESUME = """
import sys, torch
torch.set_num_threads(1)
from pathlib import Path
from lockstep_exact.requests import TrainRequest
from lockstep_megatron.run import open_job
model_dir, trace_dir, ckpt, out = map(Path, sys.argv[1:5])
settings = dict(rank=4, alpha=8.0, lr=1e-2, micro_batch=3, seed=11)
job = open_job(TrainRequest(model_dir, trace_dir, None, Path("unused"), **settings))
job.resume(ckpt)
job.run(2)
out.mkdir()
for name, data in job.session.state_files().items():
    (out / name).write_bytes(data)
"""


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_cold_resume_in_a_new_process_is_byte_identical(arch, request, tmp_path):
    from safetensors.torch import load

    model_dir = request.getfixturevalue(f"{arch}_dir")
    trace_dir = request.getfixturevalue(f"{arch}_trace")
    job = open_job(_request(model_dir, trace_dir))
    job.run(3)
    ckpt = job.save(tmp_path / "step-3")
    job.run(2)
    here = job.session.state_files()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-c",
            RESUME,
            str(model_dir),
            str(trace_dir),
            str(ckpt),
            str(tmp_path / "resumed"),
        ],
        check=True,
        env=env,
        cwd=HERE,
    )
    there = {p.name: p.read_bytes() for p in (tmp_path / "resumed").iterdir()}
    assert set(here) == set(there)
    failures = [k for k in here if here[k] != there[k]]
    n_params = len(load(here["adapters.safetensors"]))
    n_optim = len(load(here["optimizer.safetensors"]))
    print(
        f"\ncold resume ({arch}): {len(here)} state files ({n_params} parameter + {n_optim} "
        f"optimizer tensors) compared byte for byte, {len(failures)} failures"
    )
    assert n_params > 0 and n_optim == 3 * n_params and not failures


@pytest.fixture(scope="module")
def saved(dense_dir, dense_trace, tmp_path_factory):
    job = open_job(_request(dense_dir, dense_trace))
    job.run(1)
    return job.save(tmp_path_factory.mktemp("ck") / "step-1")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_checkpoint_round_trips(saved):
    files, job = load_checkpoint(saved)
    assert job["position"] == 1 and job["settings"]["rank"] == SETTINGS["rank"]
    assert {"adapters.safetensors", "optimizer.safetensors", "trainer.json"} <= set(files)


def test_partial_checkpoint_is_refused(saved, tmp_path):
    bad = _copy(saved, tmp_path / "partial")
    (bad / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="partial"):
        load_checkpoint(bad)


def test_corrupted_checkpoint_is_refused(saved, tmp_path):
    bad = _copy(saved, tmp_path / "corrupt")
    data = bytearray((bad / "optimizer.safetensors").read_bytes())
    data[-1] ^= 0x01
    (bad / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(bad)


def test_checkpoint_with_a_missing_file_is_refused(saved, tmp_path):
    bad = _copy(saved, tmp_path / "missing")
    (bad / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(bad)


def test_checkpoints_are_never_overwritten(saved):
    with pytest.raises(FileExistsError):
        save_checkpoint(saved, *load_checkpoint(saved))


def test_checkpoint_records_the_trace_and_the_training_settings(saved, dense_trace):
    settings = load_checkpoint(saved)[1]["settings"]
    assert settings["trace_sha256"] == Trace.load(dense_trace).sha256()
    assert {k: settings[k] for k in SETTINGS} == SETTINGS
    assert len(settings["advantages"]) == Trace.load(dense_trace).num_sequences


def test_resuming_with_the_same_settings_is_accepted(saved, dense_dir, dense_trace):
    job = open_job(_request(dense_dir, dense_trace))
    job.resume(saved)
    assert job.session.position == 1


@pytest.mark.parametrize(
    "field, change",
    [
        ("lr", {"lr": 2e-2}),
        ("rank", {"rank": 8}),
        ("alpha", {"alpha": 4.0}),
        ("seed", {"seed": 12}),
        ("micro_batch", {"micro_batch": 2}),
        ("advantages", {"advantages": (1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0)}),
    ],
)
def test_resuming_with_another_setting_is_refused_naming_it(
    saved, dense_dir, dense_trace, field, change
):
    job = open_job(_request(dense_dir, dense_trace, **change))
    recorded = load_checkpoint(saved)[1]["settings"][field]
    with pytest.raises(CheckpointError) as err:
        job.resume(saved)
    assert str(err.value).startswith(f"{saved} was made with {field} = {recorded!r}, this job has")
    assert str(err.value).endswith("; refusing to resume")


def test_resuming_on_another_trace_is_refused_naming_it(saved, dense_dir, tmp_path):
    from trainer_support import reference_trace

    job = open_job(_request(dense_dir, reference_trace(dense_dir, tmp_path / "other", seed=1)))
    with pytest.raises(CheckpointError, match=r"was made with trace_sha256 = '[0-9a-f]{64}'"):
        job.resume(saved)


def test_a_checkpoint_without_settings_is_refused(saved, tmp_path):
    files, job = load_checkpoint(saved)
    del job["settings"]
    with pytest.raises(CheckpointError, match="needs the training settings it was made with"):
        save_checkpoint(tmp_path / "step-9", files, job)


def test_a_checkpoint_of_the_older_format_is_refused(saved, tmp_path):
    import json

    old = _copy(saved, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format"] = "lockstep.megatron.checkpoint/3"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"checkpoint/3' checkpoint, not 'lockstep.checkpoint/1'"
    ):
        load_checkpoint(old)


def test_check_resume_names_a_field_missing_on_either_side():
    from lockstep_megatron.checkpoint import check_resume

    with pytest.raises(CheckpointError, match="ck does not record 'lr' \\(this job has 0.1\\)"):
        check_resume({}, {"lr": 0.1}, "ck")
    with pytest.raises(CheckpointError, match="ck records 'lr' = 0.1, which this job does not set"):
        check_resume({"lr": 0.1}, {}, "ck")
    check_resume({"steps": 2, "lr": 0.1}, {"steps": 5, "lr": 0.1}, "ck", free=("steps",))
