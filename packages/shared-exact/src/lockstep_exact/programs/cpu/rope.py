"""rope.neox: rotate-half rotary embedding with tables computed without library sin/cos."""

from __future__ import annotations

from functools import lru_cache

import torch

from .arith import BF16, F32, F64, as_f32, exp, log, require, round_bf16, sincos_f64


@lru_cache(maxsize=16)
def _tables(base: float, dim: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    # inv_freq_i = base ** (-2i/dim) = exp(-(2i/dim) * log(base)), all float64, then
    # theta = pos * inv_freq (float64), sin/cos in float64, one rounding to float32.
    i2 = torch.arange(0, dim, 2, dtype=F64)
    inv_freq = exp(-(i2 / float(dim)) * log(torch.tensor([float(base)], dtype=F64)))
    pos = torch.arange(n_pos, dtype=F64)
    sin, cos = sincos_f64(pos[:, None] * inv_freq[None, :])
    return cos.to(F32), sin.to(F32)


def rope_tables(base: float, dim: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 tables [n_pos, dim/2]; row p depends only on (base, dim, p)."""
    require(dim % 2 == 0, f"rope: head dim must be even, got {dim}")
    # Grow in powers of two so every caller shares one table per (base, dim).
    n = 1 << max(10, (int(n_pos) - 1).bit_length())
    return _tables(float(base), int(dim), n)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [T, H, D] bf16 at absolute positions [T]; rotate-half (NeoX/Qwen3) convention.

    out1 = bf16(x1*cos - x2*sin), out2 = bf16(x2*cos + x1*sin), fp32 in between, each * and
    +/- rounded separately.
    """
    require(x.dtype == BF16, "rope: bf16 input required")
    require(x.dim() == 3 and positions.shape == (x.shape[0],), "rope: x [T, H, D], positions [T]")
    require(len(positions) == 0 or int(positions.min()) >= 0, "rope: negative position")
    half = x.shape[-1] // 2
    cos_t, sin_t = rope_tables(
        base, x.shape[-1], int(positions.max().item()) + 1 if len(positions) else 1
    )
    cos = cos_t[positions][:, None, :]
    sin = sin_t[positions][:, None, :]
    xf = as_f32(x)
    x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return round_bf16(torch.cat([o1, o2], dim=-1))


def rope_partial(x: torch.Tensor, positions: torch.Tensor, base: float, rotary: int):
    """rope.partial: rope.neox on the first ``rotary`` dims of each head (its tables built for
    dim = ``rotary``), the other D - rotary dims copied unchanged (Qwen3-Next's
    partial_rotary_factor). The rotated part has the bytes of rope.neox on a head of ``rotary``
    dims."""
    return rotate_first(rope, x, positions, base, rotary)


def rotate_first(rope_fn, x: torch.Tensor, positions: torch.Tensor, base: float, rotary: int):
    """rope.partial on a backend: its ``rope_fn`` on the first ``rotary`` dims, the rest
    copied (shared by the cpu and cuda backends)."""
    require(x.dtype == BF16, "rope.partial: bf16 input required")
    require(x.dim() == 3, "rope.partial: x [T, H, D]")
    require(
        2 <= rotary <= x.shape[-1] and rotary % 2 == 0,
        f"rope.partial: rotary dims {rotary} must be even and within the head dim {x.shape[-1]}",
    )
    rot = rope_fn(x[..., :rotary].contiguous(), positions, base)
    return torch.cat([rot, x[..., rotary:]], dim=-1)
