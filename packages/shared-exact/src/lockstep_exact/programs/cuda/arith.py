"""Shared pieces of the cuda backend: checks, the bf16 rounding, the launch options."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.arith import BF16, F32, require
from .exactmath import round_bf16 as _round_bits

# Every kernel except the matrix products is compiled with floating-point contraction off, so
# each * and + rounds on its own, as the programs' docstrings say (no fused multiply-add).
EXACT = {"enable_fp_fusion": False}
INDEX_DTYPES = (torch.int32, torch.int64)
# trap_if's instruction: stop the kernel where the operand is nonzero, else write 0 (also the
# Hopper prefill's, which is Gluon and calls it as gl.inline_asm_elementwise)
TRAP_ASM = tl.constexpr(
    "{ .reg .pred %lsbad; setp.ne.s32 %lsbad, $1, 0; @%lsbad trap; mov.u32 $0, 0; }"
)


@triton.jit
def trap_if(bad):
    """Stop the kernel (a CUDA error on the host, as a failed device assertion) on any lane
    where ``bad``: a device-side check of indices (positions) without the several small
    kernels a torch-side check launches before every call. Returns zeros to be added to a value
    the kernel uses, so the check cannot be dropped as dead code."""
    return tl.inline_asm_elementwise(
        TRAP_ASM,
        "=r,r",
        [bad.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def index_tensor(positions: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``positions`` on ``device`` as int32 or int64, read in place when it already is one of
    them (a kernel takes its stride); float, complex or bool indices are refused."""
    require(
        not (
            positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool
        ),
        f"{what}: integer positions required, got {positions.dtype}",
    )
    pos = positions.to(device=device)
    return pos if pos.dtype in INDEX_DTYPES else pos.to(torch.int64)


def bits16(x: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor's bits, contiguous (int16): what the elementwise kernels read and write."""
    return x.contiguous().view(torch.int16)


def require_cuda(*tensors: torch.Tensor) -> None:
    for t in tensors:
        require(t.is_cuda, f"cuda backend: tensor on {t.device}, expected a CUDA device")


@triton.jit(do_not_specialize=["n"])
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, _round_bits(x), mask=ok)


ROUND_BLOCK = 1024


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest, ties to even; every NaN becomes 0x7FC0: the cpu
    program's integer formula (``exactmath.round_bf16``), one launch."""
    require_cuda(x)
    return rounded(x)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """``round_bf16``'s launch on x's device (Triton's interpreter runs it on cpu tensors)."""
    require(x.dtype == F32, f"round_bf16 takes float32, got {x.dtype}")
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=torch.int16, device=x.device)
    if xc.numel():
        _round_kernel[(triton.cdiv(xc.numel(), ROUND_BLOCK),)](
            xc, y, xc.numel(), BLOCK=ROUND_BLOCK, num_warps=4, **EXACT
        )
    return y.view(BF16)


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """Widening to fp32 is exact for bf16, fp16 and fp32."""
    require(x.dtype in (BF16, torch.float16, F32), f"expected a float tensor, got {x.dtype}")
    return x.to(F32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


__all__ = [
    "BF16",
    "EXACT",
    "F32",
    "INDEX_DTYPES",
    "index_tensor",
    "trap_if",
    "as_f32",
    "next_pow2",
    "require",
    "require_cuda",
    "round_bf16",
]
