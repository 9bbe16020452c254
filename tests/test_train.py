"""``lockstep train`` with the real engines: one long-lived vLLM engine and one Megatron model.

Every step's decisions replay byte-equal in the trainer before any update; an adapter factor
moved by 2^-9 in the trainer's memory stops the run (bisect runs, the last checkpoint stays
intact); GRPO learns the toy task (an inverted reward drives it the other way); on-policy
distillation learns from a teacher that is the base model fine-tuned; SFT, GRPO and OPD chain
on one adapter; a resumed run is byte-identical to an uninterrupted one; bad settings are
refused before any engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cross_support import merged_model
from train_support import AdapterMoved, FakePolicy, FakeSampler

from lockstep_exact import hookimpl
from lockstep_exact.app.cli import main
from lockstep_exact.app.rewards import ToyTask
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.app.train_loop import (
    TrainConfig,
    TrainSetupError,
    TrainStopped,
    load_checkpoint,
    prepare_train,
    run_train,
)
from lockstep_exact.hashing import sha256_file
from lockstep_exact.plugins import manager
from lockstep_exact.trace import Trace


class Quiet:
    """A progress sink that keeps the lines (the default prints them)."""

    def __init__(self):
        self.lines = []

    def say(self, message):
        self.lines.append(message)

    def start(self, total, done):
        self.lines.append(f"start {done}/{total}")

    def step(self, row, total):
        self.lines.append(f"step {row['step']}/{total}")

    def close(self):
        pass


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _means(rows, k, key="reward_mean"):
    first = sum(r[key] for r in rows[:k]) / k
    last = sum(r[key] for r in rows[-k:]) / k
    return first, last


def _exact_every_step(rows):
    for r in rows:
        assert r["decisions"] == r["equal"] > 0 and r["k3_max"] == 0.0, r


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def grpo_run(tiny_dense, tmp_path_factory):
    """Ten GRPO steps on the toy task (the learning test reads them; OPD's teacher is made
    from one of their adapters)."""
    out = tmp_path_factory.mktemp("grpo") / "run"
    progress = Quiet()
    rows = run_train(manager(), tiny_dense, out, TrainConfig(steps=10), progress=progress)
    return out, rows, progress


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algo", "ppo"], "--algo 'ppo': choose one of ('grpo', 'opd', 'sft')"),
        (["--group", "1"], "--group must be an int >= 2 for grpo"),
        (["--steps", "0"], "--steps must be an int >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--clip", "1.5"], "--clip must be in (0, 1)"),
        (["--algo", "opd"], "--algo opd needs --teacher DIR"),
        (["--algo", "sft"], "--algo sft needs --data FILE"),
        (["--teacher", "x"], "--teacher is for --algo opd, not grpo"),
        (["--task", "gsm8k"], "--task 'gsm8k': the built-in task is 'toy'"),
        (["--prompts", "9"], "--prompts must be in [1, 8] with the built-in prompts"),
        (["--sampler-memory", "1.5"], "--sampler-memory is the fraction of the GPU's memory"),
        pytest.param(
            ["--backend", "cuda"],
            "--backend cuda: no CUDA device here (torch sees none); use --backend cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
    ],
)
def test_train_refuses_bad_settings_before_any_engine(tmp_path, capsys, argv, message):
    rc = main(["train", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _refused(tmp_path, model, capsys, *argv):
    rc = main(["train", "--model", str(model), "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reward", "nocolon"], "expected MODULE:FUNCTION"),
        (["--reward", "lockstep_missing_mod:f"], "cannot import module 'lockstep_missing_mod'"),
        (["--reward", "json:nothing"], "module 'json'"),
        (["--reward", "hook"], "no installed plugin implements lockstep_reward"),
        (["--data", "/no/such.jsonl"], "--data /no/such.jsonl: no such file"),
    ],
)
def test_train_refuses_a_reward_or_data_it_cannot_use(tiny_dense, tmp_path, capsys, argv, message):
    assert message in _refused(tmp_path, tiny_dense, capsys, *argv)
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_train_names_the_bad_line_of_a_data_file(tiny_dense, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    err = _refused(tmp_path, tiny_dense, capsys, "--algo", "sft", "--data", str(data))
    assert "line 2: 'completion' must be a non-empty string" in err


def test_train_names_the_line_of_a_data_file_that_is_not_utf8(tiny_dense, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "a"}\r\n\n{"prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    err = _refused(tmp_path, tiny_dense, capsys, "--data", str(data))
    assert (
        f"train: --data {data}, line 3: not UTF-8 text (byte 0xe9 at offset 33: invalid "
        "continuation byte); save the file as UTF-8" in err
    )


def test_a_teacher_with_another_tokenizer_is_refused(tiny_dense, tmp_path, capsys):
    other = make_tiny(tmp_path / "t", arch="qwen3", vocab=1280)
    err = _refused(tmp_path, tiny_dense, capsys, "--algo", "opd", "--teacher", str(other))
    assert f"--teacher {other} has another tokenizer" in err
    assert "vocabulary 1280 vs 1024 ids" in err


def test_resume_needs_a_run_and_a_run_is_never_overwritten(tiny_dense, tmp_path, capsys):
    err = _refused(tmp_path, tiny_dense, capsys, "--resume")
    assert "holds no run (no run.json)" in err
    (tmp_path / "o").mkdir(exist_ok=True)  # the refused run's engine log may be there
    (tmp_path / "o" / "run.json").write_text("{}")
    err = _refused(tmp_path, tiny_dense, capsys)
    assert "already holds a run (run.json); continue it with --resume" in err
    assert (tmp_path / "o" / "run.json").read_text() == "{}"


def _made_run(model, out, **config):
    """A run record in ``out`` as a new run writes it, without starting an engine."""
    with prepare_train(manager(), model, out, TrainConfig(**config)).claim():
        pass
    assert (out / "run.json").is_file()


def test_a_refused_train_keeps_the_engine_log_and_leaves_no_folder(tiny_dense, tmp_path, capsys):
    out = tmp_path / "o"
    assert "holds no run (no run.json)" in _refused(tmp_path, tiny_dense, capsys, "--resume")
    assert not out.exists()  # the refused resume made no folder (nor an engine log in one)
    _made_run(tiny_dense, out)
    log = out / "engine.log"
    log.write_text("the run's engine output\n")
    assert "already holds a run (run.json)" in _refused(tmp_path, tiny_dense, capsys)
    assert log.read_text() == "the run's engine output\n"
    err = _refused(tmp_path, tiny_dense, capsys, "--resume", "--lr", "0.5")
    assert "was run with lr = 0.02, this run has 0.5" in err
    assert log.read_text() == "the run's engine output\n"
    assert "lockstep train: engine log:" not in err  # no log was written: none is named


def test_train_refuses_a_non_empty_folder_it_did_not_make(tiny_dense, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "engine.log").write_text("someone else's log\n")
    (out / "notes.txt").write_text("mine\n")
    err = _refused(tmp_path, tiny_dense, capsys)
    assert (
        f"--out {out} is not empty (engine.log, notes.txt) and holds no Lockstep run "
        "(no run.json): choose an empty or new --out" in err
    )
    assert sorted(p.name for p in out.iterdir()) == ["engine.log", "notes.txt"]
    assert (out / "engine.log").read_text() == "someone else's log\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    _made_run(tiny_dense, empty)  # an empty folder is taken


def test_a_run_or_resume_on_an_out_another_run_holds_is_refused(tiny_dense, tmp_path, capsys):
    from lockstep_exact.app.train_loop import _locked

    out = tmp_path / "o"
    _made_run(tiny_dense, out)
    (out / "engine.log").write_text("the running resume's log\n")
    with prepare_train(manager(), tiny_dense, out, TrainConfig(), resume=True).claim():
        err = _refused(tmp_path, tiny_dense, capsys, "--resume")  # while that resume runs
    assert (
        f"train: another lockstep train is running in {out} (it holds the folder's lock); "
        "wait for it to finish, or choose another --out" in err
    )
    assert (out / "engine.log").read_text() == "the running resume's log\n"
    with prepare_train(manager(), tiny_dense, out, TrainConfig(), resume=True).claim():
        pass  # released: the next resume takes it
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with _locked(fresh):  # a new run that has made fresh and not yet written run.json
        rc = main(["train", "--model", str(tiny_dense), "--out", str(fresh)])
    assert rc == 2 and "another lockstep train is running in" in capsys.readouterr().err
    assert not any(fresh.iterdir())


def test_resume_compares_the_data_file_by_content_not_by_how_its_path_is_written(
    tiny_dense, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text('{"prompt": "ab"}\n{"prompt": "cd"}\n')
    Path("other.jsonl").write_text('{"prompt": "ef"}\n')
    _made_run(tiny_dense, tmp_path / "o", data="prompts.jsonl")
    for same in ("./prompts.jsonl", str(tmp_path / "prompts.jsonl")):
        config = TrainConfig(data=same)
        prepare_train(manager(), tiny_dense, tmp_path / "o", config, resume=True)  # admitted
    err = _refused(tmp_path, tiny_dense, capsys, "--resume", "--data", "other.jsonl")
    recorded, other = sha256_file("prompts.jsonl"), sha256_file("other.jsonl")
    assert (
        f"was run with --data prompts.jsonl (data_sha256 {recorded}), this run's --data "
        f"other.jsonl holds other content (data_sha256 {other}); refusing to resume" in err
    )
    err = _refused(tmp_path, tiny_dense, capsys, "--resume")
    assert "was run with data = 'prompts.jsonl', this run has None" in err


def test_every_metrics_line_has_the_documented_fields_kl_and_reverse_kl_null_if_not_run(
    tiny_dense, tmp_path
):
    """A GRPO step without --reference has no KL and no reverse KL: the line says so (null)
    rather than leaving out fields docs/train.md lists."""
    from lockstep_exact.app.train_loop import _Run
    from lockstep_exact.model import ModelDir

    config = TrainConfig(steps=1, group=2, prompts=1, decisions=2)
    run = _Run(None, ModelDir(tiny_dense), tmp_path, config, Quiet(), lambda c: 0.25)
    run.sampler, run.policy = FakeSampler(), FakePolicy()
    row = run.step(1, tmp_path / "adapters" / "step-0000")
    documented = "step reward_mean rewards k3_max decisions equal loss kl reverse_kl seconds"
    documented += " adapter_in adapter_id engine_starts trace phases"
    assert set(documented.split()) <= set(row)
    assert set(row["phases"]) == {"sample", "recompute", "update"}  # export: added by the loop
    assert all(v >= 0 for v in row["phases"].values())
    assert row["kl"] is None and row["reverse_kl"] is None
    assert json.loads(json.dumps(row))["kl"] is None  # written as null


def test_the_default_rank_is_a_multiple_of_top_k_and_another_rank_is_refused(tmp_path, capsys):
    moe = make_tiny(tmp_path / "moe", arch="qwen3-moe", topk=3)
    config = TrainConfig()
    prepare_train(manager(), moe, tmp_path / "o", config)
    assert config.rank == 9  # 8 raised to a multiple of top-k 3, as the qualify ladder does
    _made_run(moe, tmp_path / "six", rank=6)  # a multiple of top-k is taken as given
    err = _refused(tmp_path, moe, capsys, "--rank", "8")
    assert (
        f"train: --rank 8 is not a multiple of {moe}'s top-k 3 (each routed expert's LoRA "
        "gets rank // top-k): use --rank 9" in err
    )
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- GRPO


@pytest.mark.engine
def test_grpo_on_the_toy_task_is_exact_at_every_step_and_learns(grpo_run):
    out, rows, progress = grpo_run
    assert [r["step"] for r in rows] == list(range(1, 11))
    _exact_every_step(rows)
    assert all(r["decisions"] == 4 * 8 * 8 for r in rows)  # prompts x group x decisions
    first, last = _means(rows, 3)
    assert first < 0.5 and last > first + 0.4, (first, last)  # starts near 1/4 (random)
    # One engine for the run; each step's adapter hot-loaded under a new id.
    assert {r["engine_starts"] for r in rows} == {1}
    assert [r["adapter_id"] for r in rows] == list(range(1, 11))
    assert [r["adapter_in"] for r in rows] == [f"adapters/step-{k:04d}" for k in range(10)]
    for r in rows:  # every trace records the adapter the trainer exported before its step
        trace = Trace.load(out / r["trace"])
        meta = json.loads((out / r["adapter_in"] / "adapter_config.json").read_text())
        assert trace.adapter_hash and meta  # admitted by the trainer: same hash
    assert _rows(out) == rows
    report = (out / "report.html").read_text()
    assert "exact at every step" in report
    plots = ["reward_mean", "k3_max", "loss", "seconds"]  # one axis each; no KL without one
    assert report.count("<svg") == 4 and all(f"id='plot-{k}'" in report for k in plots)
    assert progress.lines[-1] == "step 10/10"
    load_checkpoint(out / "checkpoints" / "step-0010")  # intact


@pytest.mark.slow
@pytest.mark.engine
def test_control_the_inverted_reward_drives_the_target_share_down(tiny_dense, tmp_path):
    """Rewarding the complement of the target block: the block's share falls, so the rise
    above comes from the advantages' sign, not from drift of any update."""
    task = ToyTask(vocab=1024)
    rows = run_train(
        manager(),
        tiny_dense,
        tmp_path,
        TrainConfig(steps=12),
        progress=Quiet(),
        reward=lambda c: 1.0 - task(c),
    )
    _exact_every_step(rows)
    first, last = _means(rows, 3)  # means of the inverted reward: 1 - the block's share
    assert 1.0 - last < 1.0 - first - 0.1 and 1.0 - last < 0.15, (first, last)


