"""IEEE-exact building blocks of the cpu backend.

Everything here is made of operations whose result IEEE 754 defines to the last bit
(+, -, *, /, sqrt, comparisons, min/max, round-to-integer, integer bit operations), applied
element by element, and of reductions whose tree is fixed by the length alone. So the bytes
of every result are the same on any x86 CPU, at any thread count, and for any batch a row
sits in. Library transcendentals (torch.exp, torch.log, torch.sin) are not used: their vector
and scalar paths differ in the last ulp. Nor is torch's float32 sqrt, which on CPU is MKL's
and not IEEE: the square root is ``sqrt_rn``.
"""

from __future__ import annotations

import torch

F32 = torch.float32
F64 = torch.float64
BF16 = torch.bfloat16


def require(cond: bool, message: str) -> None:
    """Fail closed: a program never silently runs on input it does not define."""
    if not cond:
        raise ValueError(message)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest, ties to even; every NaN becomes 0x7FC0.

    Written with integer operations so the rounding point is explicit and cannot depend on
    which conversion path a library takes (vector, scalar, or a DAZ instruction).
    """
    require(x.dtype == F32, f"round_bf16 takes float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    # int32 cannot overflow here except for NaN patterns, which are replaced below; the
    # arithmetic shift leaves the signed upper half, which fits int16 exactly.
    upper = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).to(torch.int16)
    upper = torch.where(torch.isnan(x), torch.full_like(upper, 0x7FC0), upper)
    return upper.view(BF16)


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """Widening to fp32 is exact for bf16, fp16 and fp32."""
    require(x.dtype in (BF16, torch.float16, F32), f"expected a float tensor, got {x.dtype}")
    return x.to(F32)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along ``dim`` over the balanced adjacent-pair tree.

    The length is padded with +0.0 up to the next power of two; level by level, element 2i is
    added to element 2i+1. The tree depends on the length only, never on the data or the batch.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    require(n >= 1, "tree_sum over an empty dimension")
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n), value=0.0)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """IEEE sqrt of float32 (round to nearest, ties to even), whatever torch's sqrt does.

    torch's own float32 sqrt on CPU is not correctly rounded: it goes through MKL's vector
    math, which on the AVX2 build here is one ulp off in about 19% of random inputs, and gives
    other bytes on other CPUs (found 2026-12-01: the GPU host's CPU and this one disagreed on
    gdn.l2norm). So: r = fp32(sqrt(fp64(x))), within an ulp of the answer on any library,
    then corrected twice against the midpoints m between r and its neighbours, comparing x
    with m*m in fp64 (m has at most 25 significant bits, m*m at most 50: both exact). The
    correctly rounded result is the r with m_below**2 < x < m_above**2 (no x is a tie: a
    midpoint's square is never a float32). sqrt(+-0) = +-0, sqrt(+inf) = +inf, sqrt(x < 0) and
    sqrt(NaN) are NaN.
    """
    require(x.dtype == F32, f"sqrt_rn takes float32, got {x.dtype}")
    xd = x.to(F64)
    ok = (x > 0) & torch.isfinite(x)
    r = torch.where(ok, torch.sqrt(torch.where(ok, xd, torch.ones_like(xd))), torch.ones_like(xd))
    r = r.to(F32)
    inf = torch.full_like(r, float("inf"))
    for _ in range(2):
        up = torch.nextafter(r, inf)
        down = torch.nextafter(r, torch.zeros_like(r))
        rd = r.to(F64)
        above = (rd + up.to(F64)) * 0.5
        below = (rd + down.to(F64)) * 0.5
        r = torch.where(xd > above * above, up, torch.where(xd < below * below, down, r))
    out = torch.where(ok, r, torch.full_like(r, float("nan")))
    out = torch.where(x == 0, x, out)
    return torch.where((x > 0) & torch.isinf(x), x, out)


def pow2(n: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """2**n built from exponent bits (exact), for n inside the normal exponent range."""
    if dtype == F32:
        return ((n.to(torch.int32) + 127) << 23).view(F32)
    require(dtype == F64, f"pow2 supports float32 and float64, not {dtype}")
    return ((n.to(torch.int64) + 1023) << 52).view(F64)


def ldexp(y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """y * 2**n in two exact power-of-two steps, so n may reach twice the exponent range."""
    n = n.to(torch.int64)
    half = torch.div(n, 2, rounding_mode="floor")
    return (y * pow2(half, y.dtype)) * pow2(n - half, y.dtype)


def horner(x: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """((c0*x + c1)*x + c2)... with a separate rounding after every * and + (no FMA)."""
    acc = torch.full_like(x, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x
        acc = acc + c
    return acc


# --- exp ----------------------------------------------------------------------------------
# Cody-Waite reduction x = n*ln2 + r, |r| <= ln2/2, then a fixed polynomial for e**r.
_LN2_HI_F32 = 0.693359375  # few mantissa bits: n * hi is exact
_LN2_LO_F32 = -2.12194440e-4
_LOG2E = 1.44269504088896341
_EXP_F32_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_EXP_F32_MAX = 88.72283172607421875  # largest x whose exp is finite in fp32
_EXP_F32_MIN = -103.97208404541015625  # below this, exp rounds to zero in fp32

_LN2_HI_F64 = 6.93147180369123816490e-01  # fdlibm ln2_hi: n * hi exact for |n| < 2**20
_LN2_LO_F64 = 1.90821492927058770002e-10
_INV_FACT = tuple(1.0 / __import__("math").factorial(k) for k in range(14, -1, -1))


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x for float32 (a few ulp) or float64 (about 1 ulp)."""
    if x.dtype == F64:
        return _exp_f64(x)
    require(x.dtype == F32, f"exp takes float32 or float64, got {x.dtype}")
    xc = x.clamp(_EXP_F32_MIN, _EXP_F32_MAX)
    n = torch.round(xc * _LOG2E)
    r = xc - n * _LN2_HI_F32
    r = r - n * _LN2_LO_F32
    z = r * r
    y = horner(r, _EXP_F32_POLY) * z
    y = (y + r) + 1.0
    out = ldexp(y, n)
    out = torch.where(x > _EXP_F32_MAX, torch.full_like(out, float("inf")), out)
    out = torch.where(x < _EXP_F32_MIN, torch.zeros_like(out), out)
    return torch.where(torch.isnan(x), x, out)


def _exp_f64(x: torch.Tensor) -> torch.Tensor:
    xc = x.clamp(-745.2, 709.78)
    n = torch.round(xc * _LOG2E)
    r = (xc - n * _LN2_HI_F64) - n * _LN2_LO_F64
    y = horner(r, _INV_FACT)
    out = ldexp(y, n)
    out = torch.where(x > 709.782712893384, torch.full_like(out, float("inf")), out)
    out = torch.where(x < -745.2, torch.zeros_like(out), out)
    return torch.where(torch.isnan(x), x, out)


# --- log ----------------------------------------------------------------------------------
_SQRT_HALF = 0.70710678118654752440
_LOG_F32_POLY = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)


