"""router.softmax_topk and moe.fold on the GPU."""

from __future__ import annotations

import torch

from ..cpu.arith import tree_sum
from ..cpu.moe import select_topk
from .arith import BF16, as_f32, require, require_cuda, round_bf16
from .softmax import softmax


def router_topk(logits: torch.Tensor, k: int, *, normalize: bool = True):
    """logits [T, E] (bf16 or fp32) -> (expert ids [T, k] ascending, weights [T, k] bf16).

    p = softmax_fp32(logits) (this backend's program); the k largest p are chosen, ties going
    to the lowest expert id (a stable sort on -p: comparisons only, exact); the chosen are put
    in ascending expert id order; with ``normalize`` w = p / pair_tree_sum(p_chosen) (IEEE
    adds and division, elementwise torch ops); one RNE to bf16.
    """
    require_cuda(logits)
    return select_topk(logits, k, normalize, softmax)


def moe_fold(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [T, k, H] bf16 in ascending expert id order, weights [T, k] bf16 -> [T, H].

    c_i = bf16(fp32(w_i) * fp32(y_i)); then a balanced adjacent-pair tree over i (padded to a
    power of two with +0) with a bf16 rounding after every add. Every step is an elementwise
    IEEE operation over whole slices (no library reduction), so rows never interact.
    """
    require_cuda(expert_out, weights)
    require(expert_out.dtype == BF16 and weights.dtype == BF16, "moe_fold: bf16 inputs")
    require(expert_out.dim() == 3 and weights.shape == expert_out.shape[:2], "moe_fold: shapes")
    c = round_bf16(as_f32(weights)[..., None] * as_f32(expert_out))
    n = c.shape[1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = torch.zeros(c.shape[0], width - n, c.shape[2], dtype=BF16, device=c.device)
        c = torch.cat([c, pad], dim=1)
    while c.shape[1] > 1:
        c = round_bf16(as_f32(c[:, 0::2]) + as_f32(c[:, 1::2]))
    return c[:, 0]


def moe_fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fp32 variant: products and tree adds in fp32, one rounding at the end."""
    require_cuda(expert_out, weights)
    require(expert_out.dtype == BF16 and weights.dtype == BF16, "moe_fold: bf16 inputs")
    require(expert_out.dim() == 3 and weights.shape == expert_out.shape[:2], "moe_fold: shapes")
    c = as_f32(weights)[..., None] * as_f32(expert_out)
    return round_bf16(tree_sum(c, dim=1))
