"""The cpu backend: byte programs from IEEE-exact elementwise operations and fixed trees."""

from .activation import silu, swiglu
from .arith import exp, log, round_bf16, tree_sum
from .attention import attention, default_scale
from .gemm import gemm
from .lora import lora_expand, lora_shrink
from .moe import moe_fold, moe_fold_fp32, router_topk
from .norm import residual_add, rmsnorm
from .rope import rope, rope_tables
from .sampling import sample
from .softmax import log_softmax, softmax

__all__ = [
    "attention",
    "default_scale",
    "exp",
    "gemm",
    "log",
    "log_softmax",
    "lora_expand",
    "lora_shrink",
    "moe_fold",
    "moe_fold_fp32",
    "residual_add",
    "rmsnorm",
    "rope",
    "rope_tables",
    "round_bf16",
    "router_topk",
    "sample",
    "silu",
    "softmax",
    "swiglu",
    "tree_sum",
]
