"""Megatron's Qwen3-Next model for the qwen3-next lane: megatron-core's own
``GatedDeltaNet``, ``SelfAttention`` with its output gate and ``MoELayer`` with its shared expert,
the lane's programs in their slots.

What Megatron builds: a ``GPTModel`` (in ``Float16Module``) whose ``TransformerBlock`` holds
one ``TransformerLayer`` per HF layer. A ``linear_attention`` layer's mixer is megatron-core's
``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py``) built from
``GatedDeltaNetSubmodules``: its ``in_proj`` (one fused [q | k | v | z | beta | alpha] weight,
every head of each part in head order), ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm`` and
``out_proj`` hold the HF ``linear_attn`` weights under Megatron's names. A ``full_attention``
layer's mixer is ``SelfAttention`` with ``attention_output_gate``: its fused ``linear_qkv``
holds, per query group, [q heads | gate heads | k | v]. Every layer's MLP is the lane's
``MoELayer`` (``moe.py``) with Megatron's ``SharedExpertMLP`` and its ``gate_weight``.

What runs: nothing of Megatron's arithmetic. Each layer's forward is the composition's
``lanes.qwen3_next.Layer`` over the layer's rows, reading weights from those modules
(``NextSlots``): in_proj_qkvz and in_proj_ba are row selections of ``in_proj`` (so the lane's
gemm sees HF's weight bytes), conv1d.causal, gdn.gating, gdn.l2norm, gdn.chunked (chunks at
absolute positions: each sequence of the batch starts at 0), rmsnorm.gated and out_proj's
gemm.kpart; the attention layers' q (and gate) / k / v rows of ``linear_qkv``,
rmsnorm.zero_centered, rope.partial, attention.blocked, gate.sigmoid; the MoE's router,
experts, moe.fold, shared expert and moe.shared_gate. The op order is written only in the
composition. GatedDeltaNet's ``__init__`` refuses to run without ``fla`` although building the
module uses none of it; ``ExactGatedDeltaNet`` passes that check for its own construction
only, and neither fla's kernels (``l2norm``, ``chunk_gated_delta_rule``) nor causal-conv1d
are imported or called: the lane's programs run in their place, and the module's own forward
is the composition's Gated DeltaNet mixer.

Megatron's batches are [s, b] rows, right-padded, each sequence from position 0. The GDN and
attention run per sequence; the layer hands the composition the rows sequence-major (one
segment per batch column) and gives them back [s, b]. Padding rows follow a sequence's real
rows, and every sequence-mixing op is causal, so they never reach a real row's bytes.

LoRA: ``adapters.attach`` / ``export.load_into`` put an adapter on the Megatron linear and
part of each projection the lane adapts (``NextSlots.proj``: the GDN's in_proj parts and
out_proj, the attention's linear_qkv parts and linear_proj, the experts' and the shared
expert's fc1 / fc2); ``NextSlots.lora`` hands it, rounded to bf16, to the composition, which
runs lora.shrink / lora.expand after that projection's gemm.

Training: the lane's ops run with ``grad=True`` (``NextOps``: each program's bytes forward,
its ideal op's VJP backward, the GDN state and conv window included), so a loss on the
log-probabilities differentiates through the whole composition, to the backbone's parameters
and the adapters alike; the trainer session (``session.PolicySession``: ``lockstep train`` and
the ladder's training gate) trains a LoRA adapter on cpu or on one GPU.

Scope: tp 1, ep 1. The model's forward runs on cpu or, moved to a GPU, whole on cuda: each
batch column's caches are made on the hidden states' device (``_sequence_rows``) and every
program dispatches to the cuda backend (tests/test_hybrid_gpu.py). Refused by name: training
and replay on another backend than cpu or cuda (``refuse_training``, ``check_replay``), other
layouts (``check_replay``).
"""

from .convert import megatron_state
from .refusals import (
    BACKEND_REFUSED,
    HybridRefused,
    check_replay,
    is_hybrid,
    refuse_training,
)
from .spec import (
    LockstepNext,
    NextSlots,
    block_spec,
    classes,
    gated_qkv_parts,
    in_proj_parts,
    transformer_config,
)

__all__ = [
    "HybridRefused",
    "LockstepNext",
    "NextSlots",
    "BACKEND_REFUSED",
    "block_spec",
    "classes",
    "megatron_state",
    "check_replay",
    "gated_qkv_parts",
    "in_proj_parts",
    "is_hybrid",
    "refuse_training",
    "transformer_config",
]
