"""softmax and log_softmax over a fixed tree, fp32."""

from __future__ import annotations

import torch

from .arith import F32, exp, log, require, tree_sum


def _shifted(x: torch.Tensor) -> torch.Tensor:
    require(x.dtype == F32, f"softmax programs take float32, got {x.dtype}")
    return x - x.amax(dim=-1, keepdim=True)  # max is exact in any order


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """s = x - max(x); out = s - log(tree_sum(exp(s)))."""
    s = _shifted(x)
    return s - log(tree_sum(exp(s)))[..., None]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """e = exp(x - max(x)); out = e / tree_sum(e)."""
    e = exp(_shifted(x))
    return e / tree_sum(e)[..., None]
