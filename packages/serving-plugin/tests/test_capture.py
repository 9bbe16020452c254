"""lockstep_capture: the real engine's raw FP32 logprobs, written as a Trace."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from safetensors.torch import load_file
from serving_support import assert_same_bytes_and_comparator, nudged_weights

from lockstep_exact.app.tiny import default_prompts
from lockstep_exact.lanes import qwen3
from lockstep_exact.model import lane_contract
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.parity import same_bytes
from lockstep_exact.plugins import manager
from lockstep_exact.requests import CaptureRequest
from lockstep_exact.testing import nudge_ulp
from lockstep_exact.trace import Trace

pytestmark = pytest.mark.engine  # starts real vLLM engines


def _hook():
    import lockstep_serving.vllm.hooks

    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.vllm.hooks)
    return pm.hook


def test_the_plugin_is_installed_under_the_lockstep_entry_point_group():
    names = {ep.name: ep.value for ep in entry_points(group="lockstep")}
    assert names.get("vllm") == "lockstep_serving.vllm.hooks"
    general = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert general.get("lockstep") == "lockstep_serving.vllm.plugin:register"


@pytest.fixture(scope="module")
def captured(tiny_models, tmp_path_factory):
    model_dir = tiny_models["qwen3-moe"]
    out = tmp_path_factory.mktemp("trace") / "t"
    request = CaptureRequest(
        model_dir=model_dir, prompts=tuple(default_prompts(4)), decisions=5, out_dir=out, seed=3
    )
    return model_dir, _hook().lockstep_capture(request=request), out


def test_capture_writes_a_trace_that_loads_back_identical(captured):
    _, trace, out = captured
    loaded = Trace.load(out)
    assert loaded.num_decisions == 4 * 5
    for name, t in trace.tensors().items():
        assert torch.equal(t, loaded.tensors()[name]), name


def test_captured_logprobs_are_the_raw_fp32_bytes_of_the_reference_forward(captured):
    model_dir, trace, _ = captured
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = qwen3.Geometry.from_model_dir(model_dir)

    def reference(weights):
        want = []
        for i in range(trace.num_sequences):
            prompt, sampled = trace.prompt(i), trace.sampled(i)
            ref = qwen3.forward_logprobs(weights, geom, torch.cat([prompt, sampled]))
            want += [ref[len(prompt) - 1 + j, int(t)] for j, t in enumerate(sampled)]
        return torch.stack(want)

    assert_same_bytes_and_comparator(reference(weights), trace.logprobs, "trace vs reference")
    # control: the reference on the model with one norm weight one bf16 ulp off parts from it
    nudged = reference(nudged_weights(weights, "model.norm.weight"))
    assert not same_bytes(nudged, trace.logprobs), "the check misses a one-ulp model change"


def test_capture_records_the_lane_contract_and_model_hash(captured):
    """The trace's contract is what the engine ran: the reference forward's invoked sites."""
    model_dir, trace, _ = captured
    geom = qwen3.Geometry.from_model_dir(model_dir)
    ops = qwen3.default_ops(geom)
    weights = load_file(str(model_dir / "model.safetensors"))
    lp = qwen3.forward_logprobs(weights, geom, trace.prompt(0), ops=ops)
    ops.sample("sample", lp[-1:], temperature=1.0, top_p=1.0, seeds=[3], positions=[1])
    assert trace.contract == ops.invoked_contract().to_json()
    assert trace.contract_fingerprint == ops.invoked_contract().fingerprint
    assert trace.sampling.rule == ops.contract.sites["sample"].ident
    assert trace.contract_fingerprint != lane_contract(model_dir).fingerprint  # no LoRA ran
    assert trace.model_hash == dir_hash(model_dir)
    assert trace.adapter_hash is None
    assert (trace.sampling.temperature, trace.sampling.top_p, trace.sampling.seed) == (1.0, 1.0, 3)


def test_capture_refuses_a_contract_other_than_the_lanes(tiny_models):
    request = CaptureRequest(
        model_dir=tiny_models["qwen3"],
        prompts=("Hello",),
        decisions=1,
        contract="sha256:" + "2" * 64,
    )
    with pytest.raises(Exception, match="does not match this lane's"):
        _hook().lockstep_capture(request=request)


def test_capture_with_an_adapter_records_its_hash_and_the_adapted_bytes(tiny_models, tmp_path):
    from lockstep_exact.adapters import load_adapter, make_adapter

    model_dir = tiny_models["qwen3"]
    adapter_dir = make_adapter(model_dir, tmp_path / "lora", rank=8)
    request = CaptureRequest(
        model_dir=model_dir,
        adapter_dir=adapter_dir,
        prompts=tuple(default_prompts(3)),
        decisions=4,
        seed=5,
        options={"max_lora_rank": 8},
    )
    trace = _hook().lockstep_capture(request=request)
    geom = qwen3.Geometry.from_model_dir(model_dir)
    adapter = load_adapter(adapter_dir, geom)
    assert trace.adapter_hash == adapter.sha256
    assert trace.adapter_hash == _hook().lockstep_load_adapter(
        adapter_dir=adapter_dir, model_dir=model_dir, role="sampler"
    )
    weights = load_file(str(model_dir / "model.safetensors"))

    def reference(modules):
        want = []
        for i in range(trace.num_sequences):
            prompt, sampled = trace.prompt(i), trace.sampled(i)
            seq = torch.cat([prompt, sampled])
            ref = qwen3.forward_logprobs(weights, geom, seq, adapters=modules)
            want += [ref[len(prompt) - 1 + j, int(t)] for j, t in enumerate(sampled)]
        return torch.stack(want)

    want = reference(adapter.modules)
    assert_same_bytes_and_comparator(want, trace.logprobs, "adapted trace vs reference")
    # control: the reference on the adapter with one B factor element one ulp off parts from it
    key = next(k for k in adapter.modules if k.endswith("down_proj.weight"))
    a, b, scale = adapter.modules[key]
    moved = {**adapter.modules, key: (a, nudge_ulp(b, 0), scale)}
    assert not same_bytes(reference(moved), trace.logprobs), "the check misses a factor's ulp"


def test_the_default_max_model_len_stays_within_the_models_positions(tiny_models, tmp_path):
    import json
    import shutil

    from lockstep_exact.model import ModelDir
    from lockstep_serving.vllm.capture import _default_max_model_len

    short = tmp_path / "short"
    shutil.copytree(tiny_models["qwen3"], short)
    cfg = json.loads((short / "config.json").read_text())
    assert _default_max_model_len(ModelDir(short)) == min(2048, cfg["max_position_embeddings"])
    cfg["max_position_embeddings"] = 512  # what transformers' configs of small models often say
    (short / "config.json").write_text(json.dumps(cfg))
    assert _default_max_model_len(ModelDir(short)) == 512


@pytest.mark.engine
def test_a_model_with_512_positions_captures(tiny_models, tmp_path):
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(tiny_models["qwen3"], short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 512  # vLLM refused this under a fixed max_model_len 2048
    (short / "config.json").write_text(json.dumps(cfg))
    request = CaptureRequest(
        model_dir=short, prompts=tuple(default_prompts(2)), decisions=3, out_dir=None, seed=1
    )
    assert _hook().lockstep_capture(request=request).num_decisions == 2 * 3


def test_a_model_without_a_tokenizer_is_refused_before_the_engine_starts(tiny_models, tmp_path):
    import shutil

    from lockstep_serving.vllm.patches import LaneRefused

    bare = tmp_path / "bare"
    shutil.copytree(tiny_models["qwen3"], bare)
    for f in bare.glob("*token*"):
        f.unlink()
    request = CaptureRequest(
        model_dir=bare, prompts=tuple(default_prompts(1)), decisions=1, out_dir=None, seed=1
    )
    with pytest.raises(
        LaneRefused, match=r"bare has no tokenizer \(tokenizer.json, tokenizer.model, vocab.json\)"
    ):
        _hook().lockstep_capture(request=request)


def test_a_cuda_capture_sizes_its_kv_cache_for_its_sequences(tmp_path):
    """On cuda a capture asks vLLM for the blocks its sequences can take (each up to
    max_model_len tokens, at the smallest block of 16 or the caller's block size), not for the
    GPU's free memory: a tiny model's blocks are small and millions of them made every capture
    start for 30-47 s on the H200. A caller's own override is kept; cpu engines are unchanged."""
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.model import ModelDir
    from lockstep_exact.requests import CaptureRequest
    from lockstep_serving.vllm.capture import capture_options

    model = ModelDir(make_tiny(tmp_path / "m", arch="qwen3"), hybrid=True)

    def opts(backend, n=8, **options):
        request = CaptureRequest(
            model_dir=model.path, prompts=("p",) * n, decisions=4, backend=backend, options=options
        )
        return capture_options(model, request)

    cuda = opts("cuda", max_model_len=1000)
    assert cuda["num_gpu_blocks_override"] == 8 * (63 + 1)  # ceil(1000 / 16) + 1 per sequence
    assert opts("cuda", n=3, max_model_len=64, block_size=32)["num_gpu_blocks_override"] == 9
    assert opts("cuda", num_gpu_blocks_override=5)["num_gpu_blocks_override"] == 5
    assert "num_gpu_blocks_override" not in opts("cpu")
    # a hybrid sequence also holds a state page per GDN cache group (the tiny model: 1 layer)
    model = ModelDir(make_tiny(tmp_path / "next", arch="qwen3-next"), hybrid=True)
    assert opts("cuda", max_model_len=1000)["num_gpu_blocks_override"] == 8 * (63 + 1 + 1)