@pytest.mark.engine
def test_a_moved_adapter_factor_stops_the_run_before_any_update_and_bisects(tiny_dense, tmp_path):
    pm = manager()
    pm.register(AdapterMoved(at=2))
    config = TrainConfig(steps=3, group=2, prompts=2, decisions=4)
    with pytest.raises(TrainStopped) as err:
        run_train(pm, tiny_dense, tmp_path, config, progress=Quiet())
    message = str(err.value)
    first = json.loads((tmp_path / "bisect.json").read_text())["decision"]
    assert f"step 2: the trainer's log-probability of decision {first} is not byte-equal" in message
    assert "no update was made; last checkpoint checkpoints/step-0001" in message
    # bisect reads the adapter files, which the in-memory move did not touch
    assert "bisect: every op site is byte-equal on both halves" in message
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["stopped"]
    assert rows[0]["equal"] == rows[0]["decisions"] == 16
    assert rows[1]["equal"] < rows[1]["decisions"] == 16, rows[1]
    assert not (tmp_path / "adapters" / "step-0002").exists()  # no update
    load_checkpoint(tmp_path / "checkpoints" / "step-0001")  # intact
    assert "STOPPED" in (tmp_path / "report.html").read_text()


def _files(out, step):
    """What a step leaves, by content. (An adapter file's bytes are not compared whole:
    safetensors writes its metadata in a per-process hash order.)"""
    from safetensors.torch import load_file

    from lockstep_exact.hashing import tensor_sha256

    adapter = out / "adapters" / f"step-{step:04d}"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    return {
        "adapter": {k: tensor_sha256(v) for k, v in tensors.items()},
        "adapter_config": (adapter / "adapter_config.json").read_bytes(),
        "masters": sha256_file(out / "checkpoints" / f"step-{step:04d}" / "adapters.safetensors"),
        "optimizer": sha256_file(
            out / "checkpoints" / f"step-{step:04d}" / "optimizer.safetensors"
        ),
        "logprobs": Trace.load(out / "traces" / f"step-{step:04d}").sha256(),
    }


