"""silu and swiglu with the exp of this backend."""

from __future__ import annotations

import torch

from .arith import BF16, F32, as_f32, exp, require, round_bf16


def silu(x: torch.Tensor) -> torch.Tensor:
    """fp32 x / (1 + exp(-x))."""
    require(x.dtype == F32, "silu: float32 input required")
    return x / (exp(-x) + 1.0)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(bf16(silu(gate))) * fp32(up)): the activation is materialized in bf16."""
    require(gate.dtype == BF16 and up.dtype == BF16, "swiglu: bf16 gate and up required")
    require(gate.shape == up.shape, "swiglu: gate and up shapes differ")
    act = round_bf16(silu(as_f32(gate)))
    return round_bf16(as_f32(act) * as_f32(up))
