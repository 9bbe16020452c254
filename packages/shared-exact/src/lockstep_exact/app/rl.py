"""The training objectives of ``lockstep train``, as plain torch over per-token logprobs.

Each objective maps the trainer's log-probabilities of a micro-batch (one fp32 tensor per
sequence, differentiable) and what the step fixed before the update (the sampler's
log-probabilities ``old``, advantages, a reference's or a teacher's log-probabilities) to one
scalar loss: the mean over the micro-batch's tokens. Nothing here corrects for a sampler that
disagrees with the trainer: the loop checks the bytes first, so the importance ratio of the
first pass is exactly 1 and only the policy's own updates move it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def group_advantages(rewards: Sequence[float], group: int) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's standard
    deviation (population); a group whose rewards are all equal gets zeros. Sequences are
    ordered group by group (``group`` consecutive sequences share a prompt)."""
    if group < 2 or len(rewards) % group:
        raise ValueError(
            f"group advantages: {len(rewards)} rewards do not split into groups of "
            f"{group} (a group needs at least 2 completions)"
        )
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    adv = torch.where(std > 0, (r - mean) / std.clamp_min(1e-12), torch.zeros_like(r))
    return [float(a) for a in adv.to(torch.float32).flatten()]


def whiten(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-token advantages minus their mean over the step's tokens, over their standard
    deviation (population): a constant baseline and a scale, so the policy gradient keeps its
    direction with less variance. All-equal values give zeros."""
    flat = torch.cat([v.reshape(-1) for v in values]).to(torch.float64)
    mean, std = flat.mean(), flat.std(unbiased=False)
    if not std > 0:
        return [torch.zeros_like(v) for v in values]
    return [((v.to(torch.float64) - mean) / std).to(torch.float32) for v in values]


def k3_kl(logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate on the policy's own samples (the k3
    estimator): ``exp(ref - lp) - (ref - lp) - 1``; non-negative, zero where they agree."""
    d = reference - logprobs
    return torch.exp(d) - d - 1.0


def ppo_token_losses(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
) -> torch.Tensor:
    """Per-token clipped surrogate: ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with
    ``r = exp(lp - old)``. ``advantages`` broadcasts (one per sequence, or one per token)."""
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def policy_loss(
    logprobs: Sequence[torch.Tensor],
    old: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    *,
    clip: float = 0.2,
    kl_coef: float = 0.0,
    reference: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The GRPO / on-policy-distillation loss of a micro-batch: the clipped surrogate
    against the sampler's logprobs ``old``, plus ``kl_coef`` times the k3 KL to
    ``reference`` when given; the mean over every token of the micro-batch."""
    if not logprobs:
        raise ValueError("policy loss: an empty micro-batch")
    total = logprobs[0].new_zeros(())
    tokens = 0
    for i, (lp, o, a) in enumerate(zip(logprobs, old, advantages, strict=True)):
        if lp.shape != o.shape:
            raise ValueError(f"policy loss: sequence {i} has {lp.shape} logprobs, old {o.shape}")
        t = ppo_token_losses(lp, o.to(lp), a.to(lp), clip)
        if reference is not None and kl_coef:
            t = t + kl_coef * k3_kl(lp, reference[i].to(lp))
        total = total + t.sum()
        tokens += lp.numel()
    return total / tokens


def sft_loss(logprobs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Supervised fine-tuning: the mean negative logprob of the completion tokens."""
    if not logprobs:
        raise ValueError("sft loss: an empty micro-batch")
    return -torch.cat([lp.reshape(-1) for lp in logprobs]).mean()


def check_clip(clip: float) -> None:
    if not (isinstance(clip, int | float) and 0 < clip < 1 and math.isfinite(clip)):
        raise ValueError(f"train: --clip must be in (0, 1), got {clip!r}")