@pytest.mark.engine
def test_a_resumed_run_is_byte_identical_to_an_uninterrupted_one(tiny_dense, tmp_path):
    config = dict(group=2, prompts=2, decisions=4)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_train(manager(), tiny_dense, whole, TrainConfig(steps=4, **config), progress=Quiet())
    run_train(manager(), tiny_dense, parts, TrainConfig(steps=2, **config), progress=Quiet())
    progress = Quiet()
    rows = run_train(
        manager(),
        tiny_dense,
        parts,
        TrainConfig(steps=4, **config),
        progress=progress,
        resume=True,
    )
    assert "start 2/4" in progress.lines
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for step in (3, 4):
        assert _files(whole, step) == _files(parts, step), step
    drop = ("seconds", "phases", "engine_starts", "adapter_id")
    strip = [{k: v for k, v in r.items() if k not in drop} for r in _rows(whole)]
    assert strip == [{k: v for k, v in r.items() if k not in drop} for r in rows]
    with pytest.raises(TrainSetupError, match="was run with lr = 0.02, this run has 0.01"):
        run_train(
            manager(), tiny_dense, parts, TrainConfig(steps=5, lr=1e-2, **config), resume=True
        )
    other = make_tiny(tmp_path / "other", arch="qwen3", seed=1)
    with pytest.raises(TrainSetupError, match="was run with model_hash = "):
        run_train(manager(), other, parts, TrainConfig(steps=5, **config), resume=True)
    with pytest.raises(TrainSetupError, match="was run with reward = None, this run has 'x:y'"):
        run_train(
            manager(),
            tiny_dense,
            parts,
            TrainConfig(steps=5, reward="x:y", **config),
            reward=lambda c: 0.0,
            resume=True,
        )
    damaged = parts / "checkpoints" / "step-0004" / "record.json"
    damaged.write_bytes(damaged.read_bytes().replace(b"4", b"5"))
    with pytest.raises(TrainSetupError, match="record.json is corrupted: sha256 differs"):
        run_train(manager(), tiny_dense, parts, TrainConfig(steps=5, **config), resume=True)
    assert [r["step"] for r in _rows(parts)] == [1, 2, 3, 4]  # nothing lost


