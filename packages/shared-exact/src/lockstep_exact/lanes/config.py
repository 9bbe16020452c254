"""Which HF config keys (and values) the Qwen3-family exact lanes implement.

``check_config`` reads a ``config.json`` dict and returns the numbers the lane runs with, or
raises ``UnsupportedModel`` naming the first key it does not implement. Every key falls in one
of three groups:

- keys that carry no numerics (names, token ids, the context length, training-only settings
  such as the router's auxiliary loss): accepted with any value;
- keys the lane implements with one value or a range of values (plain RoPE, full attention on
  every layer, silu, no biases, bf16): accepted with those values, refused otherwise, naming
  the key and the value;
- the geometry (sizes, eps, rope theta, tied embeddings, the MoE router): read into the
  lane's ``Geometry``.

Anything else is refused with the key named: a key the lane does not know may change the
model's numbers, and a model the lane does not run exactly must not run at all.

Where a key is absent, the value is HF transformers' default for that model type (checked
against ``Qwen3Config`` / ``Qwen3MoeConfig`` by the tests): rope theta 10000, rms_norm_eps
1e-6, untied embeddings, and ``norm_topk_prob`` False for Qwen3-MoE. The sizes have no
sensible default and must be stated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FAMILIES = {
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Qwen3MoeForCausalLM": ("qwen3-moe", "qwen3_moe"),
}

# HF transformers' defaults (Qwen3Config / Qwen3MoeConfig) for keys a config may leave out.
HF_ROPE_THETA = 10000.0
HF_RMS_NORM_EPS = 1e-6
HF_NORM_TOPK_PROB = False

# Keys that do not change a single computed byte of the forward pass.
NO_NUMERICS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "max_position_embeddings",
        "initializer_range",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "router_aux_loss_coef",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "task_specific_params",
        "finetuning_task",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "prefix",
        "_attn_implementation_autoset",
        # Only read when sliding attention is on, which the lane refuses.
        "sliding_window",
        "max_window_layers",
    }
)

# Keys the lane implements with a fixed value: key -> (accepts(value), what the lane runs).
_FIXED: dict[str, tuple[Any, str]] = {
    "hidden_act": (lambda v: v == "silu", "silu"),
    "attention_bias": (lambda v: v is False, "no attention bias (false)"),
    "attention_dropout": (lambda v: v in (0, 0.0), "no attention dropout (0.0)"),
    "use_sliding_window": (lambda v: v is False, "full attention (false)"),
    "rope_scaling": (lambda v: v is None or v == {}, "plain RoPE (null)"),
    "quantization_config": (lambda v: v is None, "no quantized weights (null)"),
    "layer_types": (
        lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
        'full attention on every layer ("full_attention")',
    ),
    "dtype": (lambda v: v == "bfloat16", "bf16 checkpoints"),
    "torch_dtype": (lambda v: v == "bfloat16", "bf16 checkpoints"),
}
_FIXED_MOE: dict[str, tuple[Any, str]] = {
    "decoder_sparse_step": (lambda v: v == 1, "an MoE block on every layer (1)"),
    "mlp_only_layers": (lambda v: v in (None, []), "no dense layers in the MoE stack ([])"),
}

# Geometry keys, read by ``check_config``.
_SHAPE = {
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "tie_word_embeddings",
}
_SHAPE_MOE = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
}


class UnsupportedModel(ValueError):
    """The model uses a feature the exact lane does not cover; nothing falls back."""


def _refuse(key: str, value: Any, why: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"the exact lane does not implement config key {key!r} = {value!r} ({why})"
    )


def _int(cfg: Mapping, key: str, *, minimum: int = 1) -> int:
    if cfg.get(key) is None:
        raise UnsupportedModel(
            f"config.json has no {key!r}: the exact lane needs the model's sizes stated"
        )
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _refuse(key, value, f"an integer >= {minimum} is expected")
    return value


def _float(cfg: Mapping, key: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _refuse(key, value, "a positive number is expected")
    return float(value)


def _rope_theta(cfg: Mapping) -> float:
    """Plain RoPE only; theta from ``rope_parameters`` (transformers 5) or ``rope_theta``."""
    params = cfg.get("rope_parameters")
    theta = None
    if params is not None:
        if not isinstance(params, Mapping):
            raise _refuse("rope_parameters", params, "a mapping is expected")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise _refuse("rope_parameters", dict(params), f"rope_type {kind!r}: plain RoPE only")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise _refuse("rope_parameters", dict(params), f"it sets {extra[0]!r}: plain RoPE only")
        theta = params.get("rope_theta")
    legacy = cfg.get("rope_theta")
    if theta is not None and legacy is not None and float(theta) != float(legacy):
        raise _refuse(
            "rope_theta",
            legacy,
            f"rope_parameters says rope_theta {theta!r}; the two must agree",
        )
    value = theta if theta is not None else legacy
    return _float({"rope_theta": value}, "rope_theta", HF_ROPE_THETA)


def check_config(cfg: Mapping) -> dict[str, Any]:
    """Refuse what the lane does not implement; return the geometry fields (a dict).

    Raises ``UnsupportedModel`` naming the key (and its value) the lane does not implement.
    """
    archs = cfg.get("architectures") or ["?"]
    if isinstance(archs, list) and archs and archs[0] in HYBRID_FAMILIES:
        raise UnsupportedModel(
            f"architecture {archs[0]!r} is not a Qwen3 / Qwen3-MoE model: its lane is qwen3-next "
            "(lanes.qwen3_next, config check check_next_config), which the vLLM and Megatron "
            "plugins serve (lockstep_serving.vllm.next, lockstep_megatron.gdn); read it with "
            "lockstep_exact.model.ModelDir(path, hybrid=True) or lanes.qwen3_next.Geometry; the "
            "SGLang plugin does not take it yet"
        )
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in FAMILIES:
        raise UnsupportedModel(
            f"architecture {archs!r} has no exact lane; supported: {supported_architectures()}"
        )
    family, model_type = FAMILIES[archs[0]]
    moe = family == "qwen3-moe"
    if cfg.get("model_type", model_type) != model_type:
        raise _refuse("model_type", cfg["model_type"], f"{archs[0]} is model_type {model_type!r}")
    fixed = {**_FIXED, **(_FIXED_MOE if moe else {})}
    known = NO_NUMERICS | set(fixed) | _SHAPE | (_SHAPE_MOE if moe else set())
    for key in cfg:
        if key not in known:
            raise UnsupportedModel(
                f"the exact lane does not implement config key {key!r} (= {cfg[key]!r}); "
                f"the {family} lane implements: {', '.join(sorted(known - NO_NUMERICS))}"
            )
    for key, (accepts, what) in fixed.items():
        if key in cfg and not accepts(cfg[key]):
            raise _refuse(key, cfg[key], f"the lane runs {what}")
    if "tie_word_embeddings" in cfg and not isinstance(cfg["tie_word_embeddings"], bool):
        raise _refuse("tie_word_embeddings", cfg["tie_word_embeddings"], "a bool is expected")

    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads")
    if heads % kv_heads:
        raise _refuse(
            "num_key_value_heads", kv_heads, f"it must divide num_attention_heads ({heads})"
        )
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", minimum=2)
    elif moe:
        # Qwen3-MoE (HF): a null head_dim means hidden_size // num_attention_heads.
        head_dim = hidden // heads
    else:
        raise UnsupportedModel(
            "config.json has no 'head_dim': HF's Qwen3Config would use 128, not "
            "hidden_size // num_attention_heads; state it"
        )
    if head_dim % 2:
        raise _refuse("head_dim", head_dim, "RoPE rotates pairs: an even head_dim is expected")
    geom: dict[str, Any] = {
        "family": family,
        "hidden": hidden,
        "layers": _int(cfg, "num_hidden_layers"),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": _int(cfg, "vocab_size"),
        "intermediate": 0,
        "eps": _float(cfg, "rms_norm_eps", HF_RMS_NORM_EPS),
        "rope_theta": _rope_theta(cfg),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    layer_types = cfg.get("layer_types")
    if layer_types is not None and len(layer_types) != geom["layers"]:
        raise _refuse(
            "layer_types",
            layer_types,
            f"{len(layer_types)} entries for num_hidden_layers {geom['layers']}",
        )
    if not moe:
        geom["intermediate"] = _int(cfg, "intermediate_size")
        return geom
    # The dense MLP size is unused when every layer is an MoE block (checked above).
    if cfg.get("intermediate_size") is not None:
        geom["intermediate"] = _int(cfg, "intermediate_size")
    experts = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(experts.values())) > 1:
        raise _refuse(
            "num_local_experts", experts["num_local_experts"], "num_experts says otherwise"
        )
    if not experts:
        raise UnsupportedModel(
            "config.json has no 'num_experts' (or 'num_local_experts'): the exact lane needs "
            "the model's sizes stated"
        )
    n_experts = _int(experts, next(iter(experts)))
    topk = _int(cfg, "num_experts_per_tok")
    if topk > n_experts:
        raise _refuse("num_experts_per_tok", topk, f"more than the {n_experts} experts")
    norm_topk = cfg.get("norm_topk_prob", HF_NORM_TOPK_PROB)
    if not isinstance(norm_topk, bool):
        raise _refuse("norm_topk_prob", norm_topk, "a bool is expected")
    geom.update(
        experts=n_experts,
        topk=topk,
        moe_intermediate=_int(cfg, "moe_intermediate_size"),
        norm_topk=norm_topk,
    )
    return geom


# --- the hybrid family (Qwen3-Next) -------------------------------------------------------------
# Its lane is ``lanes.qwen3_next`` (gdn.chunked, gdn.gating, gdn.l2norm, conv1d.causal,
# rmsnorm.zero_centered, rmsnorm.gated, gate.sigmoid, moe.shared_gate, rope.partial);
# ``check_config`` (the Qwen3 lane's check) refuses it, ``check_next_config`` is its check.
HYBRID_FAMILIES = {"Qwen3NextForCausalLM": ("qwen3-next", "qwen3_next")}


def supported_architectures() -> list[str]:
    """Every HF architecture some exact lane runs (``FAMILIES`` and ``HYBRID_FAMILIES``),
    sorted: the one list a refusal of an unknown architecture names."""
    return sorted({**FAMILIES, **HYBRID_FAMILIES})


HF_NEXT_FULL_ATTENTION_INTERVAL = 4  # Qwen3NextConfig's layer_types when the config has none
_NEXT_LAYER_TYPES = ("linear_attention", "full_attention")

_FIXED_NEXT: dict[str, tuple[Any, str]] = {
    **{k: _FIXED[k] for k in ("hidden_act", "attention_bias", "attention_dropout")},
    **{k: _FIXED[k] for k in ("rope_scaling", "quantization_config", "dtype", "torch_dtype")},
    **_FIXED_MOE,
    "layer_types": (
        lambda v: isinstance(v, list) and all(t in _NEXT_LAYER_TYPES for t in v),
        'Gated DeltaNet or gated full attention per layer ("linear_attention", "full_attention")',
    ),
    "attn_output_gate": (lambda v: v is True, "the sigmoid output gate, gate.sigmoid (true)"),
    "output_gate_type": (
        lambda v: v in ("silu", "swish"),
        "rmsnorm.gated's silu gate before out_proj (silu)",
    ),
    "partial_rotary_factor": (
        lambda v: not isinstance(v, bool) and isinstance(v, int | float) and 0 < v <= 1,
        "RoPE on a fraction of the head dim, rope.partial (a number in (0, 1])",
    ),
}
_SHAPE_NEXT = (_SHAPE | _SHAPE_MOE) - {"num_local_experts"} | {
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "shared_expert_intermediate_size",
}


def check_next_config(cfg: Mapping) -> dict[str, Any]:
    """The config check of the qwen3-next lane: refuse what its programs do not implement
    (naming the key and value), return its geometry (a dict).

    Absent keys take HF ``Qwen3NextConfig``'s defaults where the numbers allow one (layer types
    from ``full_attention_interval`` 4, rope theta 10000, eps 1e-6, untied embeddings,
    ``norm_topk_prob`` true, RoPE on a quarter of the head dim); sizes must be stated.
    """
    archs = cfg.get("architectures") or ["?"]
    if archs != ["Qwen3NextForCausalLM"]:
        raise UnsupportedModel(f"architecture {archs!r} is not Qwen3NextForCausalLM")
    if cfg.get("model_type", "qwen3_next") != "qwen3_next":
        raise _refuse("model_type", cfg["model_type"], "Qwen3NextForCausalLM is 'qwen3_next'")
    known = NO_NUMERICS | set(_FIXED_NEXT) | _SHAPE_NEXT
    for key in cfg:
        if key not in known:
            raise UnsupportedModel(
                f"the exact lane does not implement config key {key!r} (= {cfg[key]!r}); the "
                f"qwen3-next lane implements: {', '.join(sorted(known - NO_NUMERICS))}"
            )
    rope = dict(cfg.get("rope_parameters") or {})
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    checked = {**cfg, "partial_rotary_factor": partial}
    for key, (accepts, what) in _FIXED_NEXT.items():
        if key in checked and not accepts(checked[key]):
            raise _refuse(key, checked[key], f"the lane runs {what}")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads")
    if heads % kv_heads:
        raise _refuse(
            "num_key_value_heads", kv_heads, f"it must divide num_attention_heads ({heads})"
        )
    k_heads = _int(cfg, "linear_num_key_heads")
    v_heads = _int(cfg, "linear_num_value_heads")
    if v_heads % k_heads:
        raise _refuse(
            "linear_num_value_heads", v_heads, f"a multiple of linear_num_key_heads ({k_heads})"
        )
    layers = _int(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = cfg.get("full_attention_interval", HF_NEXT_FULL_ATTENTION_INTERVAL)
        every = _int({"full_attention_interval": every}, "full_attention_interval")
        layer_types = [_NEXT_LAYER_TYPES[(i + 1) % every == 0] for i in range(layers)]
    if len(layer_types) != layers:
        raise _refuse(
            "layer_types", layer_types, f"{len(layer_types)} entries for num_hidden_layers {layers}"
        )
    head_dim = _int(cfg, "head_dim", minimum=2)
    if head_dim % 2:
        raise _refuse("head_dim", head_dim, "RoPE rotates pairs: an even head_dim is expected")
    rotary_dim = int(head_dim * partial)  # HF's int(head_dim * partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise _refuse(
            "partial_rotary_factor",
            partial,
            f"head_dim {head_dim} * it gives {rotary_dim} rotary dims: RoPE rotates pairs, an "
            "even number >= 2 is expected",
        )
    experts = _int(cfg, "num_experts")
    topk = _int(cfg, "num_experts_per_tok")
    if topk > experts:
        raise _refuse("num_experts_per_tok", topk, f"more than the {experts} experts")
    norm_topk = cfg.get("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise _refuse("norm_topk_prob", norm_topk, "a bool is expected")
    if "tie_word_embeddings" in cfg and not isinstance(cfg["tie_word_embeddings"], bool):
        raise _refuse("tie_word_embeddings", cfg["tie_word_embeddings"], "a bool is expected")
    return {
        "family": "qwen3-next",
        "hidden": hidden,
        "layers": layers,
        "layer_types": tuple(layer_types),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "vocab": _int(cfg, "vocab_size"),
        "eps": _float(cfg, "rms_norm_eps", HF_RMS_NORM_EPS),
        "rope_theta": _rope_theta(
            {"rope_parameters": rope or None, "rope_theta": cfg.get("rope_theta")}
        ),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "linear_key_heads": k_heads,
        "linear_value_heads": v_heads,
        "linear_key_dim": _int(cfg, "linear_key_head_dim"),
        "linear_value_dim": _int(cfg, "linear_value_head_dim"),
        "conv_kernel": _int(cfg, "linear_conv_kernel_dim", minimum=2),
        "experts": experts,
        "topk": topk,
        "norm_topk": norm_topk,
        "moe_intermediate": _int(cfg, "moe_intermediate_size"),
        "shared_intermediate": _int(cfg, "shared_expert_intermediate_size"),
    }
