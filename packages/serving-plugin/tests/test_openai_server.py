"""vLLM's OpenAI server started by `lockstep serve` serves the lane's exact logprobs.

Loopback only; the server is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from serving_support import assert_same_bytes_and_comparator

from lockstep_exact.model import lane_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.plugins import manager
from lockstep_exact.requests import CaptureRequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "The lighthouse keeper climbs the steps every night"
DECISIONS, SEED = 5, 21


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url, body):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    model_dir = tiny_models["qwen3"]
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")  # noqa: SIM115
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)  # `lockstep serve` names the lane's plugins itself
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # The documented way to start it: `lockstep serve` (the CLI adds the lane's flags and
    # supervises vLLM's server, whose output goes to its --log).
    cmd = [
        sys.executable,
        "-m",
        "lockstep_exact.app.cli",
        "serve",
        "--model",
        str(model_dir),
        "--backend",
        "cpu",
        "--log",
        str(tmp_path_factory.mktemp("serve") / "vllm.log"),
        "--",
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield base, model_dir
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_the_server_reports_the_lane_contract_fingerprint(server):
    base, model_dir = server
    info = _get(base + "/lockstep/contract")
    assert info["lane_active"] is True
    assert info["fingerprint"] == lane_contract(model_dir).fingerprint


def test_a_served_completion_has_the_logprobs_of_the_offline_capture(server):
    import lockstep_serving.vllm.hooks

    base, model_dir = server
    body = {
        "model": str(model_dir),
        "prompt": PROMPT,
        "max_tokens": DECISIONS,
        "ignore_eos": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": SEED,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        # Every response names the contract it was served by.
        assert r.headers["X-Lockstep-Contract"] == lane_contract(model_dir).fingerprint
        choice = json.loads(r.read())["choices"][0]
    served_tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    # JSON floats round-trip doubles exactly, and each double holds a float32 value.
    served = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
    assert torch.equal(served, served.to(torch.float32).to(torch.float64))

    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.vllm.hooks)
    request = CaptureRequest(model_dir=model_dir, prompts=(PROMPT,), decisions=DECISIONS, seed=SEED)
    trace = pm.hook.lockstep_capture(request=request)
    assert trace.sampled(0).tolist() == served_tokens
    assert_same_bytes_and_comparator(trace.logprobs, served.to(torch.float32), "server vs capture")
    # control: the same completion served with another seed parts from the capture
    choice = _post(base + "/v1/completions", {**body, "seed": SEED + 1})["choices"][0]
    other = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
    assert not same_bytes(trace.logprobs, other), "the check misses a changed seed"


def test_a_sampling_parameter_outside_the_lanes_rule_is_a_400_naming_it(server):
    import urllib.error

    base, model_dir = server
    body = {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 2, "seed": SEED, "top_k": 5}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(base + "/v1/completions", body)
    assert err.value.code == 400
    message = err.value.read().decode()
    assert "Lockstep exact lane: top_k=5 is not supported" in message, message
    # The server keeps serving the requests it admits.
    assert _post(base + "/v1/completions", {**body, "top_k": 0})["choices"][0]["text"] is not None


def test_served_responses_verify_byte_for_byte_in_megatron(server, tmp_path, capsys):
    """What `lockstep verify` reads: the server's own answers, saved as {prompt, response}
    lines, recomputed by Megatron on the lane. Control: the same answers against a model whose
    LM head differs by one ulp in one element (an input changed) are reported as differing."""
    from trainer_support import nudge_one_ulp

    from lockstep_megatron.integration import check_rollout, lane_model_provider

    base, model_dir = server
    path = tmp_path / "responses.jsonl"
    with open(path, "w") as f:
        for i, prompt in enumerate(([5, 17, 99, 4, 250], [7, 7, 31])):
            body = {
                "model": str(model_dir),
                "prompt": prompt,
                "max_tokens": DECISIONS,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": SEED + i,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            f.write(
                json.dumps({"prompt": prompt, "response": _post(base + "/v1/completions", body)})
            )
            f.write("\n")
    report = check_rollout(lane_model_provider(model_dir)(), path)
    assert report.equal and report.sequences == 2 and report.decisions == 2 * DECISIONS, report
    nudged = nudge_one_ulp(model_dir, tmp_path / "nudged")
    report = check_rollout(lane_model_provider(nudged)(), path)
    assert not report.equal and report.first_difference is not None, report
    # The same through the CLI, as the README runs it.
    from lockstep_exact.app.cli import main

    assert main(["verify", "--model", str(model_dir), "--rollouts", str(path)]) == 0
    assert f"EXACT: {2 * DECISIONS}/{2 * DECISIONS}" in capsys.readouterr().out
    assert main(["verify", "--model", str(nudged), "--rollouts", str(path)]) == 1
    assert "NOT EXACT" in capsys.readouterr().out
