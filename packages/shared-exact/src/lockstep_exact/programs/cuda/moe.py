"""router.softmax_topk and moe.fold on the GPU."""

from __future__ import annotations

import torch

from ..cpu.moe import fold, fold_fp32, select_topk
from .arith import require_cuda, round_bf16
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
    """moe.fold (bf16 per add): the shared elementwise fold with this backend's rounding."""
    require_cuda(expert_out, weights)
    return fold(expert_out, weights, round_bf16)


def moe_fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.fold{acc=fp32}: the shared fold with this backend's rounding."""
    require_cuda(expert_out, weights)
    return fold_fp32(expert_out, weights, round_bf16)
