"""swiglu on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .arith import BF16, EXACT, require, require_cuda

_BLOCK = 2048


@triton.jit(do_not_specialize=["n"])
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act = tl.math.div_rn(g, libdevice.exp(-g) + 1.0).to(tl.bfloat16)
    tl.store(y_ptr + offs, (act.to(tl.float32) * u).to(tl.bfloat16), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(bf16(silu(gate))) * fp32(up)), silu(x) = x / (exp(-x) + 1).

    exp is libdevice's __nv_expf (a fixed instruction sequence, deterministic on one GPU
    arch); the division is IEEE (div.rn). Elementwise: position and batch independent.
    """
    require_cuda(gate, up)
    require(gate.dtype == BF16 and up.dtype == BF16, "swiglu: bf16 gate and up required")
    require(gate.shape == up.shape, "swiglu: gate and up shapes differ")
    g = gate.contiguous()
    u = up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, _BLOCK),)](g, u, y, n, BLOCK=_BLOCK, num_warps=8, **EXACT)
    return y
