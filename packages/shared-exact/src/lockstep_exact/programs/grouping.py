"""A step's expert routing sorted by expert, on its own device (no host read).

Grouped-expert programs (``programs.gemm_grouped``) run every expert's rows in one launch; this
plan tells them which rows are whose. The (row, slot) pairs of a router's ids [T, k] are sorted
by expert, stably: within an expert, ascending row then slot, the order in which
``lanes.qwen3.local_dispatch`` hands an expert its rows. The sorted pairs are cut into tiles of
at most ``TILE_M`` pairs of one expert. Their number is bounded by the shapes alone
(``ceil(P / TILE_M) + min(E, P)`` for P pairs and E experts), so a CUDA graph can capture the
plan; tiles past the step's last are marked empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Pairs of one tile: the 64-row tile of the cuda gemm's tilings (4 warps, one wgmma row block).
TILE_M = 64


@dataclass(frozen=True)
class ExpertPlan:
    """``order``: int64 [P], the pair index (row * k + slot) at each sorted position;
    ``src``: int64 [P], the hidden row of each sorted position; ``bounds``: int64 [E + 1],
    expert e's pairs are sorted positions bounds[e] .. bounds[e+1]; ``tiles``: int32 [n, 3],
    per tile (expert, first sorted position, pairs), expert -1 for an empty tile."""

    order: torch.Tensor
    src: torch.Tensor
    bounds: torch.Tensor
    tiles: torch.Tensor
    experts: int
    topk: int

    @property
    def pairs(self) -> int:
        return self.order.shape[0]


def expert_plan(ids: torch.Tensor, experts: int) -> ExpertPlan:
    """The plan of a router's ids [T, k] (expert ids in [0, experts))."""
    if ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"expert_plan: integer ids [T, k] expected, got {ids.dtype} "
                         f"{tuple(ids.shape)}")  # fmt: skip
    if experts < 1:
        raise ValueError(f"expert_plan: {experts} experts")
    t, k = ids.shape
    pairs = t * k
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    bounds = torch.searchsorted(flat[order], torch.arange(experts + 1, device=dev))
    counts = bounds[1:] - bounds[:-1]
    per = (counts + (TILE_M - 1)) // TILE_M
    ends = torch.cumsum(per, 0)
    n = -(-pairs // TILE_M) + min(experts, pairs)
    b = torch.arange(max(n, 1), device=dev)
    e = torch.searchsorted(ends, b, right=True)
    used = e < experts
    ec = e.clamp(max=experts - 1)
    j = b - (ends[ec] - per[ec])
    first = bounds[ec] + j * TILE_M
    rows = (counts[ec] - j * TILE_M).clamp(max=TILE_M)
    tiles = torch.stack(
        [torch.where(used, ec, -1), torch.where(used, first, 0), torch.where(used, rows, 0)], 1
    ).to(torch.int32)
    src = torch.div(order, k, rounding_mode="floor")
    return ExpertPlan(order, src, bounds, tiles, experts, k)


def unsort(y: torch.Tensor, plan: ExpertPlan) -> torch.Tensor:
    """[P, H] rows in the plan's sorted order -> [T, k, H] at their (row, slot): copies only."""
    out = torch.empty_like(y)
    out[plan.order] = y
    return out.view(-1, plan.topk, y.shape[-1])


__all__ = ["TILE_M", "ExpertPlan", "expert_plan", "unsort"]
