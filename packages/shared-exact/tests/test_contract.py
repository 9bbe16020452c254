"""Contracts: canonical, fingerprinted, and admission that fails closed naming the difference."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.contract import ContractMismatch, admit, contract_from_json
from lockstep_exact.lanes.qwen3 import Geometry, UnsupportedModel
from lockstep_exact.model import lane_contract
from lockstep_exact.programs import Program

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 1000,
    "intermediate_size": 288,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MOE = {
    **QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}


def model_dir(tmp_path, cfg, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_contract_fingerprint_is_stable_and_canonical(tmp_path):
    a = lane_contract(model_dir(tmp_path, QWEN3, "a"))
    b = lane_contract(model_dir(tmp_path, dict(reversed(list(QWEN3.items()))), "b"))
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint.startswith("sha256:")
    assert contract_from_json(json.loads(a.canonical())).fingerprint == a.fingerprint
    admit(a, b)
    admit(a, a.fingerprint)
    admit(a, a.to_json())


def test_admit_names_the_first_differing_op_site(tmp_path):
    local = lane_contract(model_dir(tmp_path, QWEN3))
    sites = dict(local.sites)
    sites["layers.*.self_attn.core"] = Program.of("attention.blocked", block=64)
    remote = contract_from_json(
        {**local.to_json(), "sites": {k: v.ident for k, v in sites.items()}}
    )
    assert remote.fingerprint != local.fingerprint
    with pytest.raises(
        ContractMismatch, match=r"op site 'layers\.\*\.self_attn\.core'.*block=32.*block=64"
    ):
        admit(local, remote)


def test_admit_names_geometry_backend_and_pin_differences(tmp_path):
    local = lane_contract(model_dir(tmp_path, QWEN3, "a"))
    other = lane_contract(model_dir(tmp_path, {**QWEN3, "rms_norm_eps": 1e-5}, "b"))
    with pytest.raises(ContractMismatch, match="rmsnorm.qwen3"):
        admit(local, other)
    pinned = contract_from_json({**local.to_json(), "pins": {**local.pins, "lockstep_exact": "9"}})
    with pytest.raises(ContractMismatch, match="environment pin 'lockstep_exact'"):
        admit(local, pinned)
    cuda = contract_from_json({**local.to_json(), "backend": "cuda"})
    with pytest.raises(ContractMismatch, match="backend"):
        admit(local, cuda)


def test_admit_refuses_a_bare_fingerprint_that_differs(tmp_path):
    local = lane_contract(model_dir(tmp_path, QWEN3))
    with pytest.raises(ContractMismatch, match="does not match"):
        admit(local, "sha256:" + "0" * 64)


def test_dense_and_moe_lanes_differ_at_their_mlp_sites(tmp_path):
    dense = lane_contract(model_dir(tmp_path, QWEN3, "d"))
    moe = lane_contract(model_dir(tmp_path, MOE, "m"))
    assert "layers.*.mlp.fold" in moe.sites and "layers.*.mlp.fold" not in dense.sites
    assert moe.sites["layers.*.mlp.router"].param("k") == 2
    with pytest.raises(ContractMismatch, match="lane"):
        admit(dense, moe)


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "no exact lane"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"torch_dtype": "float16"}, "bf16 checkpoints"),
        ({"attention_bias": True}, "attention bias"),
        ({"hidden_act": "gelu"}, "silu"),
    ],
)
def test_unsupported_model_features_are_refused_by_name(patch, message):
    with pytest.raises(UnsupportedModel, match=message):
        Geometry.from_hf_config({**QWEN3, **patch})


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(UnsupportedModel, match="no config.json"):
        Geometry.from_model_dir(tmp_path)
