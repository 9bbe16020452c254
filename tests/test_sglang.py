"""Real SGLang samples, real Megatron replays, real vLLM agrees: every logprob byte is equal.

SGLang and vLLM cannot share an environment (docs/sglang.md), and Megatron lives in the
workspace one. So SGLang runs as a subprocess in the SGLang environment
(``tests/sglang_support.py``: one CPU engine, three traces of the same 8 requests, written as
trace directories), and this module, in the workspace environment, replays them with Megatron
and captures the same requests with vLLM. Dense and MoE; 8 prompts of different lengths, 8
decisions each (64).

Skipped unless an SGLang environment is found: ``LOCKSTEP_SGLANG_PYTHON`` (its python), else
``.venv-sglang/bin/python`` in the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from cross_support import capture, forge, nudged_copy, replay

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.plugins import manager
from lockstep_exact.testing import nudge_ulp
from lockstep_exact.trace import Trace

REPO = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).with_name("sglang_support.py")


def sglang_python() -> str | None:
    """The SGLang environment's python, or None."""
    given = os.environ.get("LOCKSTEP_SGLANG_PYTHON")
    path = Path(given) if given else REPO / ".venv-sglang" / "bin" / "python"
    return str(path) if path.is_file() else None


PYTHON = sglang_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        PYTHON is None,
        reason="no SGLang environment (LOCKSTEP_SGLANG_PYTHON, or .venv-sglang: docs/sglang.md)",
    ),
]


def same_bytes(a: Trace, b: Trace) -> bool:
    """Prompts, sampled tokens and the raw bytes of every logprob: equal, or not."""
    return (
        torch.equal(a.prompt_tokens, b.prompt_tokens)
        and torch.equal(a.prompt_offsets, b.prompt_offsets)
        and torch.equal(a.sampled_tokens, b.sampled_tokens)
        and torch.equal(a.logprobs.view(torch.int32), b.logprobs.view(torch.int32))
    )


