"""Checkpoints: atomic, verified, and a cold resume in a new process is byte-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.parity import same_bytes
from lockstep_exact.trace import Trace
from lockstep_megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lockstep_megatron.convert import build
from lockstep_megatron.train import TrainConfig, Trainer

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
CONFIG = TrainConfig(rank=4, alpha=8.0, lr=1e-2, micro_batch=3, seed=11)


def _flat_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    s = trainer.state()
    return {
        **{f"param/{k}": v for k, v in s["adapters"].items()},
        **{f"optim/{k}": v for k, v in s["optimizer"].items()},
    }


RESUME = """
import os, sys, torch
torch.set_num_threads(1)
from pathlib import Path
from safetensors.torch import save_file
from lockstep_exact.trace import Trace
from lockstep_megatron.checkpoint import load_checkpoint
from lockstep_megatron.convert import build
from lockstep_megatron.train import TrainConfig, Trainer
model_dir, trace_dir, ckpt, out = map(Path, sys.argv[1:5])
state = load_checkpoint(ckpt)
t = Trainer(build(model_dir), Trace.load(trace_dir), TrainConfig(**state["config"]))
t.load_state(state)
for _ in range(2):
    t.step()
s = t.state()
flat = {**{f"param/{k}": v for k, v in s["adapters"].items()},
        **{f"optim/{k}": v.contiguous() for k, v in s["optimizer"].items()}}
save_file(flat, str(out))
"""


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_cold_resume_in_a_new_process_is_byte_identical(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    trace_dir = request.getfixturevalue(f"{arch}_trace")
    trainer = Trainer(build(model_dir), Trace.load(trace_dir), CONFIG)
    for _ in range(3):
        trainer.step()
    ckpt = save_checkpoint(trainer.state(), tmp_path / "step-3")
    for _ in range(2):
        trainer.step()
    here = _flat_state(trainer)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-c",
            RESUME,
            str(model_dir),
            str(trace_dir),
            str(ckpt),
            str(tmp_path / "resumed.safetensors"),
        ],
        check=True,
        env=env,
        cwd=HERE,
    )
    there = load_file(str(tmp_path / "resumed.safetensors"))
    assert set(here) == set(there)
    failures = [k for k in here if not same_bytes(here[k], there[k])]
    n_params = sum(k.startswith("param/") for k in here)
    n_optim = sum(k.startswith("optim/") for k in here)
    print(
        f"\ncold resume ({arch}): {n_params} parameter + {n_optim} optimizer tensors compared, "
        f"{len(failures)} failures"
    )
    assert n_params > 0 and n_optim == 3 * n_params and not failures


@pytest.fixture(scope="module")
def saved(dense_dir, dense_trace, tmp_path_factory):
    trainer = Trainer(build(dense_dir), Trace.load(dense_trace), CONFIG)
    trainer.step()
    return save_checkpoint(trainer.state(), tmp_path_factory.mktemp("ck") / "step-1")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_checkpoint_round_trips(saved):
    state = load_checkpoint(saved)
    assert state["position"] == 1 and state["config"]["rank"] == CONFIG.rank


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
        save_checkpoint(load_checkpoint(saved), saved)


def test_checkpoint_records_the_trace_and_the_training_settings(saved, dense_trace):
    settings = load_checkpoint(saved)["settings"]
    assert settings["trace_sha256"] == Trace.load(dense_trace).sha256()
    assert {k: settings[k] for k in ("lr", "rank", "alpha", "seed", "micro_batch")} == {
        "lr": CONFIG.lr,
        "rank": CONFIG.rank,
        "alpha": CONFIG.alpha,
        "seed": CONFIG.seed,
        "micro_batch": CONFIG.micro_batch,
    }
    assert len(settings["advantages"]) == Trace.load(dense_trace).num_sequences


def test_resuming_with_the_same_settings_is_accepted(saved, dense_dir, dense_trace):
    trainer = Trainer(build(dense_dir), Trace.load(dense_trace), CONFIG)
    trainer.load_state(load_checkpoint(saved))
    assert trainer.position == 1


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
    from dataclasses import replace

    trainer = Trainer(build(dense_dir), Trace.load(dense_trace), replace(CONFIG, **change))
    recorded = load_checkpoint(saved)["settings"][field]
    with pytest.raises(CheckpointError) as err:
        trainer.load_state(load_checkpoint(saved), where=str(saved))
    assert str(err.value).startswith(f"{saved} was made with {field} = {recorded!r}, this job has")
    assert str(err.value).endswith("; refusing to resume")


def test_resuming_on_another_trace_is_refused_naming_it(saved, dense_dir, tmp_path):
    from trainer_support import reference_trace

    other = Trace.load(reference_trace(dense_dir, tmp_path / "other", seed=1))
    trainer = Trainer(build(dense_dir), other, CONFIG)
    with pytest.raises(CheckpointError, match=r"was made with trace_sha256 = '[0-9a-f]{64}'"):
        trainer.load_state(load_checkpoint(saved))


def test_a_checkpoint_without_settings_is_refused(saved, tmp_path):
    state = load_checkpoint(saved)
    del state["settings"]
    with pytest.raises(CheckpointError, match="needs the training settings it was made with"):
        save_checkpoint(state, tmp_path / "step-9")


def test_a_checkpoint_of_the_older_format_is_refused(saved, tmp_path):
    import json

    old = _copy(saved, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format"] = "lockstep.megatron.checkpoint/1"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"checkpoint/1' checkpoint, not 'lockstep.megatron.checkpoint/2'"
    ):
        load_checkpoint(old)


def test_check_resume_names_a_field_missing_on_either_side():
    from lockstep_megatron.checkpoint import check_resume

    with pytest.raises(CheckpointError, match="ck does not record 'lr' \\(this job has 0.1\\)"):
        check_resume({}, {"lr": 0.1}, "ck")
    with pytest.raises(CheckpointError, match="ck records 'lr' = 0.1, which this job does not set"):
        check_resume({"lr": 0.1}, {}, "ck")
    check_resume({"steps": 2, "lr": 0.1}, {"steps": 5, "lr": 0.1}, "ck", free=("steps",))
