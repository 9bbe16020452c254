"""The serve command's vLLM command line: the lane's flags, and refusals of flags that would
take the lane's place (no engine started)."""

from __future__ import annotations

import json

import pytest
from cli_support import finish_cli, start_cli

from lockstep_serving.common.errors import LaneRefused
from lockstep_serving.vllm.server import ServeArgumentError, server_argv, server_env


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_cpu_command_sets_the_lane(tiny_models):
    argv = server_argv(tiny_models["qwen3"], backend="cpu", extra=["--port", "9"], python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(_flag(argv, "--hf-overrides")) == {
        "architectures": ["LockstepQwen3ForCausalLM"]
    }
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--logprobs-mode") == "raw_logprobs"
    assert "--enforce-eager" in argv and "--compilation-config" not in argv
    assert argv[-2:] == ["--port", "9"]  # the user's flags last


def test_cuda_command_captures_decode_without_compiling(tiny_models):
    argv = server_argv(tiny_models["qwen3-moe"], backend="cuda")
    assert "--enforce-eager" not in argv
    assert json.loads(_flag(argv, "--compilation-config")) == {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
    }


def test_contract_pin_travels_in_the_overrides(tiny_models):
    argv = server_argv(tiny_models["qwen3"], backend="cpu", contract="sha256:abc")
    assert "sha256:abc" in json.dumps(json.loads(_flag(argv, "--hf-overrides")))


@pytest.mark.parametrize(
    "flag",
    ["--hf-overrides={}", "--dtype", "--compilation-config", "-O3", "--logprobs-mode", "-cc"],
)
def test_flags_the_lane_owns_are_refused(tiny_models, flag):
    with pytest.raises(ServeArgumentError, match=flag.split("=")[0]):
        server_argv(tiny_models["qwen3"], backend="cpu", extra=[flag, "x"])


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(LaneRefused, match="LlamaForCausalLM"):
        server_argv(tmp_path, backend="cpu")


def test_lockstep_serve_prints_the_command_in_a_child(tiny_models):
    """``lockstep serve`` as a user (and tools/bench/bench_server_gpu.py) starts it: the CLI's
    module in a child process, which finds the vLLM plugin through its entry point."""
    model = str(tiny_models["qwen3"])
    child = start_cli("serve", "--model", model, "--backend", "cpu", "--print", "--", "--port", "9")
    out, _ = finish_cli(child, timeout=300)
    assert "vllm.entrypoints.openai.api_server" in out and out.rstrip().endswith("--port 9")


def test_cpu_env_bounds_the_kv_cache():
    assert server_env("cpu", {})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server_env("cpu", {"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env("cuda", {})
    # The lane's endpoint loads only when VLLM_PLUGINS names it; a caller's list is kept.
    assert server_env("cuda", {})["VLLM_PLUGINS"] == "lockstep"
    assert server_env("cpu", {"VLLM_PLUGINS": "a,lockstep"})["VLLM_PLUGINS"] == "a,lockstep"


def test_the_cli_serve_prints_refuses_and_verify_names_a_bad_line(tiny_models, tmp_path, capsys):
    from lockstep_exact.app.cli import main as cli

    model = str(tiny_models["qwen3"])
    assert cli(["serve", "--model", model, "--backend", "cpu", "--print", "--", "--port", "9"]) == 0
    out = capsys.readouterr().out
    assert "vllm.entrypoints.openai.api_server" in out and out.rstrip().endswith("--port 9")
    assert cli(["serve", "--model", model, "--backend", "cpu", "--", "-O3"]) == 2
    assert "-O3 is set by the lane" in capsys.readouterr().err
    assert cli(["serve", "--model", model, "--backend", "cpu", "--", "--dtype"]) == 2
    assert "--dtype is set by the lane" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3], "prompt_len": 1, "logprobs": [-1.0]}\n')
    assert cli(["verify", "--model", model, "--rollouts", str(bad)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
