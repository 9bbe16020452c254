"""Rewards for ``lockstep train``: the built-in toy task, a user's ``module:function``, or a
plugin's ``lockstep_reward`` hook.

A reward function takes one ``Completion`` and returns a finite float. It is resolved and
checked before any engine starts (a missing module or function is named then); a function
that raises, or returns something that is not a finite number, stops the run at that step,
naming the completion, before any update (``RewardError``).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class RewardError(ValueError):
    """A reward function that cannot be found, or failed on a completion."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion, as a reward function sees it."""

    index: int  # its sequence in the step's trace
    group: int  # the prompt it answers (sequences of a group share a prompt)
    prompt: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    example: dict[str, Any] = field(default_factory=dict)  # the data row (``--data``), if any


@dataclass(frozen=True)
class ToyTask:
    """The built-in verifiable task: the reward of a completion is the share of its sampled
    token ids below ``vocab // parts`` (the target block of the vocabulary). A random tiny
    model starts near ``1 / parts``; a policy that learned the task gets close to 1."""

    vocab: int
    parts: int = 4

    @property
    def limit(self) -> int:
        return self.vocab // self.parts

    def reward(self, sampled: torch.Tensor | tuple[int, ...]) -> float:
        ids = torch.as_tensor(sampled)
        if ids.numel() == 0:
            raise ValueError("toy task: a completion with no sampled tokens has no reward")
        return float((ids < self.limit).to(torch.float64).mean())

    def __call__(self, completion: Completion) -> float:
        return self.reward(completion.token_ids)


def load_function(spec: str) -> Callable[[Completion], float]:
    """``module:function`` (the module importable from the current environment or the working
    directory) as a callable, or ``RewardError`` naming what is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"--reward {spec!r}: expected MODULE:FUNCTION (e.g. my_rewards:score)")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 (any import failure is the user's module's)
        raise RewardError(
            f"--reward {spec}: cannot import module {module_name!r}: {type(err).__name__}: {err}"
        ) from err
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(
                f"--reward {spec}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                f"has no {attr!r}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def hook_reward(pm) -> Callable[[Completion], float]:
    """The ``lockstep_reward`` hook as a reward function (refused when no plugin has one)."""
    caller = pm.hook.lockstep_reward
    if not caller.get_hookimpls():
        raise RewardError(
            "--reward hook: no installed plugin implements lockstep_reward; register one under "
            "the 'lockstep' entry-point group or pass --reward MODULE:FUNCTION"
        )

    def reward(completion: Completion) -> float:
        value = caller(completion=completion)
        if value is None:
            raise RewardError("every lockstep_reward implementation returned None")
        return value

    return reward


def score(fn: Callable[[Completion], float], completion: Completion, name: str) -> float:
    """``fn(completion)`` as a finite float, or ``RewardError`` naming the completion."""
    where = f"the reward {name} on completion {completion.index} (prompt {completion.prompt!r})"
    try:
        value = fn(completion)
    except Exception as err:  # noqa: BLE001 (the user's function: report whatever it raised)
        raise RewardError(f"{where} raised {type(err).__name__}: {err}") from err
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        else:
            raise RewardError(f"{where} returned {value!r}, not a number")
    if not math.isfinite(value):
        raise RewardError(f"{where} returned {value!r}, not a finite number")
    return float(value)
