"""K3, and the decision-by-decision report of sampler vs trainer log-probabilities.

The byte comparisons themselves (raw bits, ulp distances) live in ``parity``; this module
adds K3 and ``compare``, the report the ladder and ``lockstep replay`` print.

Exact parity means byte equality of the float32 log-probabilities. K3 is reported beside it
because RL practitioners read it: per decision, with ``r = trainer - sampler`` (the log-ratio,
in float64), ``K3 = exp(r) - 1 - r``; its mean over tokens drawn by the sampler estimates
KL(sampler || trainer).

``exp(r) - 1 - r`` is evaluated as ``expm1(r) - r``. For ``|r| < 2^-10`` that difference
cancels badly (it is about ``r^2 / 2``, next to values of size ``r``), so there the Taylor
series ``r^2 (1/2 + r/6 + r^2/24 + r^3/120 + r^4/720)`` is used instead, whose truncation error
is below float64 rounding. With it, K3 is zero exactly when the two values are equal, and
strictly positive otherwise, for every pair of finite float32 inputs (the smallest float32
difference, 2^-149, squares to about 2^-299, far above float64's underflow). Where the two
inputs have identical bytes, K3 is set to exactly 0 (also for equal infinities or NaN
payloads, for which the formula would give NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .parity import same_bytes_mask, ulp_distances

__all__ = ["Comparison", "compare", "k3"]

_SERIES_BELOW = 2.0**-10


def _flat(x: torch.Tensor | list[float], name: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float32)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must hold floating-point log-probs, got {t.dtype}")
    return t.detach().to("cpu").reshape(-1)


def _pair(sampler, trainer) -> tuple[torch.Tensor, torch.Tensor]:
    s = _flat(sampler, "sampler_logprobs")
    t = _flat(trainer, "trainer_logprobs")
    if s.numel() != t.numel():
        raise ValueError(f"sampler has {s.numel()} log-probs, trainer has {t.numel()}")
    return s, t


def k3(
    sampler_logprobs: torch.Tensor | list[float], trainer_logprobs: torch.Tensor | list[float]
) -> torch.Tensor:
    """Per-decision K3 (float64, flattened): ``exp(r) - 1 - r`` with ``r = trainer - sampler``.

    Exactly 0 where the inputs have identical bytes; > 0 wherever finite values differ."""
    s, t = _pair(sampler_logprobs, trainer_logprobs)
    r = t.to(torch.float64) - s.to(torch.float64)
    direct = torch.expm1(r) - r
    series = r * r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720)))))
    out = torch.where(r.abs() < _SERIES_BELOW, series, direct)
    return torch.where(same_bytes_mask(s, t), torch.zeros_like(out), out)


@dataclass(frozen=True)
class Comparison:
    """Sampler vs trainer log-probs, decision by decision."""

    n: int
    byte_equal: int
    first_diff: int | None
    k3_max: float
    k3_mean: float
    max_ulp: int

    @property
    def exact(self) -> bool:
        """Every decision has identical float32 bytes."""
        return self.byte_equal == self.n

    def __str__(self) -> str:
        where = "none" if self.first_diff is None else str(self.first_diff)
        return (
            f"{self.byte_equal}/{self.n} byte-equal, first diff at {where}, max ulp "
            f"{self.max_ulp}, K3 max {self.k3_max:.3e} mean {self.k3_mean:.3e}"
        )


def compare(sampler: torch.Tensor | list[float], trainer: torch.Tensor | list[float]) -> Comparison:
    """Compare float32 log-probs on their raw bytes (``view(torch.int32)`` equality: -0.0 vs
    +0.0 and different NaN payloads count as different), with K3 and ulp distances beside."""
    s, t = _pair(sampler, trainer)
    for name, x in (("sampler", s), ("trainer", t)):
        if x.dtype != torch.float32:
            raise TypeError(f"compare needs float32 log-probs (raw bytes); {name} is {x.dtype}")
    n = s.numel()
    if n == 0:
        return Comparison(0, 0, None, 0.0, 0.0, 0)
    same = same_bytes_mask(s, t)
    diff_at = torch.nonzero(~same)
    values = k3(s, t)
    return Comparison(
        n=n,
        byte_equal=int(same.sum().item()),
        first_diff=int(diff_at[0].item()) if diff_at.numel() else None,
        k3_max=float(values.max().item()),
        k3_mean=float(values.mean().item()),
        max_ulp=int(ulp_distances(s, t).max().item()),
    )
