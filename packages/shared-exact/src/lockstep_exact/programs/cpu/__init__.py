"""The cpu backend: byte programs from IEEE-exact elementwise operations and fixed trees."""

from .activation import silu, swiglu
from .arith import exp, log, round_bf16, tree_sum
from .attention import attention, attention_varlen, default_scale
from .gdn import (
    GdnPages,
    GdnState,
    PagedPasses,
    PagedSeqs,
    conv1d_causal,
    conv1d_paged,
    conv1d_window,
    gdn_chunked,
    gdn_gating,
    gdn_paged,
    gdn_state,
    l2norm,
    paged_decodes,
    paged_passes,
    paged_seqs,
)
from .gemm import gemm, kpart_partial
from .hybrid import rmsnorm_gated, rmsnorm_zero_centered, shared_expert_gate, sigmoid_gate
from .lora import lora_expand, lora_shrink
from .moe import moe_fold, moe_fold_fp32, router_topk
from .norm import residual_add, rmsnorm
from .rope import rope, rope_partial, rope_tables
from .sampling import sample
from .softmax import fold_tree_nodes, log_softmax, log_softmax_from_sum, shard_tree_nodes, softmax

__all__ = [
    "GdnPages",
    "GdnState",
    "PagedPasses",
    "PagedSeqs",
    "paged_decodes",
    "conv1d_causal",
    "conv1d_paged",
    "conv1d_window",
    "gdn_chunked",
    "gdn_gating",
    "gdn_paged",
    "gdn_state",
    "l2norm",
    "paged_passes",
    "paged_seqs",
    "rmsnorm_gated",
    "rmsnorm_zero_centered",
    "shared_expert_gate",
    "sigmoid_gate",
    "attention",
    "attention_varlen",
    "default_scale",
    "exp",
    "fold_tree_nodes",
    "gemm",
    "kpart_partial",
    "log",
    "log_softmax",
    "log_softmax_from_sum",
    "lora_expand",
    "lora_shrink",
    "moe_fold",
    "moe_fold_fp32",
    "residual_add",
    "rmsnorm",
    "rope",
    "rope_partial",
    "rope_tables",
    "round_bf16",
    "router_topk",
    "sample",
    "shard_tree_nodes",
    "silu",
    "softmax",
    "swiglu",
    "tree_sum",
]
