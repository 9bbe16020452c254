"""The config allow-list: what the lane implements passes, anything else is refused by name."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.app.tiny import tiny_config
from lockstep_exact.lanes.config import HF_NORM_TOPK_PROB, HF_RMS_NORM_EPS, HF_ROPE_THETA
from lockstep_exact.lanes.qwen3 import Geometry, UnsupportedModel

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def saved(config, tmp_path):
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def hf_dense(tmp_path, **kw):
    return saved(
        transformers.Qwen3Config(
            **SMALL, intermediate_size=96, architectures=["Qwen3ForCausalLM"], **kw
        ),
        tmp_path,
    )


def hf_moe(tmp_path, **kw):
    cfg = transformers.Qwen3MoeConfig(
        **SMALL,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        architectures=["Qwen3MoeForCausalLM"],
        **kw,
    )
    return saved(cfg, tmp_path)


def test_a_config_saved_by_transformers_is_accepted(tmp_path):
    dense = Geometry.from_hf_config({**hf_dense(tmp_path), "dtype": "bfloat16"})
    assert (dense.family, dense.hidden, dense.head_dim, dense.kv_heads) == ("qwen3", 64, 16, 2)
    assert dense.rope_theta == 10000.0 and dense.intermediate == 96
    moe = Geometry.from_hf_config({**hf_moe(tmp_path), "dtype": "bfloat16"})
    assert (moe.family, moe.experts, moe.topk, moe.moe_intermediate) == ("qwen3-moe", 4, 2, 32)
    assert moe.norm_topk is False  # HF's default, saved explicitly by transformers


def test_hf_defaults_are_the_ones_transformers_uses():
    dense, moe = transformers.Qwen3Config(), transformers.Qwen3MoeConfig()
    assert dense.rope_parameters["rope_theta"] == HF_ROPE_THETA
    assert moe.rope_parameters["rope_theta"] == HF_ROPE_THETA
    assert dense.rms_norm_eps == moe.rms_norm_eps == HF_RMS_NORM_EPS
    assert moe.norm_topk_prob is HF_NORM_TOPK_PROB


def test_an_moe_config_without_norm_topk_prob_gets_hf_default(tmp_path):
    cfg = hf_moe(tmp_path)
    del cfg["norm_topk_prob"]
    assert Geometry.from_hf_config(cfg).norm_topk is False
    assert Geometry.from_hf_config({**cfg, "norm_topk_prob": True}).norm_topk is True


def test_rope_theta_is_read_from_rope_parameters(tmp_path):
    cfg = hf_dense(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert "rope_theta" not in cfg
    assert Geometry.from_hf_config(cfg).rope_theta == 5e5


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_the_tiny_makers_configs_are_accepted(arch):
    cfg = tiny_config(arch, hidden=96, heads=3, kv_heads=1, head_dim=32)
    geom = Geometry.from_hf_config(cfg)
    assert geom.head_dim == 32 and geom.rope_theta == 1000000.0
    if arch == "qwen3-moe":
        assert geom.norm_topk is True and cfg["norm_topk_prob"] is True


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"foo": 1}, r"does not implement config key 'foo' \(= 1\)"),
        ({"rope_parameters": YARN}, r"'rope_parameters' = .*rope_type 'yarn': plain RoPE only"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "factor": 2.0}},
            r"it sets 'factor': plain RoPE only",
        ),
        ({"rope_parameters": {"rope_theta": 1e4}}, r"'rope_theta' = 1000000.0 .* must agree"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"'rope_scaling' = .*plain RoPE"),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"'layer_types' = \['full_attention', 'sliding_attention'\]",
        ),
        ({"layer_types": ["full_attention"]}, r"1 entries for num_hidden_layers 2"),
        ({"use_sliding_window": True}, r"'use_sliding_window' = True"),
        ({"attention_bias": True}, r"'attention_bias' = True .*no attention bias"),
        ({"attention_dropout": 0.1}, r"'attention_dropout' = 0.1"),
        ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu' .*silu"),
        ({"dtype": "float16"}, r"'dtype' = 'float16' .*bf16"),
        ({"model_type": "llama"}, r"'model_type' = 'llama'"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"'quantization_config'"),
        ({"num_key_value_heads": 3}, r"'num_key_value_heads' = 3 .*must divide"),
        ({"head_dim": 15}, r"'head_dim' = 15 .*even"),
        ({"hidden_size": None}, r"no 'hidden_size'"),
        ({"rms_norm_eps": -1.0}, r"'rms_norm_eps' = -1.0"),
        ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings' = 'yes'"),
        ({"architectures": ["LlamaForCausalLM"]}, r"no exact lane"),
    ],
)
def test_dense_keys_and_values_the_lane_lacks_are_refused_by_name(patch, message):
    cfg = {**tiny_config("qwen3"), **patch}
    with pytest.raises(UnsupportedModel, match=message):
        Geometry.from_hf_config(cfg)


def test_a_dense_config_without_head_dim_is_refused():
    cfg = tiny_config("qwen3")
    del cfg["head_dim"]
    with pytest.raises(UnsupportedModel, match="no 'head_dim': HF's Qwen3Config would use 128"):
        Geometry.from_hf_config(cfg)


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"decoder_sparse_step": 2}, r"'decoder_sparse_step' = 2"),
        ({"mlp_only_layers": [1]}, r"'mlp_only_layers' = \[1\]"),
        ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' = 'yes'"),
        ({"num_local_experts": 6}, r"'num_local_experts' = 6 .*num_experts says otherwise"),
        ({"num_experts_per_tok": 9}, r"'num_experts_per_tok' = 9 .*more than the 8 experts"),
        ({"num_experts": None}, r"no 'num_experts'"),
        ({"shared_expert_intermediate_size": 64}, r"config key 'shared_expert_intermediate_size'"),
    ],
)
def test_moe_keys_and_values_the_lane_lacks_are_refused_by_name(patch, message):
    cfg = {**tiny_config("qwen3-moe"), **patch}
    with pytest.raises(UnsupportedModel, match=message):
        Geometry.from_hf_config(cfg)


def test_a_dense_config_may_not_carry_moe_keys():
    with pytest.raises(UnsupportedModel, match="config key 'num_experts'"):
        Geometry.from_hf_config({**tiny_config("qwen3"), "num_experts": 8})
