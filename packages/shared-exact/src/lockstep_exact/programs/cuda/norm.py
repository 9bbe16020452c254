"""rmsnorm.qwen3 and residual.add on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arith import BF16, EXACT, next_pow2, require, require_cuda

_MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, h_f32, eps, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    xf = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    ss = tl.sum(xf * xf, 0)
    var = tl.math.div_rn(ss, h_f32)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    y = (xf * inv).to(tl.bfloat16)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    out = (y.to(tl.float32) * w).to(tl.bfloat16)
    tl.store(y_ptr + row * stride_y + offs, out, mask=ok)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 convention, bf16 in and out; one program per row, so a row never sees another.

    xf = fp32(x); var = sum(xf*xf) / H; inv = 1 / sqrt(var + eps)  (IEEE div and sqrt);
    y = bf16(xf * inv); out = bf16(fp32(y) * fp32(weight)).
    The sum is Triton's tl.sum tree over one [next_pow2(H)] block (+0 padding): its order is
    fixed by H alone (block and warp count are functions of H).
    """
    require_cuda(x, weight)
    require(x.dtype == BF16 and weight.dtype == BF16, "rmsnorm: bf16 input and weight required")
    require(x.shape[-1] == weight.shape[-1], "rmsnorm: weight length differs from hidden size")
    hidden = x.shape[-1]
    require(1 <= hidden <= _MAX_HIDDEN, f"rmsnorm (cuda): hidden size {hidden} unsupported")
    x2 = x.reshape(-1, hidden).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        block = next_pow2(hidden)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            weight.contiguous(),
            y,
            hidden,
            float(hidden),
            float(eps),
            x2.stride(0),
            y.stride(0),
            BLOCK=block,
            num_warps=max(1, min(16, block // 1024)),
            **EXACT,
        )
    return y.reshape(x.shape)