def one_ulp_off(trace: Trace, index: int = 5) -> Trace:
    """``trace`` with one logprob one float32 ulp away (the negative control)."""
    lp = trace.logprobs.clone()
    lp[index] = nudge_ulp(lp[index : index + 1], 0)[0]
    n = trace.num_sequences
    offsets = trace.sampled_offsets.tolist()
    seqs = [lp[offsets[i] : offsets[i + 1]] for i in range(n)]
    return Trace.from_sequences(
        [trace.prompt(i) for i in range(n)],
        [trace.sampled(i) for i in range(n)],
        seqs,
        contract_fingerprint=trace.contract_fingerprint,
        contract=trace.contract,
        model_hash=trace.model_hash,
        sampling=trace.sampling,
        engine=trace.engine,
    )


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lane(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"sglang-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=11)
    out = root / "sglang"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    chunk = "4" if request.param == "qwen3" else "0"  # chunked prefill: the dense lane only
    proc = subprocess.run(
        [PYTHON, str(SUPPORT), str(model), str(out), "8", "3", chunk],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    info = json.loads((out / "cached.json").read_text())
    return root, model, out, info


def test_megatron_replays_every_sglang_decision_byte_for_byte(pm, lane):
    _, model, out, _ = lane
    trace = Trace.load(out / "batched")
    assert trace.num_decisions == 64 and trace.engine["name"] == "sglang"
    assert trace.sampling.rule is not None  # replay re-draws every token with the rule
    cmp = compare(trace.logprobs, replay(pm, model, out / "batched"))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)


def test_a_one_ulp_model_copy_is_caught_by_the_replay(pm, lane):
    root, model, out, _ = lane
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    original = Trace.load(out / "batched")
    forged = forge(original, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(original.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None and cmp.k3_max > 0.0


def test_a_radix_cache_hit_gives_the_bytes_of_a_miss(lane):
    _, _, out, info = lane
    cached = info["cached"]
    assert all(c > 0 for c in cached["alone-hit"]), cached  # every prompt was in the cache
    assert sum(cached["alone-miss"]) < sum(cached["alone-hit"]), cached
    hit, miss = Trace.load(out / "alone-hit"), Trace.load(out / "alone-miss")
    assert same_bytes(hit, miss)
    assert not same_bytes(hit, one_ulp_off(miss))  # the comparator sees one ulp
    # control (an input): the same hits with other seeds part from the miss's bytes
    other = Trace.load(out / "alone-hit-other-seed")
    assert all(c > 0 for c in cached["alone-hit-other-seed"]), cached
    assert not same_bytes(other, miss)


def test_alone_gives_the_bytes_of_batched(lane):
    _, _, out, info = lane
    cached = info["cached"]
    assert sum(cached["batched"]) == 0, cached  # both runs miss: only the batching differs
    alone, batched = Trace.load(out / "alone-miss"), Trace.load(out / "batched")
    assert batched.engine["batch"] is True and alone.engine["batch"] is False
    assert same_bytes(alone, batched)
    assert not same_bytes(alone, one_ulp_off(batched))  # the comparator sees one ulp
    # control (an input): the requests alone with other seeds part from the batch's bytes
    assert not same_bytes(Trace.load(out / "alone-hit-other-seed"), batched)


def test_vllm_and_sglang_traces_of_the_same_requests_are_byte_equal(pm, lane):
    root, model, out, _ = lane
    sgl = Trace.load(out / "batched")
    vllm = capture(pm, model, root / "vllm", seed=3)  # same prompts, seeds and decisions
    assert vllm.engine["name"] == "vllm" and sgl.engine["name"] == "sglang"
    assert vllm.contract_fingerprint == sgl.contract_fingerprint
    assert vllm.sampling.seeds == sgl.sampling.seeds and vllm.sampling.rule == sgl.sampling.rule
    assert same_bytes(vllm, sgl)
    assert not same_bytes(vllm, one_ulp_off(sgl))  # the comparator sees one ulp
    # control (an input): vLLM on the same requests with other seeds parts from SGLang's bytes
    other = capture(pm, model, root / "vllm-seed-4", seed=4)
    assert not same_bytes(other, sgl)


def test_chunked_prefill_gives_the_bytes_of_one_pass(lane):
    _, _, out, info = lane
    if "chunked" not in info["steps"]:
        pytest.skip("chunked prefill is captured for the dense lane only (one more engine start)")
    # 4-token chunks: the batch's prompts took more forward steps than one prefill.
    assert info["steps"]["chunked"] > info["steps"]["batched"], info["steps"]
    chunked, batched = Trace.load(out / "chunked"), Trace.load(out / "batched")
    assert same_bytes(chunked, batched)
    assert not same_bytes(chunked, one_ulp_off(batched))  # the comparator sees one ulp
    # control (an input): the chunked engine on other seeds parts from one pass's bytes
    assert not same_bytes(Trace.load(out / "chunked-other-seed"), batched)


def test_a_request_outside_the_rule_is_refused_and_the_engine_serves_on(lane):
    _, _, _, info = lane
    assert info["refused"] is not None, "SGLang accepted a top_k=5 request on the lane"
    assert "Lockstep exact lane: top_k=5 is not supported" in info["refused"]
    assert info["decisions_after"] == 2


# --- LoRA: SGLang's per-request adapters, the lane's programs ---------------------------------
BAD_ADAPTERS = ("corrupted", "wrong-contract", "wrong-dtype")


def bad_copy(adapter: Path, out: Path, how: str) -> Path:
    """A copy of ``adapter`` with one factor bit flipped (its recorded hash kept), or with
    every factor in fp32."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from lockstep_exact.adapters import WEIGHTS

    shutil.copytree(adapter, out)
    with safe_open(str(adapter / WEIGHTS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iter)
        meta = dict(f.metadata() or {})
    if how == "flip":
        key = sorted(tensors)[0]
        flipped = tensors[key].clone()
        flipped.view(torch.int16).view(-1)[0] ^= 1
        tensors[key] = flipped
    else:
        tensors = {k: v.float() for k, v in tensors.items()}
    save_file(tensors, str(out / WEIGHTS), metadata=meta)
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lora_lane(request, tmp_path_factory):
    from lockstep_exact.adapters import make_adapter

    root = tmp_path_factory.mktemp(f"sglang-lora-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=11)
    adapters = root / "adapters"
    a = make_adapter(model, adapters / "A", rank=8, seed=2)
    make_adapter(model, adapters / "B", rank=8, seed=5)
    make_adapter(model, adapters / "wrong-contract", rank=8, contract="sha256:" + "3" * 64)
    bad_copy(a, adapters / "corrupted", "flip")
    bad_copy(a, adapters / "wrong-dtype", "fp32")
    out = root / "sglang"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [PYTHON, str(SUPPORT), "lora", str(model), str(out), str(adapters), "8", "3"],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    info = json.loads((out / "lora.json").read_text())
    return root, model, adapters, out, info


def test_megatron_replays_sglang_lora_captures_byte_for_byte(pm, lora_lane):
    from lockstep_exact.testing import perturb_adapter

    root, model, adapters, out, _ = lora_lane
    for name in ("A", "B", "A-batched"):
        trace = Trace.load(out / name)
        adapter = adapters / name.removesuffix("-batched")
        assert trace.adapter_hash is not None and trace.num_decisions == 64
        replayed = replay(pm, model, out / name, adapter=adapter)
        cmp = compare(trace.logprobs, replayed)
        assert cmp.exact and cmp.k3_max == 0.0, f"{name}: {cmp}"
        assert not compare(one_ulp_off(trace).logprobs, replayed).exact  # the check can fail
    # The trainer on A with one factor moved by 2^-9 does not give the sampler's A bytes.
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    nudged = perturb_adapter(adapters / "A", root / "A-nudged", key)
    trace = Trace.load(out / "A")
    assert not compare(trace.logprobs, replay(pm, model, out / "A", nudged, control=True)).exact


def _run(trace: Trace, i: int) -> tuple[list[int], torch.Tensor]:
    return [int(t) for t in trace.sampled(i)], trace.sequence_logprobs(i)


def test_base_adapter_a_and_adapter_b_in_one_batch_each_equal_their_solo_runs(lora_lane):
    _, _, _, out, _ = lora_lane
    mixed = json.loads((out / "mixed.json").read_text())
    solo = {name: Trace.load(out / name) for name in ("base", "A", "B")}
    assert solo["base"].adapter_hash is None
    assert solo["A"].adapter_hash != solo["B"].adapter_hash
    assert mixed["adapters"][:3] == [None, "A", "B"]
    for i, (adapter, run) in enumerate(zip(mixed["adapters"], mixed["runs"], strict=True)):
        tokens, logprobs = _run(solo[adapter or "base"], i)
        got = torch.tensor(run["logprobs"], dtype=torch.float32)
        assert run["tokens"] == tokens, (i, adapter)
        assert torch.equal(got.view(torch.int32), logprobs.view(torch.int32)), (i, adapter)
        control = nudge_ulp(got, 0)  # the comparator sees one ulp
        assert not torch.equal(control.view(torch.int32), logprobs.view(torch.int32))
        # control (an input): the same batch with other seeds parts from the solo run
        other = mixed["runs-other-seed"][i]
        other_lp = torch.tensor(other["logprobs"], dtype=torch.float32)
        assert other["tokens"] != tokens or not torch.equal(
            other_lp.view(torch.int32), logprobs.view(torch.int32)
        ), (i, adapter)
    # A and B really are two adapters, and neither is the base model.
    for x, y in (("A", "B"), ("A", "base"), ("B", "base")):
        assert not same_bytes(solo[x], solo[y]), (x, y)


def test_one_adapter_batched_gives_the_bytes_of_one_request_at_a_time(lora_lane):
    _, _, _, out, _ = lora_lane
    alone, batched = Trace.load(out / "A"), Trace.load(out / "A-batched")
    assert alone.engine["batch"] is False and batched.engine["batch"] is True
    assert same_bytes(alone, batched)
    assert not same_bytes(alone, one_ulp_off(batched))  # the comparator sees one ulp
    # control (an input): the batch on A with other seeds parts from the requests alone
    assert not same_bytes(alone, Trace.load(out / "A-batched-other-seed"))


def test_vllm_and_sglang_lora_traces_of_the_same_requests_are_byte_equal(pm, lora_lane):
    root, model, adapters, out, _ = lora_lane
    sgl = Trace.load(out / "A")
    vllm = capture(pm, model, root / "vllm-A", adapter=adapters / "A", seed=3)
    assert vllm.adapter_hash == sgl.adapter_hash
    assert same_bytes(vllm, sgl)
    assert not same_bytes(vllm, one_ulp_off(sgl))  # the comparator sees one ulp
    # control (an input): vLLM on A with one factor moved by 2^-9 parts from SGLang's A bytes
    from lockstep_exact.testing import perturb_adapter

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    nudged = perturb_adapter(adapters / "A", root / "A-nudged-vllm", key)
    assert not same_bytes(capture(pm, model, root / "vllm-A-nudged", adapter=nudged, seed=3), sgl)


def test_adapters_the_lane_refuses_are_named_and_never_served(lora_lane):
    from lockstep_exact.adapters import AdapterError
    from lockstep_serving.common.capture import adapter_hash

    _, model, adapters, _, info = lora_lane
    assert sorted(info["refused"]) == list(BAD_ADAPTERS)
    for name in BAD_ADAPTERS:
        with pytest.raises(AdapterError) as err:
            adapter_hash(adapters / name, model)
        assert info["refused"][name] == f"Lockstep exact lane refused adapter {name}: {err.value}"
    # A request naming a refused adapter fails at SGLang's front end (never runs on the base).
    assert "has never been loaded: corrupted" in info["served_refused"]


# --- lockstep qualify --sampler sglang ------------------------------------------------------
def test_the_ladder_qualifies_with_sglang_as_the_sampler(tmp_path, capsys):
    from lockstep_exact.app.cli import main

    out = tmp_path / "q"
    argv = ["qualify", "--tiny", "qwen3", "--out", str(out), "--sampler", "sglang"]
    assert main([*argv, "--sampler-python", PYTHON]) == 0, capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["sampler"] == "sglang"
    assert [g["name"] for g in report["gates"]] == [
        "base ruler",
        "adapter A join",
        "training gate",
        "adapter B join",
        "promotion",
    ]
    promotion = report["gates"][-1]["checks"][0]
    assert promotion["decisions"] == promotion["byte_equal"] == 64
    controls = [c for g in report["gates"] for c in g["checks"] if not c["expect_exact"]]
    assert len(controls) == 2 and all(c["byte_equal"] < c["decisions"] for c in controls)
    engines = {e["role"]: e for e in report["engines"]}
    assert engines["sampler"]["engine"] == "sglang" and engines["sampler"]["engine_version"]
    assert engines["trainer"]["engine"] == "megatron-core"
    # every sampler-side trace came from SGLang
    for trace in sorted((out / "traces").iterdir()):
        assert Trace.load(trace).engine["name"] == "sglang", trace.name
    printed = capsys.readouterr().out
    assert f"sampler sglang {engines['sampler']['engine_version']}" in printed
    assert "first-divergence search (bisect) is not available there" in printed
