"""The hybrid lane's programs (Qwen3-Next) on the cuda backend: the cpu backend's code, run on
CUDA tensors; gdn.chunked's chunk pass is one Triton kernel of the same operations
(``programs/cuda/gdn.py``).

gdn.chunked, gdn.gating, gdn.l2norm, conv1d.causal, rmsnorm.zero_centered, rmsnorm.gated,
gate.sigmoid and moe.shared_gate are written (``programs/cpu/gdn.py``, ``hybrid.py``) from
elementwise IEEE operations (+ - * / sqrt, comparisons, integer bit operations for exp, log and
the bf16 rounding) and explicit fixed trees, and keep three rules that make them
device-generic: every tensor they create is on the inputs' device, no tensor is divided by a
Python number or a cpu scalar (CUDA would multiply by its reciprocal), and no op a backend may
fuse. So the same code on a GPU gives the cpu backend's bytes: one implementation, two
backends, cuda bytes == cpu bytes for these programs (checked on a GPU by
packages/shared-exact/tests/test_hybrid_gpu.py). Each function here checks that its tensors
are on a CUDA device and calls that code.

rope.partial is the exception: the cuda backend's rope.neox is its own Triton program (its
bytes are not the cpu rope's), and rope.partial is that rope on the first ``rotary`` dims of
each head, the rest copied, as the cpu rope.partial is built on the cpu rope.
"""

from __future__ import annotations

import torch

from ..cpu import gdn as _gdn
from ..cpu import hybrid as _hybrid
from ..cpu.gdn import GdnState, state_tensors
from ..cpu.rope import rotate_first
from .arith import require_cuda
from .gdn import chunk as chunk_pass
from .rope import rope


def gdn_chunked(q, k, v, g, beta, state: GdnState, *, position: int, chunk: int, scale=None):
    """gdn.chunked (docs/programs/gdn.chunked.md) on CUDA tensors; the state on the same device."""
    require_cuda(q, k, v, g, beta, *state_tensors(state))
    if isinstance(scale, torch.Tensor):
        require_cuda(scale)
    return _gdn.run_chunks(
        chunk_pass, q, k, v, g, beta, state, position=position, chunk=chunk, scale=scale
    )


def gdn_gating(a, b, a_log, dt_bias):
    require_cuda(a, b, a_log, dt_bias)
    return _gdn.gdn_gating(a, b, a_log, dt_bias)


def l2norm(x, eps: float = 1e-6):
    require_cuda(x)
    return _gdn.l2norm(x, eps)


def conv1d_causal(x, weight, window, *, kernel: int = 4):
    require_cuda(x, weight, window)
    return _gdn.conv1d_causal(x, weight, window, kernel=kernel)


def rmsnorm_zero_centered(x, weight, eps: float):
    require_cuda(x, weight)
    return _hybrid.rmsnorm_zero_centered(x, weight, eps)


def rmsnorm_gated(x, z, weight, eps: float):
    require_cuda(x, z, weight)
    return _hybrid.rmsnorm_gated(x, z, weight, eps)


def sigmoid_gate(x, gate):
    require_cuda(x, gate)
    return _hybrid.sigmoid_gate(x, gate)


def shared_expert_gate(routed, shared, logit):
    require_cuda(routed, shared, logit)
    return _hybrid.shared_expert_gate(routed, shared, logit)


def rope_partial(x: torch.Tensor, positions: torch.Tensor, base: float, rotary: int):
    """rope.partial on cuda: the cuda rope.neox (tables for dim = ``rotary``) on the first
    ``rotary`` dims of each head, the other D - rotary dims copied unchanged. Positions are
    read as the cuda rope reads them (on the device under ``programs.position_bound``)."""
    require_cuda(x)
    return rotate_first(rope, x, positions, base, rotary)


__all__ = [
    "conv1d_causal",
    "gdn_chunked",
    "gdn_gating",
    "l2norm",
    "rmsnorm_gated",
    "rmsnorm_zero_centered",
    "rope_partial",
    "shared_expert_gate",
    "sigmoid_gate",
]
