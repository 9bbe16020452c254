"""lora.shrink / lora.expand on the GPU: one K partition each, the scale applied after expand."""

from __future__ import annotations

import torch

from .arith import BF16, F32, as_f32, require, require_cuda, round_bf16
from .gemm import gemm


def lora_shrink(x: torch.Tensor, a: torch.Tensor, *, bk: int) -> torch.Tensor:
    """t = bf16(gemm(x, A)): x [..., K] bf16, A [r, K] bf16; the rank-r buffer is bf16."""
    require_cuda(x, a)
    require(x.dtype == BF16 and a.dtype == BF16, "lora_shrink: bf16 x and A required")
    return gemm(x, a, bk=bk, out_dtype=BF16)


def lora_expand(base: torch.Tensor, t: torch.Tensor, b: torch.Tensor, scale: float, *, bk: int):
    """out = base where delta == 0, else bf16(fp32(base) + delta), delta = gemm_fp32(t, B) * scale.

    B [N, r] bf16. A zero adapter (A = 0 or B = 0) therefore returns the base bytes exactly,
    signed zeros included. The scale is rounded to fp32 once; the multiply and the add are
    IEEE elementwise (torch).
    """
    require_cuda(base, t, b)
    require(base.dtype == BF16 and t.dtype == BF16 and b.dtype == BF16, "lora_expand: bf16 inputs")
    delta = gemm(t, b, bk=bk, out_dtype=F32) * torch.tensor(scale, dtype=F32, device=t.device)
    out = round_bf16(as_f32(base) + delta)
    return torch.where(delta == 0, base, out)
