"""Shared pieces of the cuda backend: checks, the bf16 rounding, the launch options."""

from __future__ import annotations

import torch

from ..cpu.arith import BF16, F32, require

# Every kernel except the matrix products is compiled with floating-point contraction off, so
# each * and + rounds on its own, as the programs' docstrings say (no fused multiply-add).
EXACT = {"enable_fp_fusion": False}

_NAN_BF16 = 0x7FC0


def require_cuda(*tensors: torch.Tensor) -> None:
    for t in tensors:
        require(t.is_cuda, f"cuda backend: tensor on {t.device}, expected a CUDA device")


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest, ties to even; every NaN becomes 0x7FC0.

    The conversion is the hardware's cvt.rn.bf16.f32 (IEEE RNE, elementwise, so batch
    independent); NaNs are then canonicalized to the cpu backend's pattern.
    """
    require(x.dtype == F32, f"round_bf16 takes float32, got {x.dtype}")
    out = x.to(BF16)
    nan = torch.full((), _NAN_BF16, dtype=torch.int16, device=x.device).view(BF16)
    return torch.where(torch.isnan(x), nan, out)


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """Widening to fp32 is exact for bf16, fp16 and fp32."""
    require(x.dtype in (BF16, torch.float16, F32), f"expected a float tensor, got {x.dtype}")
    return x.to(F32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


__all__ = ["BF16", "EXACT", "F32", "as_f32", "next_pow2", "require", "require_cuda", "round_bf16"]
