"""The SGLang half on a GPU (issue 15): real SGLang 0.5.17 on cuda samples, real Megatron on
cuda replays, every logprob byte equal.

Run on the GPU machine with ``pytest -m gpu tests/test_sglang_gpu.py`` (skipped elsewhere by the
repository conftest). SGLang's engine spawns its scheduler processes, so it runs as a script
(``tests/sglang_support.py --backend cuda``, the CPU suite's script) in ``LOCKSTEP_SGLANG_PYTHON``
(default: this python, which must import SGLang 0.5.17: the staged wheels on PYTHONPATH, and
the ``IPython`` stub docs/gpu.md names); the traces it writes are replayed here by Megatron
on cuda. What is asserted, each on raw bytes with a one-ulp negative control:

- the 0.5.17 patch table holds on the installed SGLang;
- a trace captured from SGLang on cuda (dense and MoE, 8 prompts x 8 decisions) is replayed by
  Megatron on cuda byte for byte, and a model one bf16 ulp off is caught;
- inside one engine: a radix-cache hit equals the miss; a request alone equals it inside the
  batch; a chunked prefill (dense) equals one prefill; a request outside the rule is refused
  at the front end and the engine serves on;
- LoRA (adapters made for the cuda lane): adapter A and B captures are replayed by Megatron on
  cuda byte for byte (an adapter factor moved by 2^-9 is caught); base, A and B in one batch
  each equal their solo runs; adapters the lane refuses (corrupted, another contract, fp32,
  made for the cpu lane) are named and never served;
- where vLLM 0.26 imports too: vLLM's cuda trace of the same requests equals SGLang's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SUPPORT = Path(__file__).with_name("sglang_support.py")
DECISIONS = 8
SEED = 3


def _python() -> str:
    return os.environ.get("LOCKSTEP_SGLANG_PYTHON") or sys.executable


def _sglang_python() -> str:
    """The SGLang environment's python; the test is skipped where SGLang does not import."""
    python = _python()
    probe = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"SGLang does not import for {python} (LOCKSTEP_SGLANG_PYTHON)")
    return python


def _sglang(args: list[str], timeout: int = 1500) -> subprocess.CompletedProcess:
    """The SGLang script (or ``-c`` code) in the SGLang environment; skipped without SGLang."""
    python = _sglang_python()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _helpers():
    """The CPU suite's byte comparisons and adapter forgeries (tests/test_sglang.py)."""
    import test_sglang

    return test_sglang


def _replay(model, trace_dir, adapter=None, control=False):
    from lockstep_megatron.replay import replay

    got, _ = replay(model, trace_dir, adapter_dir=adapter, backend="cuda", control=control)
    torch.cuda.empty_cache()
    return got


