"""router.softmax_topk and moe.fold: Qwen3-MoE routing and the canonical combine."""

from __future__ import annotations

import torch

from .arith import BF16, F32, as_f32, require, round_bf16, tree_sum
from .softmax import softmax


def router_topk(logits: torch.Tensor, k: int, *, normalize: bool = True):
    """logits [T, E] (bf16 or fp32) -> (expert ids [T, k] ascending, weights [T, k] bf16).

    p = softmax_fp32(logits) (this module's softmax program: the only reduction); the k
    largest p are chosen, ties going to the lowest expert id (a stable sort on -p: comparisons
    only); the chosen are put in ascending expert id order; with ``normalize`` (Qwen3-MoE
    norm_topk_prob) w = p / tree_sum(p_chosen); one RNE to bf16. Every step is an exact
    elementwise torch operation or a fixed tree, so this code gives the same bytes on any
    device; the cuda backend runs it as one kernel (``programs/cuda/moe.py``).
    """
    require(logits.dim() == 2, "router_topk: logits [T, E]")
    require(1 <= k <= logits.shape[1], f"router_topk: top-{k} of {logits.shape[1]} experts")
    p = softmax(as_f32(logits))
    order = torch.sort(-p, dim=-1, stable=True).indices[:, :k]
    ids = torch.sort(order, dim=-1).values
    w = torch.gather(p, 1, ids)
    if normalize:
        w = w / tree_sum(w)[:, None]
    return ids, round_bf16(w)


def moe_fold(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """expert_out [T, k, H] bf16 in ascending expert id order, weights [T, k] bf16 -> [T, H].

    c_i = bf16(fp32(w_i) * fp32(y_i)); then a balanced adjacent-pair tree over i (padded to a
    power of two with +0) with a bf16 rounding after every add (the bf16-per-add variant).
    """
    return fold(expert_out, weights, round_bf16)


def fold(expert_out: torch.Tensor, weights: torch.Tensor, round_bf16_fn) -> torch.Tensor:
    """moe.fold (bf16 per add) around a backend's own RNE rounding: every step is an elementwise
    IEEE operation over whole slices (no library reduction), so rows never interact and the
    same code serves every backend."""
    require(expert_out.dtype == BF16 and weights.dtype == BF16, "moe_fold: bf16 inputs")
    require(expert_out.dim() == 3 and weights.shape == expert_out.shape[:2], "moe_fold: shapes")
    c = round_bf16_fn(as_f32(weights)[..., None] * as_f32(expert_out))
    n = c.shape[1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = torch.zeros(c.shape[0], width - n, c.shape[2], dtype=BF16, device=c.device)
        c = torch.cat([c, pad], dim=1)
    while c.shape[1] > 1:
        c = round_bf16_fn(as_f32(c[:, 0::2]) + as_f32(c[:, 1::2]))
    return c[:, 0]


def moe_fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fp32 variant: products and tree adds in fp32, one rounding at the end."""
    return fold_fp32(expert_out, weights, round_bf16)


def fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor, round_bf16_fn) -> torch.Tensor:
    """moe.fold{acc=fp32} around a backend's own RNE rounding (any device)."""
    require(expert_out.dtype == BF16 and weights.dtype == BF16, "moe_fold: bf16 inputs")
    require(expert_out.dim() == 3 and weights.shape == expert_out.shape[:2], "moe_fold: shapes")
    c = as_f32(weights)[..., None] * as_f32(expert_out)
    return round_bf16_fn(tree_sum(c, dim=1))


__all__ = ["router_topk", "moe_fold", "moe_fold_fp32", "F32"]
