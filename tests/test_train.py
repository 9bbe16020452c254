"""`lockstep train` (GRPO, toy task): every step's decisions replay byte-equal in the trainer,
a one-ulp difference stops the run before any update, and the policy learns the task."""

from __future__ import annotations

import json

import pytest

from lockstep_exact import hookimpl
from lockstep_exact.cli import main
from lockstep_exact.parity import nudge_ulp
from lockstep_exact.plugins import manager
from lockstep_exact.requests import ReplayResult
from lockstep_exact.tiny import make_tiny
from lockstep_exact.train_loop import (
    GRPOConfig,
    ToyTask,
    TrainStopped,
    group_advantages,
    run_grpo,
)


def test_group_advantages_normalize_within_each_group():
    adv = group_advantages([0.0, 1.0, 0.5, 0.5], 2)
    assert adv == [-1.0, 1.0, 0.0, 0.0]  # the second group's rewards are equal: no signal


def test_toy_task_rewards_the_target_block():
    import torch

    task = ToyTask(vocab=1024)
    assert task.reward(torch.tensor([0, 255, 256, 1023])) == 0.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algo", "sft"], "--algo sft: only grpo is built so far"),
        (["--task", "gsm8k"], "--task gsm8k: only the built-in toy task exists so far"),
        (["--group", "1"], "--group must be an int >= 2"),
        (["--steps", "0"], "--steps must be an int >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
    ],
)
def test_train_refuses_bad_settings_before_any_engine(tmp_path, capsys, argv, message):
    rc = main(["train", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o"), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


class _OneUlpOff:
    """A trainer-side wrapper that moves one replayed log-probability by one ulp."""

    @hookimpl(wrapper=True)
    def lockstep_replay(self, request):
        result = yield
        return ReplayResult(
            logprobs=nudge_ulp(result.logprobs, 3), engine=result.engine, seconds=result.seconds
        )


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3", seed=0)


@pytest.mark.engine
def test_one_ulp_in_a_replay_stops_the_run_before_any_update(tiny_dense, tmp_path):
    pm = manager()
    pm.register(_OneUlpOff())
    with pytest.raises(TrainStopped, match="decision 3 is not byte-equal") as err:
        run_grpo(pm, tiny_dense, tmp_path, GRPOConfig(steps=2, group=2, prompts=2, decisions=4))
    assert "no update was made, the last adapter is none" in str(err.value)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["equal"] == rows[0]["decisions"] - 1 == 15
    assert not (tmp_path / "adapters").exists()


def _means(rows, k):
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    return first, last


@pytest.mark.engine
def test_grpo_on_the_toy_task_is_exact_at_every_step_and_learns(tiny_dense, tmp_path, capsys):
    steps = 10
    rc = main(["train", "--model", str(tiny_dense), "--steps", str(steps), "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["decisions"] == r["equal"] == 4 * 4 * 8 and r["k3_max"] == 0.0
    first, last = _means(rows, 3)
    assert first < 0.5 and last > first + 0.4, (first, last)  # starts near 1/4 (random)
    out = capsys.readouterr().out
    assert f"step {steps}/{steps}" in out and "engine log:" in out


@pytest.mark.engine
def test_control_the_inverted_reward_drives_the_target_share_down(tiny_dense, tmp_path):
    """The same run rewarding the complement of the target block: the block's share falls,
    so the rise above comes from the advantages' sign, not from drift of any update."""
    task = ToyTask(vocab=1024)
    rows = run_grpo(
        manager(),
        tiny_dense,
        tmp_path,
        GRPOConfig(steps=10),
        progress=lambda _: None,
        reward=lambda sampled: 1.0 - task.reward(sampled),
    )
    assert all(r["decisions"] == r["equal"] for r in rows)
    first, last = _means(rows, 3)  # means of the inverted reward: 1 - the block's share
    assert 1.0 - last < 1.0 - first - 0.15 and 1.0 - last < 0.15, (first, last)
