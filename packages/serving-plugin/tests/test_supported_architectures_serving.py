"""The serving plugins' architecture tables come from lockstep_exact's one table: vLLM serves
every lane architecture (Qwen3-Next included), SGLang the Qwen3 / Qwen3-MoE ones and refuses
Qwen3-Next by naming the plugin that serves it. No engine starts here."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.lanes.config import FAMILIES, supported_architectures
from lockstep_serving.sglang import model as sglang_model
from lockstep_serving.vllm.offline import engine_args
from lockstep_serving.vllm.patches import LaneRefused
from lockstep_serving.vllm.plugin import ARCHITECTURES, LANE_OF_HF


def _model(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return tmp_path


def test_vllm_serves_every_lane_architecture():
    assert sorted(LANE_OF_HF) == supported_architectures()
    assert "Qwen3NextForCausalLM" in LANE_OF_HF
    assert set(LANE_OF_HF.values()) == set(ARCHITECTURES)


def test_vllm_refusal_names_every_supported_architecture(tmp_path):
    with pytest.raises(LaneRefused) as err:
        engine_args(_model(tmp_path, "LlamaForCausalLM"))
    assert str(err.value).endswith(f"supported: {supported_architectures()}")
    assert "Qwen3NextForCausalLM" in str(err.value)


def test_sglang_serves_the_qwen3_families():
    assert sorted(sglang_model.LANE_OF_HF) == sorted(FAMILIES)


def test_sglang_refuses_qwen3_next_naming_the_vllm_plugin(tmp_path):
    with pytest.raises(LaneRefused) as err:
        sglang_model.architecture_for(_model(tmp_path, "Qwen3NextForCausalLM"))
    msg = str(err.value)
    assert "'Qwen3NextForCausalLM'" in msg and "vLLM plugin" in msg
    assert "MambaPool" in msg  # why: SGLang's own state pool and kernels, no lane backend there
    assert "has no exact lane" not in msg
