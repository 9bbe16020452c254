"""The other programs of the hybrid lane (Qwen3-Next), cpu backend: the zero-centered RMSNorm,
the gated RMSNorm before out_proj, the attention output gate and the shared expert's gate.

fp32 inside, one rounding to bf16 at the end of each program. Device-generic, as gdn.py (its
docstring has the rules): the cuda backend runs this code on CUDA tensors, same bytes.
"""

from __future__ import annotations

import torch

from .activation import silu
from .arith import BF16, F32, as_f32, require, round_bf16, sqrt_rn, tree_sum
from .gdn import sigmoid


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(tree_sum_H(x*x) / H + fp32(eps)): IEEE division and sqrt, no rsqrt.

    H is divided as a 0-dim tensor on x's device (never a Python number: CUDA would multiply
    by its reciprocal instead)."""
    h = torch.tensor(float(xf.shape[-1]), dtype=F32, device=xf.device)
    var = tree_sum(xf * xf) / h
    return 1.0 / sqrt_rn(var + torch.tensor(eps, dtype=F32, device=xf.device))


def check_zero_centered(x, weight) -> None:
    """rmsnorm.zero_centered's input checks (both backends)."""
    require(
        x.dtype == BF16 and weight.dtype == BF16,
        "rmsnorm.zero_centered: bf16 input and weight required",
    )
    require(
        x.shape[-1:] == weight.shape,
        f"rmsnorm.zero_centered: weight {tuple(weight.shape)} does not match hidden size "
        f"{x.shape[-1]}",
    )


def rmsnorm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] bf16, weight [H] bf16 stored as w - 1: bf16((xf * inv) * (1 + fp32(w)))."""
    check_zero_centered(x, weight)
    xf = as_f32(x)
    y = xf * _inv_rms(xf, eps)[..., None]
    return round_bf16(y * (as_f32(weight) + 1.0))


def check_gated(x, z, weight) -> None:
    """rmsnorm.gated's input checks (both backends)."""
    require(
        x.dtype == BF16 and z.dtype == BF16 and weight.dtype == BF16,
        "rmsnorm.gated: bf16 x, z and weight required",
    )
    require(x.shape == z.shape, f"rmsnorm.gated: x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    require(
        x.shape[-1:] == weight.shape,
        f"rmsnorm.gated: weight {tuple(weight.shape)} does not match head dim {x.shape[-1]}",
    )


def rmsnorm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, z [..., V] bf16, weight [V] bf16: bf16(((xf * inv) * fp32(w)) * silu(fp32(z)))."""
    check_gated(x, z, weight)
    xf = as_f32(x)
    y = (xf * _inv_rms(xf, eps)[..., None]) * as_f32(weight)
    return round_bf16(y * silu(as_f32(z)))


def check_sigmoid_gate(x, gate) -> None:
    """gate.sigmoid's input checks (both backends)."""
    require(x.dtype == BF16 and gate.dtype == BF16, "gate.sigmoid: bf16 x and gate required")
    require(
        x.shape == gate.shape,
        f"gate.sigmoid: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ",
    )


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output gate: x, gate bf16 of one shape.

    out = bf16(fp32(x) * sigmoid(fp32(gate))).
    """
    check_sigmoid_gate(x, gate)
    return round_bf16(as_f32(x) * sigmoid(as_f32(gate)))


def check_shared_gate(routed, shared, logit) -> None:
    """moe.shared_gate's input checks (both backends)."""
    require(
        routed.dtype == BF16 and shared.dtype == BF16 and logit.dtype == BF16,
        "moe.shared_gate: bf16 routed, shared and logit required",
    )
    require(
        routed.dim() == 2 and shared.shape == routed.shape,
        "moe.shared_gate: routed and shared [T, H] of one shape",
    )
    require(
        logit.shape == (routed.shape[0], 1),
        f"moe.shared_gate: the gate logit must be [{routed.shape[0]}, 1], got {tuple(logit.shape)}",
    )


def shared_expert_gate(routed: torch.Tensor, shared: torch.Tensor, logit: torch.Tensor):
    """The MoE block's output: routed, shared [T, H] bf16, logit [T, 1] bf16 (the
    shared_expert_gate projection) -> bf16(fp32(routed) + sigmoid(fp32(logit)) * fp32(shared))."""
    check_shared_gate(routed, shared, logit)
    return round_bf16(as_f32(routed) + sigmoid(as_f32(logit)) * as_f32(shared))
