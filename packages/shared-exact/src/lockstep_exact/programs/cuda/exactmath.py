"""The cpu backend's fp32 arithmetic helpers as Triton functions, operation for operation.

The hybrid lane's programs are written once, from the helpers of ``programs/cpu/arith.py``,
``activation.py`` and ``gdn.py`` (exp and log from a polynomial and exponent bits, the bit-trick
bf16 rounding, IEEE division and sqrt, adjacent-pair trees). The cuda kernels of those programs
call the functions here, which perform the same operations in the same order, so a kernel's
bytes are the cpu program's. Kernels that use them launch with ``EXACT`` (no contraction of a
``*`` and a ``+`` into one rounding). ``tests/test_interpret.py`` checks each against its cpu
helper in Triton's interpreter; the GPU suite checks the kernels on the device.

bf16 crosses a kernel's boundary as its bits (int16): ``widen`` and ``round_bf16`` are the
exact integer forms, so no conversion instruction's rounding or NaN rule enters.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..cpu import arith as _cpu

# 1.5 * 2**23: for |t| < 2**22, (t + RINT) - RINT is t rounded to the nearest integer, ties to
# even (torch.round's rule), in two IEEE adds.
_RINT = tl.constexpr(12582912.0)
_MIN, _MAX = tl.constexpr(_cpu._EXP_F32_MIN), tl.constexpr(_cpu._EXP_F32_MAX)
INF = _INF = tl.constexpr(float("inf"))
# No NaN constant: Triton checks that a global a kernel read keeps its value by comparing it,
# and a NaN never equals itself (a second kernel reading it fails to compile). ``nan_like``
# makes the quiet NaN 0x7FC00000 (torch's) from its bits instead.
_QNAN_BITS = tl.constexpr(0x7FC00000)
_LOG2E = tl.constexpr(_cpu._LOG2E)
_HI, _LO = tl.constexpr(_cpu._LN2_HI_F32), tl.constexpr(_cpu._LN2_LO_F32)
_P0, _P1, _P2, _P3, _P4, _P5 = (tl.constexpr(c) for c in _cpu._EXP_F32_POLY)
_L0, _L1, _L2, _L3, _L4, _L5, _L6, _L7, _L8 = (tl.constexpr(c) for c in _cpu._LOG_F32_POLY)
_SQRT_HALF = tl.constexpr(_cpu._SQRT_HALF)
_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal fp32


@triton.jit
def nan_like(x):
    """A tensor of x's shape holding the quiet NaN 0x7FC00000."""
    return tl.full(x.shape, _QNAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def neg(x):
    """-x as torch negates: the sign bit flipped (Triton's unary minus is 0 - x, which makes
    +0 of +0)."""
    return (x.to(tl.int32, bitcast=True) ^ -0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """``cpu.arith.exp`` (fp32)."""
    xc = tl.where(x < _MIN, _MIN, tl.where(x > _MAX, _MAX, x))
    n = ((xc * _LOG2E) + _RINT) - _RINT
    r = xc - n * _HI
    r = r - n * _LO
    z = r * r
    acc = r * _P0 + _P1  # horner: c0 * r + c1, ...
    acc = acc * r + _P2
    acc = acc * r + _P3
    acc = acc * r + _P4
    acc = acc * r + _P5
    y = acc * z
    y = (y + r) + 1.0
    ni = n.to(tl.int32)
    half = ni >> 1  # floor(n / 2)
    p1 = ((half + 127) << 23).to(tl.float32, bitcast=True)
    p2 = ((ni - half + 127) << 23).to(tl.float32, bitcast=True)
    out = (y * p1) * p2
    out = tl.where(x > _MAX, _INF, out)
    out = tl.where(x < _MIN, 0.0, out)
    return tl.where(x != x, x, out)


@triton.jit
def log(x):
    """``cpu.arith.log`` (fp32)."""
    finite_pos = (x > 0.0) & (x < _INF)
    safe = tl.where(finite_pos, x, 1.0)
    # frexp: safe = m * 2**e, m in [0.5, 1), subnormals scaled by 2**23 first
    tiny = safe < _TINY
    xs = tl.where(tiny, safe * 8388608.0, safe)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126
    m = ((bits & -0x7F800001) | 0x3F000000).to(tl.float32, bitcast=True)
    e = (e - tl.where(tiny, 23, 0)).to(tl.float32)
    low = m < _SQRT_HALF
    e = tl.where(low, e - 1.0, e)
    f = tl.where(low, (m + m) - 1.0, m - 1.0)
    z = f * f
    acc = f * _L0 + _L1  # horner over the log polynomial
    acc = acc * f + _L2
    acc = acc * f + _L3
    acc = acc * f + _L4
    acc = acc * f + _L5
    acc = acc * f + _L6
    acc = acc * f + _L7
    acc = acc * f + _L8
    y = (acc * f) * z
    y = y + e * _LO
    y = y + (z * -0.5)
    out = f + y
    out = out + e * _HI
    out = tl.where(x == 0.0, -_INF, out)
    out = tl.where(x < 0.0, nan_like(x), out)
    out = tl.where(x == _INF, x, out)
    return tl.where(x != x, x, out)


@triton.jit
def silu(x):
    """``cpu.activation.silu``: x / (1 + exp(-x)), IEEE division."""
    return tl.math.div_rn(x, exp(neg(x)) + 1.0)


@triton.jit
def sigmoid(x):
    """``cpu.gdn.sigmoid``: 1 / (exp(-x) + 1)."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), exp(neg(x)) + 1.0)


@triton.jit
def log1p_small(e):
    """``cpu.gdn.log1p_small``."""
    u = e + 1.0
    den = u - 1.0
    safe = tl.where(den == 0.0, 1.0, den)
    return tl.where(den == 0.0, e, log(u) * tl.math.div_rn(e, safe))


@triton.jit
def softplus(x):
    """``cpu.gdn.softplus``: max(x, 0) + log1p(exp(-|x|)) (torch.clamp's NaN: kept)."""
    pos = tl.where(x != x, x, tl.where(x < 0.0, 0.0, x))
    return pos + log1p_small(exp(neg(tl.abs(x))))


@triton.jit
def widen(bits16):
    """bf16 bits (int16) -> fp32, exactly."""
    return (bits16.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """``cpu.arith.round_bf16``: fp32 -> bf16 bits (int16), to nearest, ties to even; every NaN
    becomes 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    upper = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    upper = tl.where(x != x, 0x7FC0, upper)
    return upper.to(tl.int16)


@triton.jit
def tree_cols(x, R: tl.constexpr, N: tl.constexpr, LOG: tl.constexpr):
    """[R, N] -> [R]: ``tree_sum`` along the last axis (N = 2**LOG, padded with +0)."""
    for lvl in tl.static_range(LOG):
        a, b = tl.split(tl.reshape(x, (R, N >> (lvl + 1), 2)))
        x = a + b
    return tl.reshape(x, (R,))


@triton.jit
def tree_rows(x, N: tl.constexpr, B: tl.constexpr, LOG: tl.constexpr):
    """[N, B] -> [B]: ``tree_sum`` along the first axis (N = 2**LOG, padded with +0)."""
    for lvl in tl.static_range(LOG):
        y = tl.permute(tl.reshape(x, (N >> (lvl + 1), 2, B)), (0, 2, 1))
        a, b = tl.split(y)
        x = a + b
    return tl.reshape(x, (B,))


__all__ = [
    "exp",
    "log",
    "log1p_small",
    "nan_like",
    "neg",
    "round_bf16",
    "sigmoid",
    "silu",
    "softplus",
    "tree_cols",
    "tree_rows",
    "widen",
]
