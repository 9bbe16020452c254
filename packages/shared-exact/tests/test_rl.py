"""The objectives of ``lockstep train`` and its reward plumbing, on plain tensors."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep_exact.app import rl
from lockstep_exact.app.rewards import Completion, RewardError, ToyTask, load_function, score


def test_group_advantages_normalize_within_each_group():
    adv = rl.group_advantages([0.0, 1.0, 0.5, 0.5], 2)
    assert adv == [-1.0, 1.0, 0.0, 0.0]  # the second group's rewards are equal: no signal


def test_group_advantages_refuse_a_ragged_group():
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        rl.group_advantages([1.0, 0.0], 3)


def test_at_ratio_one_the_clipped_loss_is_the_policy_gradient():
    """On-policy (the trainer's bytes are the sampler's), the surrogate's gradient is the
    plain policy gradient -A * d lp: nothing is clipped, nothing reweighted."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = lp.detach().clone()
    loss = rl.policy_loss([lp], [old], [torch.tensor(2.0)], clip=0.2)
    loss.backward()
    assert torch.equal(lp.grad, torch.full((3,), -2.0 / 3))


def test_the_clip_stops_the_gradient_past_one_plus_eps():
    old = torch.zeros(2)
    lp = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    rl.policy_loss([lp], [old], [torch.tensor(1.0)], clip=0.2).backward()
    assert lp.grad[0] == 0.0 and lp.grad[1] != 0.0  # ratio 1.5 is clipped, 1.1 is not


def test_k3_is_zero_where_policy_and_reference_agree_and_positive_elsewhere():
    lp = torch.tensor([-1.0, -1.0])
    assert torch.equal(rl.k3_kl(lp, lp), torch.zeros(2))
    assert bool((rl.k3_kl(lp, torch.tensor([-0.5, -2.0])) > 0).all())


def test_sft_loss_is_the_mean_negative_logprob():
    assert float(rl.sft_loss([torch.tensor([-1.0, -3.0]), torch.tensor([-2.0])])) == 2.0


def _completion(ids=(1, 2, 3)):
    return Completion(0, 0, "p", (5,), tuple(ids), "text")


def test_toy_task_rewards_the_target_block():
    task = ToyTask(vocab=1024)
    assert task.reward(torch.tensor([0, 255, 256, 1023])) == 0.5
    assert task(_completion((0, 300))) == 0.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "expected MODULE:FUNCTION"),
        ("lockstep_no_such_module_x:f", "cannot import module 'lockstep_no_such_module_x'"),
        ("json:no_such_function", "module 'json' (.*) has no 'no_such_function'"),
        ("json:__name__", "is a str, not a function"),
    ],
)
def test_a_reward_that_cannot_be_found_is_named(spec, message):
    with pytest.raises(RewardError, match=message):
        load_function(spec)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda c: 1 / 0, "raised ZeroDivisionError"),
        (lambda c: "high", "returned 'high', not a number"),
        (lambda c: float("nan"), "returned nan, not a finite number"),
        (lambda c: None, "returned None, not a number"),
    ],
)
def test_a_reward_that_fails_names_the_completion(fn, message):
    with pytest.raises(RewardError, match=f"completion 0 \\(prompt 'p'\\) {message}"):
        score(fn, _completion(), "mine:fn")


def test_a_reward_may_return_an_int_or_a_one_element_tensor():
    assert score(lambda c: 1, _completion(), "f") == 1.0
    assert score(lambda c: torch.tensor(0.25), _completion(), "f") == 0.25


def test_whitening_keeps_the_order_and_centres_the_tokens():
    out = rl.whiten([torch.tensor([1.0, 3.0]), torch.tensor([5.0])])
    flat = torch.cat(out)
    assert flat[0] < flat[1] < flat[2] and abs(float(flat.mean())) < 1e-6
    assert all(torch.equal(o, torch.zeros(2)) for o in rl.whiten([torch.ones(2)]))
