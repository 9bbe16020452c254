"""softmax and log_softmax on the GPU: one program per row, fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .arith import EXACT, F32, next_pow2, require, require_cuda

# Rows up to this length are held in registers (one read); longer rows are visited in chunks
# of _CHUNK (three reads). Which path a row takes depends on its length only.
_ONE_BLOCK_MAX = 32768
_CHUNK = 8192


@triton.jit
def _softmax_kernel(
    x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr, ONE: tl.constexpr, LOG: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    dst = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    if ONE:
        ok = offs < V
        x = tl.load(src + offs, mask=ok, other=float("-inf"))
        m = tl.max(x, 0)
        s = x - m
        e = tl.where(ok, libdevice.exp(s), 0.0)
        total = tl.sum(e, 0)
        if LOG:  # noqa: SIM108 (a constexpr branch, not a ternary)
            out = s - libdevice.log(total)
        else:
            out = tl.math.div_rn(e, tl.zeros_like(e) + total)
        tl.store(dst + offs, out, mask=ok)
    else:
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        for c in range(0, V, BLOCK):
            x = tl.load(src + c + offs, mask=c + offs < V, other=float("-inf"))
            m_vec = tl.maximum(m_vec, x)
        m = tl.max(m_vec, 0)
        acc = tl.zeros([BLOCK], tl.float32)
        for c in range(0, V, BLOCK):
            ok = c + offs < V
            x = tl.load(src + c + offs, mask=ok, other=float("-inf"))
            acc += tl.where(ok, libdevice.exp(x - m), 0.0)
        total = tl.sum(acc, 0)
        lse = libdevice.log(total)
        for c in range(0, V, BLOCK):
            ok = c + offs < V
            x = tl.load(src + c + offs, mask=ok, other=0.0)
            s = x - m
            if LOG:
                out = s - lse
            else:
                e = libdevice.exp(s)
                out = tl.math.div_rn(e, tl.zeros_like(e) + total)
            tl.store(dst + c + offs, out, mask=ok)


def _launch(x: torch.Tensor, log: bool) -> torch.Tensor:
    require_cuda(x)
    require(x.dtype == F32, f"softmax programs take float32, got {x.dtype}")
    n = x.shape[-1]
    require(n >= 1, "softmax over an empty dimension")
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        one = n <= _ONE_BLOCK_MAX
        block = next_pow2(n) if one else _CHUNK
        _softmax_kernel[(x2.shape[0],)](
            x2,
            y,
            n,
            x2.stride(0),
            y.stride(0),
            BLOCK=block,
            ONE=one,
            LOG=log,
            num_warps=max(1, min(16, block // 512)),
            **EXACT,
        )
    return y.reshape(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """s = x - max(x); out = s - log(sum(exp(s))).

    exp and log are libdevice's __nv_expf / __nv_logf (fixed instruction sequences). The sum
    is a fixed order set by the row length alone: rows up to 32768 use Triton's tl.sum tree
    over one [next_pow2(n)] block; longer rows add chunk by chunk (8192 lanes, ascending
    chunks) and then tl.sum over the lanes. max is exact in any order.
    """
    return _launch(x, log=True)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """e = exp(x - max(x)); out = e / sum(e) (IEEE division); the sum as in log_softmax."""
    return _launch(x, log=False)
