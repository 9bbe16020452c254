"""Whatever the lane cannot cover exactly is refused at start, with a message naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from serving_support import start_engine, stop_engine

from lockstep_serving.offline import engine_args
from lockstep_serving.patches import LaneRefused


def _copy(model_dir, tmp_path, name, **config_changes):
    out = tmp_path / name
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config_changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _refused(model_dir, match, **overrides):
    with pytest.raises(Exception, match=match) as info:
        llm = start_engine(model_dir, **overrides)
        stop_engine(llm)
    return info


@pytest.fixture(scope="module")
def dense(tiny_models):
    return tiny_models["qwen3"]


def test_quantized_weights_are_refused(dense, tmp_path):
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    model = _copy(dense, tmp_path, "fp8", quantization_config=quant)
    _refused(model, r"(?i)quantiz")


def test_a_dtype_other_than_bf16_is_refused(dense):
    _refused(
        dense, r"dtype torch.float32 is not supported: the exact lane runs bf16", dtype="float32"
    )


def test_weights_stored_in_another_dtype_are_refused(dense, tmp_path):
    model = _copy(dense, tmp_path, "fp16w")
    weights = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name] = weights[name].half()
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    _refused(model, r"model.layers.0.mlp.up_proj.weight.*torch.float16.*bf16 weights only")


_SPECULATIVE_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
import serving_support as conftest
from lockstep_serving.patches import LaneRefused
if __name__ == "__main__":
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    try:
        conftest.start_engine(sys.argv[1], speculative_config=spec)
    except LaneRefused as err:
        print("REFUSED:", err)
"""


def test_speculative_decoding_is_refused(dense):
    # In a child process: the ngram drafter leaves vLLM's kernel registry unable to start
    # another engine in the same process (an upstream quirk, not the lane's refusal).
    child = subprocess.run(
        [sys.executable, "-c", _SPECULATIVE_CHILD, str(dense), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "REFUSED: " in child.stdout, child.stderr[-3000:]
    assert "speculative decoding is not supported" in child.stdout


def test_an_unknown_architecture_is_refused(dense, tmp_path):
    model = _copy(dense, tmp_path, "llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(LaneRefused, match=r"'LlamaForCausalLM' has no exact lane"):
        engine_args(model)
    # Forcing a lane architecture onto it fails inside the engine too.
    forced = {"architectures": ["LockstepQwen3ForCausalLM"]}
    _refused(model, r"architecture 'LlamaForCausalLM' has no exact lane", hf_overrides=forced)


def test_a_lane_of_the_wrong_family_is_refused(tiny_models):
    forced = {"architectures": ["LockstepQwen3ForCausalLM"]}
    _refused(tiny_models["qwen3-moe"], r"serves the qwen3 family", hf_overrides=forced)


def test_a_contract_fingerprint_other_than_the_lanes_is_refused(dense):
    _refused(dense, r"contract fingerprint sha256:0+ does not match", contract="sha256:" + "0" * 64)


def test_a_contract_fingerprint_from_the_environment_is_checked(dense, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CONTRACT", "sha256:" + "1" * 64)
    _refused(dense, r"contract fingerprint sha256:1+ does not match")


def test_processed_logprobs_are_refused(dense):
    _refused(dense, r"logprobs_mode 'processed_logprobs'", logprobs_mode="processed_logprobs")


def test_a_vllm_without_a_patched_target_is_refused_at_start(dense, monkeypatch):
    from lockstep_serving import patches

    gone = patches.Target("vllm.v1.sample.sampler", "Sampler.gone_in_this_vllm", "patch", "test")
    monkeypatch.setattr(patches, "TABLE", patches.TABLE + (gone,))
    _refused(dense, r"does not support this vLLM: vllm\.v1\.sample\.sampler\.Sampler\.gone_in")
