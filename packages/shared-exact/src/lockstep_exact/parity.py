"""Byte parity: the only equality Lockstep asserts, and the one-ulp nudge that tests it."""

from __future__ import annotations

import hashlib

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element width (so -0.0 != +0.0, NaNs compared)."""
    return t.detach().contiguous().view(_INT_VIEW[t.element_size()])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bits(a), raw_bits(b))


def bytes_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ, or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    diff = (raw_bits(a) != raw_bits(b)).nonzero()
    return None if diff.numel() == 0 else tuple(int(i) for i in diff[0])


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    where = first_difference(a, b)
    if where is not None:
        n = int((raw_bits(a) != raw_bits(b)).sum())
        raise AssertionError(
            f"{what}: {n} element(s) differ in bytes; first at {where}: {a[where].item()!r} vs "
            f"{b[where].item()!r} ({ulp_distance(a[where], b[where])} ulp)"
        )


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Map float bits to integers whose order is the float order (for ulp distances)."""
    bits = raw_bits(t).to(torch.int64)
    width = t.element_size() * 8
    sign = 1 << (width - 1)
    bits = bits & ((1 << width) - 1)
    return torch.where(bits >= sign, sign - bits, bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between matching elements."""
    if a.numel() == 0:
        return 0
    return int((_ordered(a) - _ordered(b)).abs().max())


def nudge_ulp(t: torch.Tensor, index: int = 0, ulps: int = 1) -> torch.Tensor:
    """A copy of ``t`` with one element moved by ``ulps`` units in the last place."""
    out = t.detach().clone().contiguous()
    bits = raw_bits(out).view(-1)
    bits[index] = bits[index] + ulps
    return out
