"""Byte parity: the only equality Lockstep asserts (its test assertion and the one-ulp nudge
that tests it are in ``testing``).

Every byte comparison lives here (``k3`` builds its report on these): tensors are compared
through their raw bits as integers of the element width, so -0.0 and +0.0 differ and NaN
payloads are compared, never by value. Distances in units in the last place go through
``ordered_bits``, which maps float bits to integers in float order, one step per ulp.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = [
    "bytes_sha256",
    "first_difference",
    "ordered_bits",
    "ordered_int32",
    "raw_bits",
    "same_bytes",
    "same_bytes_mask",
    "ulp_distance",
    "ulp_distances",
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element width (so -0.0 != +0.0, NaNs compared)."""
    return t.detach().contiguous().view(_INT_VIEW[t.element_size()])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bits(a), raw_bits(b))


def same_bytes_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: identical bytes. Tensors of different dtypes never share bytes (all
    False); the shapes must match."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        return torch.zeros(a.shape, dtype=torch.bool)
    return raw_bits(a) == raw_bits(b)


def bytes_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ, or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    diff = (raw_bits(a) != raw_bits(b)).nonzero()
    return None if diff.numel() == 0 else tuple(int(i) for i in diff[0])


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as int64 keys whose order is the float order, one step per ulp (any float
    width up to 32 bits). +0.0 and -0.0 both map to 0; NaNs map beyond the infinities."""
    bits = raw_bits(t).to(torch.int64)
    width = t.element_size() * 8
    sign = 1 << (width - 1)
    bits = bits & ((1 << width) - 1)
    return torch.where(bits >= sign, sign - bits, bits)


def ordered_int32(x: torch.Tensor) -> torch.Tensor:
    """``ordered_bits`` for float32 only (log-probabilities): refuses any other dtype."""
    if x.dtype != torch.float32:
        raise TypeError(f"ordered_int32 needs float32, got {x.dtype}")
    return ordered_bits(x)


def ulp_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element number of float steps between ``a`` and ``b`` (flattened, int64)."""
    return (ordered_bits(a.reshape(-1)) - ordered_bits(b.reshape(-1))).abs()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between matching elements."""
    if a.numel() == 0:
        return 0
    return int(ulp_distances(a, b).max())
