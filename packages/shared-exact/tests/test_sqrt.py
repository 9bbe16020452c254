"""arith.sqrt_rn: the cpu backend's square root is IEEE round-to-nearest-even.

torch's own float32 sqrt on CPU is not (MKL's vector math: one ulp off for about a fifth of
random inputs on the AVX2 build used here, other bytes on other CPUs), so every program that
takes a square root goes through ``sqrt_rn``. The reference here is exact rational arithmetic
and numpy's float32 sqrt (an IEEE operation), on random bit patterns and the edges.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep_exact.parity import same_bytes
from lockstep_exact.programs.cpu import arith
from lockstep_exact.testing import assert_same_bytes, nudge_ulp

F32 = torch.float32
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, -1.0, 1e-45, -1e-45, 1.17549421e-38,
         1.17549435e-38, 3.4028235e38, 1.0, 2.0, 4.0, 128.0, 0.5, 19.0, 768.22277]  # fmt: skip


def _numpy_sqrt(x: torch.Tensor) -> torch.Tensor:
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x.numpy()))


def _canonical(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), torch.full_like(t, math.nan), t)


def test_sqrt_rn_is_the_ieee_square_root_on_random_bit_patterns_and_edges():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(F32), torch.tensor(EDGES, dtype=F32)])
    x = torch.cat([x, torch.rand(1 << 16, generator=gen) * 1000])  # ordinary norms' range
    got = arith.sqrt_rn(x)
    assert_same_bytes(_canonical(got), _canonical(_numpy_sqrt(x)), "sqrt_rn vs IEEE sqrt")
    # signed zeros keep their sign
    assert same_bytes(arith.sqrt_rn(torch.tensor([-0.0])), torch.tensor([-0.0]))
    # input control: 0.5 one ulp up (its root moves by 0.7 of the root's ulp) parts from the
    # IEEE root of 0.5
    half = torch.tensor([0.5], dtype=F32)
    assert not same_bytes(arith.sqrt_rn(nudge_ulp(half)), _numpy_sqrt(half))


@pytest.mark.parametrize("value", [768.2227783203125, 19.0, 2.5, 1e-40, 3.0e38])
def test_sqrt_rn_is_the_nearest_float32_by_exact_arithmetic(value):
    """No float32 next to the result is nearer the real square root (checked on squares with
    fractions, so the reference is not a library's sqrt either)."""
    x = torch.tensor([value], dtype=F32)
    r = arith.sqrt_rn(x)
    xv = Fraction(float(x[0]))
    err = abs(Fraction(float(r[0])) ** 2 - xv)
    for n in (nudge_ulp(r, 0, 1), nudge_ulp(r, 0, -1)):
        assert abs(Fraction(float(n[0])) ** 2 - xv) > err


def test_no_cpu_program_calls_a_library_sqrt():
    """Every square root of the cpu programs goes through sqrt_rn (torch.sqrt of float32 is
    not IEEE on CPU; rsqrt never is)."""
    src = Path(arith.__file__).parent
    offenders = []
    for path in sorted(src.glob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"torch\.(sqrt|rsqrt)\(|\.(sqrt|rsqrt)\(\)|math\.sqrt\(", code):
                offenders.append(f"{path.name}:{no}: {line.strip()}")
    # sqrt_rn itself starts from a float64 library sqrt and corrects it exactly
    allowed = f"arith.py:{_line('r = torch.where(ok, torch.sqrt(')}:"
    assert [o for o in offenders if not o.startswith(allowed)] == [], offenders
    assert len(offenders) == 1, offenders


def _line(prefix: str) -> int:
    lines = Path(arith.__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith(prefix))
