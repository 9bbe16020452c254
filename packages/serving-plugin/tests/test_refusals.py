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

from lockstep_serving.vllm.offline import engine_args
from lockstep_serving.vllm.patches import LaneRefused

pytestmark = pytest.mark.engine  # starts real vLLM engines


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
from lockstep_serving.vllm.patches import LaneRefused
if __name__ == "__main__":
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    try:
        conftest.start_engine(sys.argv[1], speculative_config=spec)
    except LaneRefused as err:
        print("REFUSED:", err)
"""


@pytest.mark.slow
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
    from lockstep_serving.vllm import patches

    gone = patches.Target("vllm.v1.sample.sampler", "Sampler.gone_in_this_vllm", "patch", "test")
    monkeypatch.setattr(patches, "TABLE", patches.TABLE + (gone,))
    _refused(dense, r"does not support this vLLM: vllm\.v1\.sample\.sampler\.Sampler\.gone_in")


def test_a_vllm_version_without_a_patch_table_is_refused_at_start_naming_the_supported(
    dense, monkeypatch
):
    from lockstep_serving.vllm import patches

    monkeypatch.setattr(patches, "TABLE", patches.table_for("0.27.0"))
    _refused(
        dense,
        r"does not support this vLLM: vLLM 0\.27\.0 is not among the supported "
        r"\('0\.32\.0', '0\.26\.0'\)",
    )


def test_a_device_without_lane_programs_is_refused():
    from types import SimpleNamespace

    from lockstep_serving.vllm.model import lane_backend

    config = SimpleNamespace(device_config=SimpleNamespace(device_type="xpu"))
    with pytest.raises(LaneRefused) as err:
        lane_backend(config)
    assert str(err.value) == (
        "Lockstep exact lane refused to start: device 'xpu': the lane's programs run on cpu "
        "and cuda only"
    )
    assert lane_backend(SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))) == "cpu"


def test_capture_refuses_a_backend_it_has_no_engine_for(monkeypatch):
    import torch

    from lockstep_serving.vllm.capture import check_backend

    with pytest.raises(LaneRefused) as err:
        check_backend("tpu")
    assert str(err.value) == "backend 'tpu': this plugin serves the ('cpu', 'cuda') lanes only"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LaneRefused) as err:
        check_backend("cuda")
    assert str(err.value) == (
        "backend 'cuda': no CUDA device here (a CUDA vLLM, 0.26.0, serves the cuda lane)"
    )


def test_capture_refuses_a_trace_whose_engine_ran_another_backend(dense, monkeypatch):
    """A CUDA device beside a CPU vLLM: the engine runs the cpu lane, so a capture asked for
    cuda is refused once the engine reports what it ran (here the device check is bypassed)."""
    from lockstep_exact.requests import CaptureRequest
    from lockstep_serving.vllm import capture as cap

    monkeypatch.setattr(cap, "check_backend", lambda backend: None)
    request = CaptureRequest(model_dir=dense, prompts=("Hello",), decisions=2, backend="cuda")
    with pytest.raises(LaneRefused) as err:
        cap.capture(request)
    assert str(err.value) == (
        "the engine ran the cpu lane but backend 'cuda' was asked for (the lane's backend is "
        "the engine's device)"
    )


def _graph_config(mode=0, graphs="FULL_DECODE_ONLY", lora=None, tp=1):
    from types import SimpleNamespace

    from vllm.config import CompilationConfig

    return SimpleNamespace(
        compilation_config=CompilationConfig(mode=mode, cudagraph_mode=graphs),
        lora_config=lora,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def test_cuda_graphs_with_what_a_graph_cannot_hold_are_refused():
    """CUDA graphs capture the lane's one-token decode steps only: LoRA (an adapter choice per
    request) and tp > 1 are refused with graphs on, and whole-model torch.compile always."""
    from lockstep_serving.vllm.model import _check_graphs

    _check_graphs(_graph_config())  # graphs alone: accepted
    _check_graphs(_graph_config(graphs="NONE", lora=object(), tp=2))  # eager: accepted
    cases = {
        "lora": (
            _graph_config(lora=object()),
            "LoRA with CUDA graphs: a captured step cannot choose adapters per request; start "
            "the engine with enforce_eager=True for LoRA",
        ),
        "tp": (
            _graph_config(tp=2),
            "CUDA graphs at tensor parallel size 2: the lane captures one-GPU decode steps "
            "only; start the engine with enforce_eager=True",
        ),
        "compile": (
            _graph_config(mode=1, graphs="NONE"),
            "compilation mode STOCK_TORCH_COMPILE would torch.compile the lane's forward "
            "(Inductor may fuse and reorder its programs); use mode NONE (-cc.mode=0)",
        ),
    }
    for config, message in cases.values():
        with pytest.raises(LaneRefused) as err:
            _check_graphs(config)
        assert str(err.value) == f"Lockstep exact lane refused to start: {message}"


def test_engine_args_with_cuda_graphs_ask_for_decode_graphs_and_no_compilation(dense):
    args = engine_args(dense, cuda_graphs=True)
    assert args["enforce_eager"] is False
    assert args["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert engine_args(dense)["enforce_eager"] is True


def test_a_trace_whose_engine_never_ran_the_lanes_sampling_rule_is_refused():
    """If the engine sampled without the lane's rule (no 'sample' op site in what it ran, as
    when vLLM's own sampler took over), capture writes no trace and says why."""
    from types import SimpleNamespace

    from lockstep_serving.vllm.capture import build_trace

    ran = SimpleNamespace(sites={"logprobs": object()})  # logprobs ran, the rule did not
    with pytest.raises(LaneRefused) as err:
        build_trace([], [], ran, None, None, prompts=[], seed=0, batch=True)
    assert str(err.value) == (
        "the engine produced tokens without running the lane's sampling rule (no 'sample' op "
        "site ran): its tokens and logprobs are not the lane's, so no trace is written"
    )
