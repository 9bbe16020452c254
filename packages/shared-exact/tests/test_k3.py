"""K3 and the byte-level comparison: zero for equal bytes, and every check sees one ulp."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep_exact.k3 import Comparison, compare, k3
from lockstep_exact.parity import (
    ordered_int32,
    same_bytes_mask,
    ulp_distance,
    ulp_distances,
)


def _logprobs(n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, 50, generator=g), -1)[:, 0].contiguous()


def _ulp(t: torch.Tensor, i: int, steps: int = 1) -> torch.Tensor:
    """``t`` with element ``i`` moved ``steps`` ulps away from zero (bit pattern + steps)."""
    out = t.clone()
    out.view(torch.int32)[i] += steps
    return out


def test_k3_is_exactly_zero_for_equal_bytes():
    lp = _logprobs()
    out = k3(lp, lp.clone())
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.zeros_like(out))
    assert (out.view(torch.int64) == 0).all()  # +0.0, not -0.0
    # Negative control: one ulp on one decision makes exactly that K3 positive.
    moved = k3(lp, _ulp(lp, 7))
    assert moved[7] > 0
    assert torch.count_nonzero(moved) == 1


def test_k3_is_positive_for_a_one_ulp_change_at_every_scale():
    values = torch.tensor(
        [-1e-30, -1e-10, -1e-6, -0.01, -0.5, -1.0, -7.0, -30.0, -1e4], dtype=torch.float32
    )
    for i in range(values.numel()):
        assert k3(values, _ulp(values, i))[i] > 0, values[i].item()
        assert k3(_ulp(values, i), values)[i] > 0, values[i].item()
    smallest = torch.tensor([0.0, -0.0], dtype=torch.float32)
    tiny = smallest.clone()
    tiny.view(torch.int32)[0] = 1  # 2^-149, the smallest float32 step
    assert k3(smallest, tiny)[0] > 0


def test_k3_matches_the_definition_in_float64():
    sampler = torch.tensor([-1.0, -2.0, -0.25, -3.0], dtype=torch.float32)
    trainer = torch.tensor([-1.5, -1.0, -0.2500001, -3.0], dtype=torch.float32)
    got = k3(sampler, trainer)
    for s, t, k in zip(sampler.tolist(), trainer.tolist(), got.tolist(), strict=True):
        r = t - s
        want = math.expm1(r) - r
        assert k == pytest.approx(want, rel=1e-9, abs=0.0)
        assert k >= 0
    # The Taylor branch agrees with the definition where both are accurate.
    r = torch.tensor([2.0**-10 * 0.999, -(2.0**-10) * 0.999], dtype=torch.float64)
    z = torch.zeros(2, dtype=torch.float64)
    assert torch.allclose(k3(z, r), torch.expm1(r) - r, rtol=1e-9, atol=0)


def test_k3_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="3 log-probs, trainer has 2"):
        k3(torch.zeros(3), torch.zeros(2))


def test_compare_counts_byte_equal_decisions():
    lp = _logprobs()
    cmp = compare(lp, lp.clone())
    assert cmp == Comparison(64, 64, None, 0.0, 0.0, 0)
    assert cmp.exact


def test_compare_detects_a_one_ulp_change():
    lp = _logprobs()
    cmp = compare(lp, _ulp(lp, 41))
    assert not cmp.exact
    assert cmp.byte_equal == 63 and cmp.first_diff == 41
    assert cmp.max_ulp == 1
    assert cmp.k3_max > 0 and cmp.k3_mean == pytest.approx(cmp.k3_max / 64, rel=1e-12)


def test_compare_reports_the_first_difference_and_the_largest_ulp_distance():
    lp = _logprobs()
    trainer = _ulp(_ulp(lp, 50, 3), 9, -2)
    cmp = compare(lp, trainer)
    assert cmp.first_diff == 9 and cmp.byte_equal == 62 and cmp.max_ulp == 3


def test_compare_counts_minus_zero_vs_plus_zero_as_different():
    a = torch.tensor([-0.0, -1.0], dtype=torch.float32)
    b = torch.tensor([0.0, -1.0], dtype=torch.float32)
    cmp = compare(a, b)
    assert cmp.byte_equal == 1 and cmp.first_diff == 0
    assert cmp.max_ulp == 0  # the same value: zero ulps apart ...
    assert cmp.k3_max == 0.0  # ... and zero K3, but not the same bytes


def test_compare_counts_different_nan_payloads_as_different():
    a = torch.tensor([float("nan"), -1.0], dtype=torch.float32)
    b = a.clone()
    assert compare(a, b).byte_equal == 2  # identical NaN bytes are equal bytes
    b.view(torch.int32)[0] ^= 1  # another NaN payload
    assert torch.isnan(b[0])
    cmp = compare(a, b)
    assert cmp.byte_equal == 1 and cmp.first_diff == 0


def test_compare_needs_float32_raw_bytes():
    with pytest.raises(TypeError, match="float32"):
        compare(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32"):
        compare(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))


def test_compare_of_nothing_is_exact_and_empty():
    cmp = compare(torch.zeros(0), torch.zeros(0))
    assert cmp.n == 0 and cmp.exact and cmp.first_diff is None


def test_ulp_distance_counts_float32_steps_across_zero():
    one = torch.tensor([1.0], dtype=torch.float32)
    assert ulp_distances(one, torch.nextafter(one, torch.tensor([2.0]))).item() == 1
    pos = torch.tensor([0.0], dtype=torch.float32)
    neg_min = torch.tensor([0], dtype=torch.int32).view(torch.float32).clone()
    neg_min.view(torch.int32)[0] = -(2**31) + 1  # -2^-149
    pos_min = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # +2^-149
    assert ulp_distances(neg_min, pos_min).item() == 2
    assert ulp_distances(pos, -pos).item() == 0
    keys = ordered_int32(torch.tensor([-2.0, -1.0, -0.0, 0.0, 1e-30, 1.0]))
    assert torch.all(keys[1:] >= keys[:-1])


def test_one_byte_comparison_serves_k3_and_the_parity_helpers():
    a = torch.tensor([1.0, -0.0, 3.0], dtype=torch.float32)
    b = a.clone()
    b.view(torch.int32)[2] += 5
    assert same_bytes_mask(a, b).tolist() == [True, True, False]
    assert same_bytes_mask(a, a.to(torch.float64)).tolist() == [False] * 3  # other dtype
    assert same_bytes_mask(a, torch.tensor([1.0, 0.0, 3.0])).tolist() == [True, False, True]
    assert ulp_distances(a, b).tolist() == [0, 0, 5] and ulp_distance(a, b) == 5
    assert compare(a, b).max_ulp == 5
    with pytest.raises(TypeError, match="ordered_int32 needs float32, got torch.bfloat16"):
        ordered_int32(a.to(torch.bfloat16))
