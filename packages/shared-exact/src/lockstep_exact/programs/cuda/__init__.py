"""The cuda backend: byte programs as Triton kernels with fixed tiles, no split-K, no atomics.

Imported by the dispatch point only for CUDA tensors (it needs triton). Bytes are comparable
within this backend (one GPU architecture, one triton version), never with the cpu backend;
the invariances are the cpu backend's: a row's bytes never depend on the batch, its position
in the batch, prefill vs decode, or chunking. docs/gpu.md has the H200 figures. The hybrid
lane's programs other than rope.partial (``hybrid``) are the exception: they are the cpu
backend's device-generic code run on CUDA tensors, so their bytes are the cpu backend's.
"""

from __future__ import annotations

import torch
import triton

from .activation import swiglu
from .arith import round_bf16
from .attention import attention, attention_decode_paged, attention_varlen, write_pages
from .elementwise import residual_add
from .gemm import TILINGS, gemm, pick_tiling
from .grouped import gemm_grouped, kpart_partial
from .hybrid import (
    conv1d_causal,
    conv1d_paged,
    gdn_chunked,
    gdn_gating,
    gdn_paged,
    l2norm,
    rmsnorm_gated,
    rmsnorm_zero_centered,
    rope_partial,
    shared_expert_gate,
    sigmoid_gate,
)
from .lora import lora_expand, lora_shrink
from .moe import moe_fold, moe_fold_fp32, router_topk
from .norm import rmsnorm
from .plan import expert_plan
from .rope import rope
from .sampling import sample
from .softmax import log_softmax, softmax


def environment(device: torch.device | int | None = None) -> dict[str, str]:
    """What the cuda bytes are a function of, besides the programs: for the contract's pins.

    The architecture and the compilers, not the card's name: no program's bytes depend on
    the card (the forms a program picks by the number of multiprocessors give the same
    bytes, each gated), and every program's golden bytes made on an H200 are those an H100
    makes. So a trace captured on one sm_90 card replays on another."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "backend": "cuda",
        "capability": f"sm_{major}{minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
    }


__all__ = [
    "expert_plan",
    "TILINGS",
    "attention",
    "attention_decode_paged",
    "attention_varlen",
    "conv1d_causal",
    "conv1d_paged",
    "environment",
    "gdn_chunked",
    "gdn_paged",
    "gdn_gating",
    "gemm",
    "gemm_grouped",
    "kpart_partial",
    "l2norm",
    "log_softmax",
    "lora_expand",
    "lora_shrink",
    "moe_fold",
    "moe_fold_fp32",
    "pick_tiling",
    "residual_add",
    "rmsnorm",
    "rmsnorm_gated",
    "rmsnorm_zero_centered",
    "rope",
    "rope_partial",
    "round_bf16",
    "router_topk",
    "sample",
    "shared_expert_gate",
    "sigmoid_gate",
    "softmax",
    "swiglu",
    "write_pages",
]