def test_the_0_5_17_patch_table_holds_on_the_installed_sglang():
    code = (
        "import json; from lockstep_serving.sglang import patches as sp; "
        "print(json.dumps([sp.installed_version(), sp.problems(), "
        "sp.TABLE is sp.TABLES.get(sp.installed_version())]))"
    )
    proc = _sglang(["-c", code], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    version, problems, own = json.loads(proc.stdout.strip().splitlines()[-1])
    assert version == "0.5.17" and problems == [] and own is True


# --- dense and MoE: capture on cuda, replay on cuda -------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lane(request, tmp_path_factory):
    from lockstep_exact.app.tiny import make_tiny

    root = tmp_path_factory.mktemp(f"sglang-gpu-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=11)
    out = root / "sglang"
    chunk = "4" if request.param == "qwen3" else "0"  # chunked prefill: the dense lane only
    proc = _sglang(
        [str(SUPPORT), str(model), str(out), str(DECISIONS), str(SEED), chunk, "--backend", "cuda"]
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    info = json.loads((out / "cached.json").read_text())
    print(f"sglang cuda {request.param}: {json.dumps(info['seconds'])}")
    return root, model, out, info


def test_megatron_on_cuda_replays_every_sglang_cuda_decision_byte_for_byte(lane):
    from lockstep_exact.k3 import compare
    from lockstep_exact.trace import Trace

    _, model, out, _ = lane
    trace = Trace.load(out / "batched")
    assert trace.num_decisions == 64 and trace.engine["name"] == "sglang"
    assert trace.engine["version"] == "0.5.17"
    assert trace.contract["backend"] == "cuda"  # the cuda programs ran in the engine
    got = _replay(model, out / "batched")
    cmp = compare(trace.logprobs, got)
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0, str(cmp)
    # the check can fail: one logprob one float32 ulp off is not equal
    assert not compare(_helpers().one_ulp_off(trace).logprobs, got).exact


def test_a_one_ulp_model_copy_is_caught_by_the_cuda_replay(lane):
    from cross_support import forge, nudged_copy

    from lockstep_exact.k3 import compare
    from lockstep_exact.model import model_hash as dir_hash
    from lockstep_exact.trace import Trace

    root, model, out, _ = lane
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    original = Trace.load(out / "batched")
    forged = forge(original, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(original.logprobs, _replay(copy, forged))
    assert not cmp.exact and cmp.first_diff is not None and cmp.k3_max > 0.0


def test_a_radix_cache_hit_gives_the_bytes_of_a_miss_on_cuda(lane):
    from lockstep_exact.trace import Trace

    h = _helpers()
    _, _, out, info = lane
    cached = info["cached"]
    assert all(c > 0 for c in cached["alone-hit"]), cached
    assert sum(cached["alone-miss"]) < sum(cached["alone-hit"]), cached
    hit, miss = Trace.load(out / "alone-hit"), Trace.load(out / "alone-miss")
    assert h.same_bytes(hit, miss)
    assert not h.same_bytes(hit, h.one_ulp_off(miss))


def test_alone_gives_the_bytes_of_batched_on_cuda(lane):
    from lockstep_exact.trace import Trace

    h = _helpers()
    _, _, out, info = lane
    assert sum(info["cached"]["batched"]) == 0, info["cached"]
    alone, batched = Trace.load(out / "alone-miss"), Trace.load(out / "batched")
    assert batched.engine["batch"] is True and alone.engine["batch"] is False
    assert h.same_bytes(alone, batched)
    assert not h.same_bytes(alone, h.one_ulp_off(batched))


def test_chunked_prefill_gives_the_bytes_of_one_pass_on_cuda(lane):
    from lockstep_exact.trace import Trace

    h = _helpers()
    _, _, out, info = lane
    if "chunked" not in info["steps"]:
        pytest.skip("not applicable: chunked prefill is captured for the dense lane only")
    assert info["steps"]["chunked"] > info["steps"]["batched"], info["steps"]
    chunked, batched = Trace.load(out / "chunked"), Trace.load(out / "batched")
    assert h.same_bytes(chunked, batched)
    assert not h.same_bytes(chunked, h.one_ulp_off(batched))


def test_a_request_outside_the_rule_is_refused_on_cuda_and_the_engine_serves_on(lane):
    _, _, _, info = lane
    assert info["refused"] is not None, "SGLang accepted a top_k=5 request on the lane"
    assert "Lockstep exact lane: top_k=5 is not supported" in info["refused"]
    assert info["decisions_after"] == 2


def test_vllm_026_and_sglang_0517_cuda_traces_of_the_same_requests_are_byte_equal(lane):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.requests import CaptureRequest
    from lockstep_exact.trace import Trace
    from lockstep_serving.vllm.capture import capture

    h = _helpers()
    root, model, out, _ = lane
    sgl = Trace.load(out / "batched")
    vllm = capture(
        CaptureRequest(
            model_dir=model,
            prompts=tuple(default_prompts(8)),
            decisions=DECISIONS,
            out_dir=root / "vllm",
            seed=SEED,
            backend="cuda",
            options={"gpu_memory_utilization": 0.25},
        )
    )
    torch.cuda.empty_cache()
    assert vllm.contract_fingerprint == sgl.contract_fingerprint
    assert vllm.sampling.seeds == sgl.sampling.seeds and vllm.sampling.rule == sgl.sampling.rule
    assert h.same_bytes(vllm, sgl)
    assert not h.same_bytes(vllm, h.one_ulp_off(sgl))


# --- LoRA on cuda -----------------------------------------------------------------------------
BAD_ADAPTERS = ("corrupted", "cpu-lane", "wrong-contract", "wrong-dtype")


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lora_lane(request, tmp_path_factory):
    from lockstep_exact.adapters import make_adapter
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.model import ModelDir

    h = _helpers()
    root = tmp_path_factory.mktemp(f"sglang-gpu-lora-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=11)
    cuda = ModelDir(model).contract("cuda").fingerprint  # adapters name the cuda lane
    adapters = root / "adapters"
    a = make_adapter(model, adapters / "A", rank=8, seed=2, contract=cuda)
    make_adapter(model, adapters / "B", rank=8, seed=5, contract=cuda)
    make_adapter(model, adapters / "cpu-lane", rank=8, seed=2)  # the cpu lane's contract
    make_adapter(model, adapters / "wrong-contract", rank=8, contract="sha256:" + "3" * 64)
    h.bad_copy(a, adapters / "corrupted", "flip")
    h.bad_copy(a, adapters / "wrong-dtype", "fp32")
    out = root / "sglang"
    proc = _sglang(
        [
            str(SUPPORT),
            "lora",
            str(model),
            str(out),
            str(adapters),
            str(DECISIONS),
            str(SEED),
            "--backend",
            "cuda",
        ]
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    info = json.loads((out / "lora.json").read_text())
    return root, model, adapters, out, info


def test_megatron_on_cuda_replays_sglang_cuda_lora_captures_byte_for_byte(lora_lane):
    from lockstep_exact.k3 import compare
    from lockstep_exact.testing import perturb_adapter
    from lockstep_exact.trace import Trace

    h = _helpers()
    root, model, adapters, out, _ = lora_lane
    for name in ("A", "B", "A-batched"):
        trace = Trace.load(out / name)
        adapter = adapters / name.removesuffix("-batched")
        assert trace.adapter_hash is not None and trace.num_decisions == 64
        assert trace.contract["backend"] == "cuda"
        got = _replay(model, out / name, adapter=adapter)
        cmp = compare(trace.logprobs, got)
        assert cmp.exact and cmp.k3_max == 0.0, f"{name}: {cmp}"
        assert not compare(h.one_ulp_off(trace).logprobs, got).exact
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    nudged = perturb_adapter(adapters / "A", root / "A-nudged", key)
    trace = Trace.load(out / "A")
    assert not compare(trace.logprobs, _replay(model, out / "A", nudged, control=True)).exact


def test_base_a_and_b_in_one_cuda_batch_each_equal_their_solo_runs(lora_lane):
    from lockstep_exact.testing import nudge_ulp
    from lockstep_exact.trace import Trace

    h = _helpers()
    _, _, _, out, _ = lora_lane
    mixed = json.loads((out / "mixed.json").read_text())
    solo = {name: Trace.load(out / name) for name in ("base", "A", "B")}
    assert mixed["adapters"][:3] == [None, "A", "B"]
    for i, (adapter, run) in enumerate(zip(mixed["adapters"], mixed["runs"], strict=True)):
        tokens, logprobs = h._run(solo[adapter or "base"], i)
        got = torch.tensor(run["logprobs"], dtype=torch.float32)
        assert run["tokens"] == tokens, (i, adapter)
        assert torch.equal(got.view(torch.int32), logprobs.view(torch.int32)), (i, adapter)
        assert not torch.equal(nudge_ulp(got, 0).view(torch.int32), logprobs.view(torch.int32))
    for x, y in (("A", "B"), ("A", "base"), ("B", "base")):
        assert not h.same_bytes(solo[x], solo[y]), (x, y)
    alone, batched = Trace.load(out / "A"), Trace.load(out / "A-batched")
    assert h.same_bytes(alone, batched)
    assert not h.same_bytes(alone, h.one_ulp_off(batched))


def test_adapters_the_cuda_lane_refuses_are_named_and_never_served(lora_lane):
    from lockstep_exact.adapters import AdapterError
    from lockstep_serving.common.capture import adapter_hash

    _, model, adapters, _, info = lora_lane
    assert sorted(info["refused"]) == list(BAD_ADAPTERS)
    for name in BAD_ADAPTERS:
        with pytest.raises(AdapterError) as err:
            adapter_hash(adapters / name, model, "cuda")
        assert info["refused"][name] == f"Lockstep exact lane refused adapter {name}: {err.value}"
    assert "has never been loaded" in info["served_refused"]


def test_the_ladder_qualifies_with_sglang_sampling_on_cuda(tmp_path, capfd):
    """``lockstep qualify --sampler sglang --backend cuda``: SGLang 0.5.17's GPU engine (a
    process in its environment) samples every gate, Megatron on the same GPU replays and
    trains; the report passes, names SGLang and the cuda lane, and both controls differ."""
    python = _sglang_python()
    from lockstep_exact.app.cli import main

    out = tmp_path / "q"
    argv = ["qualify", "--tiny", "qwen3", "--backend", "cuda", "--out", str(out)]
    rc = main([*argv, "--sampler", "sglang", "--sampler-python", python])
    printed = capfd.readouterr().out
    report = json.loads((out / "report.json").read_text())
    failed = [(g["name"], g["error"]) for g in report["gates"] if not g["passed"]]
    assert rc == 0 and report["passed"], (failed, printed[-3000:])
    assert report["sampler"] == "sglang" and report["lane"].endswith("/cuda"), report["lane"]
    engines = {e["role"]: e for e in report["engines"]}
    assert engines["sampler"]["engine"] == "sglang"
    assert engines["sampler"]["engine_version"] == "0.5.17"
    assert "cuda" in engines["sampler"]["backends"], engines["sampler"]
    promotion = report["gates"][-1]["checks"][0]
    assert promotion["decisions"] == promotion["byte_equal"] == 64
    controls = [c for g in report["gates"] for c in g["checks"] if not c["expect_exact"]]
    assert len(controls) == 2 and all(c["byte_equal"] < c["decisions"] for c in controls)
