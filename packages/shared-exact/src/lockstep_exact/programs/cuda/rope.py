"""rope.neox on the GPU, with the cpu program's exact tables."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import position_bound_now
from ..cpu.rope import rope_tables
from .arith import BF16, EXACT, index_tensor, next_pow2, require, require_cuda, trap_if

_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def gpu_tables(base: float, dim: int, n_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cpu backend's (cos, sin) fp32 tables (IEEE-only arithmetic), copied to ``device``."""
    cos, sin = rope_tables(base, dim, n_pos)
    key = (float(base), int(dim), cos.shape[0], str(torch.device(device)))
    if key not in _TABLES:
        _TABLES[key] = (cos.contiguous().to(device), sin.contiguous().to(device))
    return _TABLES[key]


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_p,
    n_pos,
    y_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CHECK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    ok = (heads < H)[:, None]
    p = tl.load(pos_ptr + t * stride_p).to(tl.int64)
    if CHECK:  # the position bound, promised by the caller, checked here (no host read)
        p += trap_if((p < 0) | (p >= n_pos))
    c = tl.load(cos_ptr + p * HALF + d)[None, :]
    s = tl.load(sin_ptr + p * HALF + d)[None, :]
    src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    dst = y_ptr + t * stride_yt + heads[:, None] * stride_yh + d[None, :]
    tl.store(dst, o1.to(tl.bfloat16), mask=ok)
    tl.store(dst + HALF, o2.to(tl.bfloat16), mask=ok)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [T, H, D] bf16 at absolute positions [T]; rotate-half (NeoX/Qwen3) convention.

    out1 = bf16(x1*cos - x2*sin), out2 = bf16(x2*cos + x1*sin), fp32 in between, each * and
    +/- rounded separately (contraction off). Tables are the cpu program's, bit for bit.
    """
    require_cuda(x)
    require(x.dtype == BF16, "rope: bf16 input required")
    require(x.dim() == 3 and positions.shape == (x.shape[0],), "rope: x [T, H, D], positions [T]")
    n_tok, heads, dim = x.shape
    half = dim // 2
    require(dim % 2 == 0 and half == next_pow2(half), f"rope (cuda): head dim {dim} unsupported")
    if n_tok == 0:
        return x.clone()
    bound = position_bound_now()
    pos = index_tensor(positions, x.device, "rope")
    if bound is None:
        require(
            not torch.cuda.is_current_stream_capturing(),
            "rope (cuda): a CUDA graph capture needs programs.position_bound (this call would "
            "read the positions on the host)",
        )
        n_pos = int(positions.max()) + 1  # a host read: the table must cover every position
        require(int(positions.min()) >= 0, "rope: negative position")
    else:
        n_pos = bound  # the promise, checked in the kernel (trap_if): no host read
    cos, sin = gpu_tables(base, dim, n_pos, x.device)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    block_h = min(next_pow2(heads), max(1, 4096 // half))
    grid = (n_tok, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        xc,
        cos,
        sin,
        pos,
        pos.stride(0),
        n_pos,
        y,
        heads,
        xc.stride(0),
        xc.stride(1),
        y.stride(0),
        y.stride(1),
        HALF=half,
        BLOCK_H=block_h,
        CHECK=bound is not None,
        num_warps=4,
        **EXACT,
    )
    return y