@pytest.mark.engine
def test_a_reward_that_raises_stops_the_run_naming_it(tiny_dense, tmp_path, capsys, monkeypatch):
    """A user's reward reads its data row (``example``); the step whose reward raises
    stops before any update, and the step before is kept."""
    (tmp_path / "lockstep_test_rewards_a.py").write_text(
        "calls = []\n"
        "def flaky(c):\n"
        "    calls.append(c.index)\n"
        "    assert c.example['answer'] == c.prompt.upper() and isinstance(c.text, str)\n"
        "    if len(calls) > 4:\n"
        "        raise KeyError('answer')\n"
        "    return 0.5\n"
    )
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": p.upper()}) + "\n" for p in ("ab", "cd", "ef"))
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    out = tmp_path / "o"
    argv = ["train", "--model", str(tiny_dense), "--out", str(out), "--steps", "3"]
    rc = main(
        [
            *argv,
            "--group",
            "2",
            "--prompts",
            "2",
            "--decisions",
            "4",
            "--reward",
            "lockstep_test_rewards_a:flaky",
            "--data",
            str(data),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    assert (
        "step 2: the reward lockstep_test_rewards_a:flaky on completion 0 (prompt " in captured.err
    )
    assert "raised KeyError: 'answer'; no update was made" in captured.err
    assert "step 1/3" in captured.out and "report:" in captured.out
    assert [r["step"] for r in _rows(out)] == [1]
    load_checkpoint(out / "checkpoints" / "step-0001")


# ----------------------------------------------------------------------------- OPD, SFT


class _ToyHook:
    @hookimpl
    def lockstep_reward(self, completion):
        return ToyTask(vocab=1024)(completion)


@pytest.mark.slow
@pytest.mark.engine
def test_on_policy_distillation_learns_from_a_finetuned_teacher(tiny_dense, grpo_run, tmp_path):
    """The teacher is the base model with a GRPO adapter merged in: distilling it lowers the
    reverse KL and raises the toy reward the student never saw (read through the reward
    hook)."""
    teacher = merged_model(tiny_dense, grpo_run[0] / "adapters" / "step-0010", tmp_path / "t")
    pm = manager()
    pm.register(_ToyHook())
    config = TrainConfig(algo="opd", teacher=str(teacher), steps=8, reward="hook")
    rows = run_train(pm, tiny_dense, tmp_path / "o", config, progress=Quiet())
    _exact_every_step(rows)
    first, last = _means(rows, 3, "reverse_kl")
    assert last < 0.5 * first, (first, last)
    first, last = _means(rows, 3)
    assert last > first + 0.3, (first, last)


@pytest.mark.engine
def test_a_teacher_changed_on_disk_stops_the_run(tiny_dense, tmp_path):
    teacher = tmp_path / "t"
    teacher.mkdir()
    for f in tiny_dense.iterdir():
        (teacher / f.name).write_bytes(f.read_bytes())
    calls = []

    def reward(c):  # at step 2, someone rewrites the teacher's config on disk
        calls.append(c)
        if len(calls) == 5:
            cfg = teacher / "config.json"
            cfg.write_text(cfg.read_text() + " ")
        return 0.0

    config = TrainConfig(algo="opd", teacher=str(teacher), steps=3, group=2, prompts=2)
    with pytest.raises(TrainStopped, match=f"step 2: the teacher's model directory {teacher} "):
        run_train(manager(), tiny_dense, tmp_path / "o", config, progress=Quiet(), reward=reward)
    assert not (tmp_path / "o" / "adapters" / "step-0002").exists()


SFT_ROWS = [
    ("What is two plus two?", " Four, of course."),
    ("Name a color.", " Blue, like the sky."),
    ("Say hello.", " Hello there, friend."),
    ("Count to three.", " One, two, three."),
    ("What do cats say?", " Meow, mostly at night."),
]


@pytest.mark.slow
@pytest.mark.engine
def test_sft_then_grpo_then_opd_on_one_adapter(tiny_dense, grpo_run, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in SFT_ROWS))
    sft = tmp_path / "sft"
    small = ["--group", "2", "--prompts", "4", "--decisions", "4"]
    rc = main(
        [
            "train",
            "--model",
            str(tiny_dense),
            "--algo",
            "sft",
            "--data",
            str(data),
            "--steps",
            "6",
            "--out",
            str(sft),
            *small,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step 6/6" in out and f"adapter: {sft / 'adapters' / 'step-0006'}" in out
    rows = _rows(sft)
    _exact_every_step(rows)
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], [r["loss"] for r in rows]
    grpo = tmp_path / "grpo"
    rc = main(
        [
            "train",
            "--model",
            str(tiny_dense),
            "--adapter",
            str(sft / "adapters" / "step-0006"),
            "--steps",
            "2",
            "--out",
            str(grpo),
            "--reference",
            *small,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = _rows(grpo)
    _exact_every_step(rows)
    assert rows[0]["kl"] > 0  # the SFT adapter moved the policy off the base model
    teacher = merged_model(tiny_dense, grpo_run[0] / "adapters" / "step-0006", tmp_path / "t")
    opd = tmp_path / "opd"
    rc = main(
        [
            "train",
            "--model",
            str(tiny_dense),
            "--adapter",
            str(grpo / "adapters" / "step-0002"),
            "--algo",
            "opd",
            "--teacher",
            str(teacher),
            "--steps",
            "2",
            "--out",
            str(opd),
            *small,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    _exact_every_step(_rows(opd))
    first = Trace.load(opd / "traces" / "step-0001")
    from lockstep_exact.adapters import load_adapter
    from lockstep_exact.model import ModelDir

    assert (
        first.adapter_hash
        == load_adapter(grpo / "adapters" / "step-0002", ModelDir(tiny_dense)).sha256
    )


@pytest.mark.engine
def test_grpo_on_moe_with_a_reference_is_exact_at_every_step(tmp_path):
    moe = make_tiny(tmp_path / "moe", arch="qwen3-moe", seed=0)
    config = TrainConfig(steps=3, group=2, prompts=2, decisions=6, reference=True)
    rows = run_train(manager(), moe, tmp_path / "o", config, progress=Quiet())
    _exact_every_step(rows)
    assert rows[0]["kl"] == 0.0  # a fresh adapter (B = 0) is the base model, byte for byte
    assert rows[-1]["kl"] > 0.0
    assert torch.tensor([r["kl"] for r in rows]).isfinite().all()


class _Tty:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place():
    from lockstep_exact.app.cli import _Bar
    from lockstep_exact.app.quiet import Console

    stream = _Tty()
    bar = _Bar(Console(stream, None), 0.0)
    row = {
        "step": 1,
        "reward_mean": 0.25,
        "k3_max": 0.0,
        "equal": 8,
        "decisions": 8,
        "seconds": 1.5,
    }
    bar.step(row, 4)
    bar.step({**row, "step": 2}, 4)
    bar.close()
    assert stream.text.count("\r\033[K[") == 2 and stream.text.endswith("\n")
    assert "[############............] step 2/4  reward 0.250  K3 max 0  equal 8/8" in stream.text


def test_sft_progress_shows_the_loss_it_optimizes_not_the_probe_reward():
    from lockstep_exact.app.cli import _Bar, _trained_line
    from lockstep_exact.app.quiet import Console
    from lockstep_exact.app.train_loop import step_line
    from lockstep_exact.app.train_report import render

    row = {"step": 1, "algo": "sft", "reward_mean": 0.25, "k3_max": 0.0, "equal": 8}
    row.update(decisions=8, loss=1.5, seconds=1.5)
    rows = [row, {**row, "step": 2, "loss": 0.5, "reward_mean": 0.75}]
    assert step_line(rows[1], 2) == "step 2/2  loss +0.5000  equal 8/8  k3_max 0  1.5s"
    assert _trained_line(rows, "sft") == (
        "trained 2 steps (sft): loss 1.5000 -> 0.5000; every decision byte-equal: True"
    )
    stream = _Tty()
    bar = _Bar(Console(stream, None), 0.0)
    bar.step(rows[1], 2)
    assert "step 2/2  loss +0.5000  K3 max 0" in stream.text and "reward" not in stream.text
    grpo = [{**r, "algo": "grpo"} for r in rows]
    assert "step 2/2  reward 0.750  equal 8/8" in step_line(grpo[1], 2)
    assert "(grpo): reward 0.250 -> 0.750;" in _trained_line(grpo, "grpo")
    report = render(rows, {"setting.algo": "sft"})
    assert "reward of the sampled probe over steps (sft does not optimize it)" in report


def test_resume_of_a_complete_run_says_so_and_starts_nothing(tiny_dense, tmp_path, capsys):
    from lockstep_exact.app.train_loop import save_checkpoint

    out = tmp_path / "o"
    _made_run(tiny_dense, out)
    row = {"step": 1, "algo": "grpo", "reward_mean": 0.25, "k3_max": 0.0, "equal": 8}
    row.update(decisions=8, loss=0.5, seconds=1.0, adapter_out="adapters/step-0001")
    rows = [row, {**row, "step": 2, "adapter_out": "adapters/step-0002"}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_checkpoint(out, 2, {}, {"step": 2, "adapter": "adapters/step-0002"})
    (out / "engine.log").write_text("the run's engine output\n")
    argv = ["train", "--model", str(tiny_dense), "--out", str(out), "--resume"]
    assert main([*argv, "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"{out}: run already complete at step 2; nothing to do (--steps 2; give a larger "
        "--steps to train on)" in printed
    )
    assert "trained" not in printed and f"report: {out / 'report.html'}" in printed
    assert (out / "engine.log").read_text() == "the run's engine output\n"
    assert [r["step"] for r in _rows(out)] == [1, 2]


# ----------------------------------------------------------------------------- the hybrid lane


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny-next") / "qwen3-next", arch="qwen3-next")


def test_a_hybrid_model_is_admitted_for_training(tiny_next, tmp_path):
    """``lockstep train`` takes a Qwen3-Next model (the trainer session trains the hybrid lane
    on cpu): admitted before any engine, its default rank a multiple of its top-k."""
    plan = prepare_train(manager(), tiny_next, tmp_path / "o", TrainConfig())
    assert plan.model.family == "qwen3-next" and plan.config.rank % plan.model.geometry.topk == 0


@pytest.mark.slow
@pytest.mark.engine
def test_grpo_on_the_hybrid_lane_is_exact_at_every_step_and_resumes_byte_identically(
    tiny_next, tmp_path
):
    """Qwen3-Next: vLLM samples, Megatron scores and trains (LoRA on the GatedDeltaNet too);
    every decision of every step is byte-equal, and a run stopped after step 1 and resumed
    gives step 2's adapter, AdamW state and log-probabilities byte for byte."""
    config = dict(group=2, prompts=2, decisions=4)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    rows = run_train(manager(), tiny_next, whole, TrainConfig(steps=2, **config), progress=Quiet())
    assert [r["step"] for r in rows] == [1, 2]
    _exact_every_step(rows)
    assert rows[0]["decisions"] == 16
    adapter = _files(whole, 2)["adapter"]
    assert any("linear_attn.in_proj_qkvz" in k for k in adapter)
    assert _files(whole, 1)["adapter"] != adapter  # the adapter moved
    run_train(manager(), tiny_next, parts, TrainConfig(steps=1, **config), progress=Quiet())
    resumed = run_train(
        manager(), tiny_next, parts, TrainConfig(steps=2, **config), progress=Quiet(), resume=True
    )
    _exact_every_step(resumed)
    assert _files(whole, 2) == _files(parts, 2)
