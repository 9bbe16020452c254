"""HF safetensors (the files the server loads) -> the Megatron exact-lane model's state.

Names map one to one except the fused weights, which are assembled from the HF projections
by the column layout the modules themselves declare (``ExactLinear.parts``): one source of
truth for where q/k/v and gate/up rows live.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.lanes.qwen3 import Geometry

from .fuse import ConversionError, _fuse
from .gdn.convert import megatron_state as hybrid_state
from .gdn.refusals import is_hybrid
from .gdn.spec import LockstepNext
from .spec import LockstepGPT, vocab_rows


def load_hf_weights(model_dir: str | Path, keep=None) -> dict[str, torch.Tensor]:
    """Every bf16 tensor of the directory by HF name; with ``keep`` (a predicate on the name)
    only those it keeps are read (an expert-parallel rank reads its own experts only)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{model_dir} holds no *.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if keep is None:
            weights.update(load_file(str(f)))
            continue
        with safe_open(str(f), framework="pt") as sf:
            names = sf.keys()  # a safe_open handle is not iterable
            weights.update({k: sf.get_tensor(k) for k in names if keep(k)})
    bad = sorted(k for k, t in weights.items() if t.dtype != torch.bfloat16)
    if bad:
        raise ConversionError(f"the exact lane loads bf16 weights; not bf16: {bad[:3]}")
    return weights


def megatron_state(model: LockstepGPT, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GPTModel state dict (names as ``model.gpt.state_dict()``) built from HF weights."""
    if model.geom.family == "qwen3-next":  # the hybrid lane's modules (gdn/)
        return hybrid_state(model, hf)
    g: Geometry = model.geom
    gpt = model.gpt
    used: set[str] = set()
    state: dict[str, torch.Tensor] = {}

    def take(src: str, dst: str):
        if src not in hf:
            raise ConversionError(f"missing HF weight {src}")
        used.add(src)
        state[dst] = hf[src]

    rank, tp = model.tp_rank, model.tp
    take("model.embed_tokens.weight", "embedding.word_embeddings.weight")
    take("model.norm.weight", "decoder.final_layernorm.weight")
    if not g.tie_embeddings:
        take("lm_head.weight", "output_layer.weight")
    if tp > 1:  # the vocab-parallel embedding and LM head hold this rank's vocabulary rows
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if key in state:
                state[key] = vocab_rows(state[key], tp, rank)
    for i, layer in enumerate(gpt.decoder.layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = layer.self_attention
        take(hp + "input_layernorm.weight", mp + "input_layernorm.weight")
        take(hp + "post_attention_layernorm.weight", mp + "pre_mlp_layernorm.weight")
        take(hp + "self_attn.q_norm.weight", mp + "self_attention.q_layernorm.weight")
        take(hp + "self_attn.k_norm.weight", mp + "self_attention.k_layernorm.weight")
        state[mp + "self_attention.linear_qkv.weight"] = _fuse(
            att.linear_qkv, hf, hp + "self_attn.", used, rank, tp
        )
        state[mp + "self_attention.linear_proj.weight"] = _fuse(
            att.linear_proj, hf, hp + "self_attn.", used, rank, tp
        )
        if g.is_moe:  # Megatron's local expert i is global expert local_expert_indices[i]
            take(hp + "mlp.gate.weight", mp + "mlp.router.weight")
            moe = layer.mlp
            for i, expert in enumerate(moe.experts.local_experts):
                e = moe.local_expert_indices[i]
                for fc in ("linear_fc1", "linear_fc2"):
                    state[f"{mp}mlp.experts.local_experts.{i}.{fc}.weight"] = _fuse(
                        getattr(expert, fc), hf, f"{hp}mlp.experts.{e}.", used, rank, tp
                    )
        else:
            for fc in ("linear_fc1", "linear_fc2"):
                state[f"{mp}mlp.{fc}.weight"] = _fuse(
                    getattr(layer.mlp, fc), hf, hp + "mlp.", used, rank, tp
                )
    extra = sorted(set(hf) - used)
    if extra:
        raise ConversionError(f"HF weights the exact lane does not place: {extra[:5]}")
    return state


def owned_experts(model: LockstepGPT):
    """The HF-name predicate of what this rank reads: everything but other ranks' experts
    (None at ep 1: every name)."""
    if getattr(model, "ep", 1) == 1:
        return None
    own = {int(e) for e in model.gpt.decoder.layers[0].mlp.local_expert_indices}
    experts = model.geom.experts

    def keep(name: str) -> bool:  # an expert id no rank holds is read (and refused as extra)
        if ".mlp.experts." not in name:
            return True
        e = name.split(".mlp.experts.")[1].split(".")[0]
        return not e.isdigit() or int(e) in own or int(e) >= experts

    return keep


def load_into(model: LockstepGPT, model_dir: str | Path) -> LockstepGPT:
    """Fill every backbone tensor of ``model`` from ``model_dir``; strict on both sides (under
    expert parallelism: every expert this rank holds, and no other)."""
    state = megatron_state(model, load_hf_weights(model_dir, owned_experts(model)))
    own = {k: v for k, v in model.gpt.state_dict().items() if not k.endswith("_extra_state")}
    own = {k: v for k, v in own.items() if ".lora." not in k}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConversionError(f"state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t)
    return model


def build(model_dir: str | Path, tp: int = 1, ep: int = 1) -> LockstepGPT:
    """The exact-lane Megatron model of an HF Qwen3 / Qwen3-MoE directory, weights loaded
    (``tp`` / ``ep`` > 1: this rank's shards and experts; Megatron's parallel state must be
    set up with those sizes). A Qwen3-Next directory builds the hybrid lane's model
    (``build_hybrid``: tp 1, ep 1)."""
    if is_hybrid(model_dir):
        return build_hybrid(model_dir, tp, ep)
    geom = Geometry.from_model_dir(model_dir)
    return load_into(LockstepGPT(geom, tp, ep), model_dir)


def build_hybrid(model_dir: str | Path, tp: int = 1, ep: int = 1) -> LockstepNext:
    """The Megatron model of an HF Qwen3-Next directory, weights loaded (load_into)."""
    return load_into(LockstepNext(N.Geometry.from_model_dir(model_dir), tp, ep), model_dir)