def _frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = m * 2**e with m in [0.5, 1), from the bits; x must be positive and finite."""
    if x.dtype == F32:
        tiny = x < 1.1754943508222875e-38
        xs = torch.where(tiny, x * 8388608.0, x)  # 2**23: subnormals become normal, exactly
        bits = xs.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 126
        # 0x807FFFFF (sign and mantissa) written as the int32 it is, -0x7F800001: a Python int
        # beyond int32 would leave its conversion to the backend's scalar path.
        m = ((bits & -0x7F800001) | 0x3F000000).view(F32)
        return m, (e - torch.where(tiny, 23, 0)).to(F32)
    tiny = x < 2.2250738585072014e-308
    xs = torch.where(tiny, x * 4503599627370496.0, x)  # 2**52
    bits = xs.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1022
    m = ((bits & ~(0x7FF << 52)) | (1022 << 52)).view(F64)
    return m, (e - torch.where(tiny, 52, 0)).to(F64)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log for float32 (a few ulp) or float64 (about 1 ulp)."""
    require(x.dtype in (F32, F64), f"log takes float32 or float64, got {x.dtype}")
    finite_pos = (x > 0) & torch.isfinite(x)
    safe = torch.where(finite_pos, x, torch.ones_like(x))
    m, e = _frexp(safe)
    low = m < _SQRT_HALF
    e = torch.where(low, e - 1.0, e)
    f = torch.where(low, (m + m) - 1.0, m - 1.0)
    if x.dtype == F32:
        z = f * f
        y = (horner(f, _LOG_F32_POLY) * f) * z
        y = y + e * _LN2_LO_F32
        y = y + (z * -0.5)
        out = f + y
        out = out + e * _LN2_HI_F32
    else:
        # log(1+f) = 2 atanh(s), s = f / (2 + f); odd series to s**27.
        s = f / (f + 2.0)
        s2 = s * s
        series = horner(s2, tuple(1.0 / k for k in range(27, 0, -2)))
        out = (s * series) * 2.0
        out = out + e * _LN2_LO_F64
        out = out + e * _LN2_HI_F64
    out = torch.where(x == 0, torch.full_like(out, float("-inf")), out)
    out = torch.where(x < 0, torch.full_like(out, float("nan")), out)
    out = torch.where(torch.isposinf(x), x, out)
    return torch.where(torch.isnan(x), x, out)


# --- sin / cos (float64, for tables) -----------------------------------------------------
# fdlibm's three-part pi/2: k * PIO2_1 and k * PIO2_2 are exact for k < 2**20.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_POLY = tuple(((-1) ** k) / __import__("math").factorial(2 * k + 1) for k in range(10, -1, -1))
_COS_POLY = tuple(((-1) ** k) / __import__("math").factorial(2 * k) for k in range(10, -1, -1))


def sincos_f64(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of float64 angles in [0, 2**20 * pi/2), to about 1 ulp of float64."""
    require(theta.dtype == F64, f"sincos_f64 takes float64, got {theta.dtype}")
    require(
        bool((theta >= 0).all()) and bool((theta < 1.6e6).all()),
        "sincos_f64 is defined for angles in [0, 1.6e6)",
    )
    k = torch.round(theta * _TWO_OVER_PI)
    r = ((theta - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = horner(r2, _SIN_POLY) * r
    c = horner(r2, _COS_POLY)
    q = k.to(torch.int64) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos
