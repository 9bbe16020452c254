"""rmsnorm.qwen3 and residual.add: the Qwen3 normalization and the residual stream."""

from __future__ import annotations

import torch

from .arith import BF16, F32, as_f32, require, round_bf16, sqrt_rn, tree_sum


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 convention, bf16 in and out.

    xf = fp32(x); var = tree_sum(xf*xf) / H; inv = 1 / sqrt(var + eps);
    y = bf16(xf * inv); out = bf16(fp32(y) * fp32(weight)).
    The normalized value is materialized in bf16 before the weight multiplies, as Qwen3 does.
    """
    require(x.dtype == BF16 and weight.dtype == BF16, "rmsnorm: bf16 input and weight required")
    require(x.shape[-1] == weight.shape[-1], "rmsnorm: weight length differs from hidden size")
    xf = as_f32(x)
    var = tree_sum(xf * xf) / float(x.shape[-1])
    inv = 1.0 / sqrt_rn(var + torch.tensor(eps, dtype=F32))
    y = round_bf16(xf * inv[..., None])
    return round_bf16(as_f32(y) * as_f32(weight))


def residual_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The residual stream stays bf16: bf16(fp32(a) + fp32(b))."""
    require(a.dtype == BF16 and b.dtype == BF16, "residual_add: bf16 operands required")
    require(a.shape == b.shape, f"residual_add: shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return round_bf16(as_f32(a) + as_f32(b))
