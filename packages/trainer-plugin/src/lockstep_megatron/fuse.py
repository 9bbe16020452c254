"""A Megatron module's (fused) weight from the HF projections, by the column layout the module
declares (``ExactLinear.parts``), and the conversion's error; ``convert`` (Qwen3, Qwen3-MoE)
and ``gdn.convert`` (Qwen3-Next) build every fused weight with it.
"""

from __future__ import annotations

import torch

from lockstep_exact.layout import shard_weight


class ConversionError(ValueError):
    """The HF checkpoint does not fill the Megatron model exactly (missing, extra, dtype)."""


def _fuse(linear, hf: dict[str, torch.Tensor], prefix: str, used: set[str], rank=0, tp=1):
    """The module's (fused) weight from the HF projections; under tensor parallelism this
    rank's shard of each (``layout.shard_weight``: column sites by rows, row sites by K)."""
    fused = torch.empty_like(linear.weight)
    for part, cols in linear.parts.items():
        key = f"{prefix}{part}.weight"
        if key not in hf:
            raise ConversionError(f"missing HF weight {key}")
        fused[cols] = shard_weight(key, hf[key], rank, tp)
        used.add(key)
    return fused
