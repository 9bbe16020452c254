"""HF Qwen3-Next weights -> the Megatron hybrid model's state (the fused weights assembled by
the column layout the modules declare, ``fuse._fuse``)."""

from __future__ import annotations

import torch

from lockstep_exact.lanes import qwen3_next as N

from ..fuse import ConversionError, _fuse
from .spec import LockstepNext


# --- weights ---------------------------------------------------------------------------------
def megatron_state(model: LockstepNext, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GPTModel state dict (names as ``model.gpt.state_dict()``) built from HF Qwen3-Next
    weights; ``ConversionError`` naming a missing HF weight or one no module takes."""
    g, gpt = model.geom, model.gpt
    used: set[str] = set()
    state: dict[str, torch.Tensor] = {}

    def take(src: str, dst: str):
        if src not in hf:
            raise ConversionError(f"missing HF weight {src}")
        used.add(src)
        state[dst] = hf[src]

    def fuse(linear, prefix: str):
        return _fuse(linear, hf, prefix, used)

    take("model.embed_tokens.weight", "embedding.word_embeddings.weight")
    take("model.norm.weight", "decoder.final_layernorm.weight")
    if not g.tie_embeddings:
        take("lm_head.weight", "output_layer.weight")
    for i, layer in enumerate(gpt.decoder.layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        mixer, moe = layer.self_attention, layer.mlp
        take(hp + "input_layernorm.weight", mp + "input_layernorm.weight")
        take(hp + "post_attention_layernorm.weight", mp + "pre_mlp_layernorm.weight")
        if g.layer_types[i] == N.LINEAR:
            a, m = hp + "linear_attn.", mp + "self_attention."
            state[m + "in_proj.weight"] = fuse(mixer.in_proj, a)
            state[m + "out_proj.weight"] = fuse(mixer.out_proj, a)
            take(a + "conv1d.weight", m + "conv1d.weight")
            take(a + "A_log", m + "A_log")
            take(a + "dt_bias", m + "dt_bias")
            take(a + "norm.weight", m + "out_norm.weight")
        else:
            a, m = hp + "self_attn.", mp + "self_attention."
            state[m + "linear_qkv.weight"] = fuse(mixer.linear_qkv, a)
            state[m + "linear_proj.weight"] = fuse(mixer.linear_proj, a)
            take(a + "q_norm.weight", m + "q_layernorm.weight")
            take(a + "k_norm.weight", m + "k_layernorm.weight")
        take(hp + "mlp.gate.weight", mp + "mlp.router.weight")
        for j, expert in enumerate(moe.experts.local_experts):
            e = moe.local_expert_indices[j]
            for fc in ("linear_fc1", "linear_fc2"):
                state[f"{mp}mlp.experts.local_experts.{j}.{fc}.weight"] = fuse(
                    getattr(expert, fc), f"{hp}mlp.experts.{e}."
                )
        for fc in ("linear_fc1", "linear_fc2"):
            state[f"{mp}mlp.shared_experts.{fc}.weight"] = fuse(
                getattr(moe.shared_experts, fc), f"{hp}mlp.shared_expert."
            )
        take(hp + "mlp.shared_expert_gate.weight", mp + "mlp.shared_experts.gate_weight")
    extra = sorted(set(hf) - used)
    if extra:
        raise ConversionError(f"HF weights the hybrid lane does not place: {extra[:5]}")
    return state
