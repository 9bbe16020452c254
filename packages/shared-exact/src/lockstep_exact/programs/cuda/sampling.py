"""sample.gumbel_topp on CUDA tensors: the cpu program's operations, run on the device.

The program is integer arithmetic (the stream), IEEE-exact elementwise fp32 operations
(each its own kernel, so nothing is contracted into a fused multiply-add), fixed trees, a
stable sort and exact max/compare: each of these gives the same bytes on a CUDA device as the
definition says, so no Triton kernel is needed. Bytes are still compared within this backend.
"""

from __future__ import annotations

import torch

from ..cpu import sampling as _cpu
from .arith import require_cuda


def sample(
    logprobs: torch.Tensor, *, temperature, top_p, seeds, positions, rounds: int = 3
) -> torch.Tensor:
    require_cuda(logprobs)
    return _cpu.sample(
        logprobs,
        temperature=temperature,
        top_p=top_p,
        seeds=seeds,
        positions=positions,
        rounds=rounds,
    )
