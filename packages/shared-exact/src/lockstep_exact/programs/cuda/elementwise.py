"""Elementwise programs on the GPU, one Triton launch each (the torch forms took three to six
kernels apiece: a widening per operand, the operation, the narrowing, the NaN pattern):

- ``residual_add``: residual.add, bf16(fp32(a) + fp32(b)), one IEEE add and that rounding.

Each element sees only its own inputs, so no byte depends on the launch's size or on the other
elements. Gated against the cpu programs in Triton's interpreter (test_interpret.py) and on the
GPU (test_programs_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import BF16, EXACT, bits16, require, require_cuda
from .exactmath import round_bf16 as _round_bits
from .exactmath import widen

_BLOCK = 1024
_WARPS = 4


@triton.jit(do_not_specialize=["n"])
def _residual_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = widen(tl.load(a_ptr + offs, mask=ok, other=0))
    b = widen(tl.load(b_ptr + offs, mask=ok, other=0))
    tl.store(y_ptr + offs, _round_bits(a + b), mask=ok)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def residual_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(a) + fp32(b)): one IEEE add and one RNE per element (NaNs as 0x7FC0)."""
    require_cuda(a, b)
    return added(a, b)


def added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``residual_add``'s launch on the operands' device."""
    require(a.dtype == BF16 and b.dtype == BF16, "residual_add: bf16 operands required")
    require(a.shape == b.shape, f"residual_add: shapes {tuple(a.shape)} and {tuple(b.shape)}")
    ab, bb = bits16(a), bits16(b)
    y = torch.empty(ab.shape, dtype=torch.int16, device=a.device)
    if ab.numel():
        _residual_kernel[_grid(ab.numel())](ab, bb, y, ab.numel(), BLOCK=_BLOCK,
                                            num_warps=_WARPS, **EXACT)  # fmt: skip
    return y.view(BF16)


__all__ = ["added", "residual_add"]
