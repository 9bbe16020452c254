"""``lockstep train``: GRPO on a LoRA adapter, exact at every step (first working step).

Each step: the serving plugin samples ``group`` completions per prompt with the current
adapter (one seed per sequence, every seed of the run distinct); the built-in toy task rewards
them; advantages are normalized within each prompt's group; the trainer plugin replays the
trace and every decision's FP32 log-probability must be byte-equal to the sampler's before the
trainer hook runs its update (a mismatch stops the run, naming the first differing decision,
and the last exported adapter is left as it was); the updated adapter is exported (PEFT, bf16)
into its own directory and the next step samples from it.

This first step builds a new sampling engine per step (the capture hook starts one per call)
and a new trainer (fresh AdamW state) per step; a long-lived engine with hot-loaded adapters,
PPO clipping, a reference KL, checkpoints and resume are not built yet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .k3 import compare
from .model import ModelDir
from .plugins import require_hook
from .requests import CaptureRequest, ReplayRequest, TrainRequest
from .tiny import default_prompts
from .trace import Trace


class TrainStopped(RuntimeError):
    """The run stopped: a replayed log-probability was not byte-equal to the sampler's."""


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

    def reward(self, sampled: torch.Tensor) -> float:
        if sampled.numel() == 0:
            raise ValueError("toy task: a completion with no sampled tokens has no reward")
        return float((sampled < self.limit).to(torch.float64).mean())


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's standard
    deviation (population); a group whose rewards are all equal gets zeros. Sequences are
    ordered group by group (``group`` consecutive sequences share a prompt)."""
    if group < 2 or len(rewards) % group:
        raise ValueError(
            f"group advantages: {len(rewards)} rewards do not split into groups of "
            f"{group} (a group needs at least 2 completions)"
        )
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    adv = torch.where(std > 0, (r - mean) / std.clamp_min(1e-12), torch.zeros_like(r))
    return [float(a) for a in adv.to(torch.float32).flatten()]


@dataclass
class GRPOConfig:
    steps: int = 10
    group: int = 4
    prompts: int = 4  # how many of the built-in prompts
    decisions: int = 8  # sampled tokens per completion
    lr: float = 2e-2
    inner_steps: int = 4  # optimizer steps per GRPO step (micro-batches of the trainer's own)
    rank: int = 8
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "decisions", "inner_steps", "rank", "prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"train: --{name.replace('_', '-')} must be an int >= 1, got {value!r}"
                )
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 2:
            raise ValueError(
                f"train: --group must be an int >= 2 (GRPO normalizes within a "
                f"group), got {self.group!r}"
            )
        if not 1 <= self.prompts <= 8:
            raise ValueError(
                f"train: --prompts must be in [1, 8] (built-in prompts), got {self.prompts}"
            )
        if not self.lr > 0:
            raise ValueError(f"train: --lr must be > 0, got {self.lr!r}")


def run_grpo(
    pm,
    model_dir: Path,
    out_dir: Path,
    config: GRPOConfig,
    *,
    progress: Callable[[str], None] = print,
    reward: Callable[[torch.Tensor], float] | None = None,
) -> list[dict]:
    """Run ``config.steps`` GRPO steps; returns the metrics (also in ``out_dir/metrics.jsonl``).

    ``reward`` maps one completion's sampled token ids to a float (default: the built-in
    ``ToyTask`` for this model's vocabulary).

    Raises ``TrainStopped`` when a replay is not byte-equal (its metrics line is written
    first); the adapters of the steps before stay in ``out_dir/adapters``."""
    config.check()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    capture = require_hook(pm, "lockstep_capture", "sampler", "lockstep-serving")
    replay = require_hook(pm, "lockstep_replay", "trainer", "lockstep-megatron")
    train = require_hook(pm, "lockstep_train_step", "trainer", "lockstep-megatron")
    mdir = ModelDir(model_dir)
    contract = mdir.contract()
    reward = reward or ToyTask(vocab=mdir.geometry.vocab).reward
    base_prompts = default_prompts(config.prompts)
    prompts = tuple(p for p in base_prompts for _ in range(config.group))
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / "metrics.jsonl"
    metrics_path.write_text("")
    adapter: Path | None = None
    history: list[dict] = []
    for step in range(1, config.steps + 1):
        t0 = time.perf_counter()
        trace_dir = out_dir / "traces" / f"step-{step:04d}"
        trace = capture(
            request=CaptureRequest(
                model_dir=model_dir,
                prompts=prompts,
                decisions=config.decisions,
                out_dir=trace_dir,
                adapter_dir=adapter,
                seed=config.seed + (step - 1) * len(prompts),  # every sequence its own seed
                contract=contract.fingerprint,
            )
        )
        if not (trace_dir / "manifest.json").exists():
            trace.save(trace_dir)
        trace = Trace.load(trace_dir)
        rewards = [reward(trace.sampled(i)) for i in range(trace.num_sequences)]
        advantages = group_advantages(rewards, config.group)
        trainer_lps = replay(
            request=ReplayRequest(model_dir=model_dir, trace_dir=trace_dir, adapter_dir=adapter)
        ).logprobs
        cmp = compare(trace.logprobs, trainer_lps)
        row = {
            "step": step,
            "reward_mean": sum(rewards) / len(rewards),
            "k3_max": cmp.k3_max,
            "decisions": cmp.n,
            "equal": cmp.byte_equal,
            "rewards": rewards,
            "trace": str(trace_dir),
            "adapter_in": str(adapter) if adapter else None,
        }
        if not cmp.exact:
            row["seconds"] = time.perf_counter() - t0
            _append(metrics_path, row)
            history.append(row)
            raise TrainStopped(
                f"step {step}: the trainer's log-probability of decision {cmp.first_diff} is "
                f"not byte-equal to the sampler's ({cmp.byte_equal} of {cmp.n} equal, K3 max "
                f"{cmp.k3_max:.3g}); no update was made, the last adapter is "
                f"{adapter or 'none (the base model)'}; trace {trace_dir}"
            )
        result = train(
            request=TrainRequest(
                model_dir=model_dir,
                trace_dir=trace_dir,
                adapter_in=adapter,
                adapter_out=out_dir / "adapters" / f"step-{step:04d}",
                steps=config.inner_steps,
                lr=config.lr,
                rank=config.rank,
                seed=config.seed + step,
                advantages=tuple(advantages),
            )
        )
        if result.backbone_hash_before != result.backbone_hash_after:
            raise TrainStopped(f"step {step}: the backbone changed during the update")
        adapter = Path(result.adapter_dir)
        row["loss"] = sum(result.losses) / len(result.losses)
        row["adapter_out"] = str(adapter)
        row["seconds"] = time.perf_counter() - t0
        _append(metrics_path, row)
        history.append(row)
        progress(
            f"step {step}/{config.steps}  reward {row['reward_mean']:.3f}  "
            f"equal {cmp.byte_equal}/{cmp.n}  k3_max {cmp.k3_max:g}  "
            f"loss {row['loss']:+.4f}  {row['seconds']:.1f}s"
        )
    return history


def _append(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
