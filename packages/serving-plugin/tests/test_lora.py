"""LoRA on the exact lane: per-request adapters through vLLM's plumbing, byte for byte."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from serving_support import (
    FAMILIES,
    assert_same_bytes_and_comparator,
    start_engine,
    stop_engine,
)

from lockstep_exact.adapters import PREFIX, AdapterError, load_adapter, make_adapter
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import perturb_adapter

pytestmark = pytest.mark.engine  # starts real vLLM engines

BASE_PROMPT, LORA_PROMPT = "The river runs past the old mill", "Question: Why is the sky blue?"


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=5, logprobs=0, seed=11, **kw)


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    return list(out.outputs[0].token_ids), sampled_logprobs(out.outputs[0])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tiny_models, tmp_path_factory):
    from lockstep_serving.vllm.lora import lora_request_for

    model_dir = tiny_models[request.param]
    tmp = tmp_path_factory.mktemp(f"adapters-{request.param}")
    adapter = make_adapter(model_dir, tmp / "lora", rank=8)
    zero = make_adapter(model_dir, tmp / "zero", rank=8, zero_b=True)
    factor = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"
    nudged = perturb_adapter(adapter, tmp / "nudged", factor, delta=2.0**-9)
    other = make_adapter(model_dir, tmp / "other", rank=8, seed=5)  # adapter B
    # the zero adapter with one B element moved: the control of the base rows
    zero_nudged = perturb_adapter(zero, tmp / "zero-nudged", factor, delta=2.0**-9)
    lora, zero_req, nudged_req, other_req, zero_nudged_req = (
        lora_request_for(d, i)
        for i, d in ((1, adapter), (2, zero), (3, nudged), (4, other), (5, zero_nudged))
    )
    r = {"family": request.param, "model_dir": model_dir, "adapter": adapter}
    llm = start_engine(model_dir, enable_lora=True, max_loras=5, max_lora_rank=8)
    try:

        def gen(prompts, loras, **kw):
            return llm.generate(prompts, _params(**kw), lora_request=loras, use_tqdm=False)

        (r["base_solo"],) = gen([BASE_PROMPT], None)
        (r["lora_solo"],) = gen([LORA_PROMPT], lora)
        r["mixed"] = gen([BASE_PROMPT, LORA_PROMPT], [None, lora])
        (r["other_solo"],) = gen([LORA_PROMPT], other_req)
        r["mixed_two"] = gen([BASE_PROMPT, LORA_PROMPT, LORA_PROMPT], [None, lora, other_req])
        (r["zero_on_base_prompt"],) = gen([BASE_PROMPT], zero_req)
        (r["nudged"],) = gen([LORA_PROMPT], nudged_req)
        (r["zero_nudged_on_base_prompt"],) = gen([BASE_PROMPT], zero_nudged_req)
        # Upstream, LoRA + prompt_logprobs with 2+ prompts crashes in punica; the lane has none.
        r["prompt_logprobs"] = gen([BASE_PROMPT, LORA_PROMPT], [lora, lora], prompt_logprobs=0)
    finally:
        stop_engine(llm)
    return r


def test_a_lora_request_equals_the_reference_forward_with_that_adapter(runs):
    model_dir = runs["model_dir"]
    geom = qwen3.Geometry.from_model_dir(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    adapters = load_adapter(runs["adapter"], geom).modules
    tokens, got = _decisions(runs["lora_solo"])
    prompt = list(runs["lora_solo"].prompt_token_ids)

    def reference(adapters):
        ref = qwen3.forward_logprobs(
            weights, geom, torch.tensor(prompt + tokens), adapters=adapters
        )
        return torch.stack([ref[len(prompt) - 1 + j, t] for j, t in enumerate(tokens)])

    assert_same_bytes_and_comparator(
        reference(adapters), got, f"{runs['family']} lora vs reference"
    )
    # control: the reference on the adapter with one factor element moved by 2^-9 parts from it
    assert not same_bytes(reference(_moved(adapters)), got)


def _moved(adapters):
    """The adapter's modules with element 0 of one q_proj B factor moved by 2^-9 (what
    ``perturb_adapter`` does to a file; one bf16 ulp of B is absorbed where q_proj's output is
    rounded to bf16)."""
    key = next(k for k in adapters if k.endswith("q_proj.weight"))
    a, b, scale = adapters[key]
    moved = b.float().clone()
    moved.view(-1)[0] += 2.0**-9
    return {**adapters, key: (a, moved.to(b.dtype), scale)}


def _controls(runs, base_row, lora_row):
    """The input controls of a batch-vs-solo check: the same prompt with one adapter factor
    moved by 2^-9 (the zero adapter on the base prompt, adapter A on the lora prompt), run
    alone on the same engine, parts from the batched row."""
    base_moved = _decisions(runs["zero_nudged_on_base_prompt"])
    lora_moved = _decisions(runs["nudged"])
    for moved, row, what in ((base_moved, base_row, "base"), (lora_moved, lora_row, "lora")):
        tokens, lps = _decisions(row)
        assert moved[0] != tokens or not same_bytes(moved[1], lps), f"{what}: control"


def test_lora_and_base_requests_in_one_batch_each_equal_their_solo_runs(runs):
    base_batch, lora_batch = runs["mixed"]
    for solo, batched, what in (
        (runs["base_solo"], base_batch, "base"),
        (runs["lora_solo"], lora_batch, "lora"),
    ):
        assert _decisions(solo)[0] == _decisions(batched)[0]
        assert_same_bytes_and_comparator(_decisions(solo)[1], _decisions(batched)[1], what)
    _controls(runs, base_batch, lora_batch)


def test_base_adapter_a_and_adapter_b_in_one_batch_each_equal_their_solo_runs(runs):
    base_batch, a_batch, b_batch = runs["mixed_two"]
    for solo, batched, what in (
        (runs["base_solo"], base_batch, "base"),
        (runs["lora_solo"], a_batch, "adapter A"),
        (runs["other_solo"], b_batch, "adapter B"),
    ):
        assert _decisions(solo)[0] == _decisions(batched)[0]
        assert_same_bytes_and_comparator(_decisions(solo)[1], _decisions(batched)[1], what)
    # the two adapters are really two: the same prompt under A and under B differs
    assert not same_bytes(_decisions(a_batch)[1], _decisions(b_batch)[1])
    _controls(runs, base_batch, a_batch)


def test_the_zero_adapter_gives_exactly_the_base_bytes(runs):
    assert _decisions(runs["zero_on_base_prompt"])[0] == _decisions(runs["base_solo"])[0]
    assert_same_bytes_and_comparator(
        _decisions(runs["base_solo"])[1], _decisions(runs["zero_on_base_prompt"])[1], "zero"
    )
    # control: the zero adapter with one B element moved by 2^-9 parts from the base bytes
    tokens, moved = _decisions(runs["zero_nudged_on_base_prompt"])
    base_tokens, base = _decisions(runs["base_solo"])
    assert tokens != base_tokens or not same_bytes(moved, base)


def test_a_factor_moved_by_2_to_the_minus_9_changes_the_bytes(runs):
    tokens, lora = _decisions(runs["lora_solo"])
    nudged_tokens, nudged = _decisions(runs["nudged"])
    assert tokens != nudged_tokens or not same_bytes(lora, nudged)


def test_prompt_logprobs_of_two_lora_prompts_equal_the_reference_forward(runs):
    from lockstep_serving.vllm.offline import prompt_logprobs

    model_dir = runs["model_dir"]
    geom = qwen3.Geometry.from_model_dir(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    adapters = load_adapter(runs["adapter"], geom).modules
    for out in runs["prompt_logprobs"]:
        ids = list(out.prompt_token_ids)
        ref = qwen3.forward_logprobs(weights, geom, torch.tensor(ids), adapters=adapters)
        want = torch.stack([ref[j, ids[j + 1]] for j in range(len(ids) - 1)])
        assert_same_bytes_and_comparator(want, prompt_logprobs(out), "lora prompt logprobs")
        # control: the reference on the adapter with one factor element moved by 2^-9
        moved = qwen3.forward_logprobs(weights, geom, torch.tensor(ids), adapters=_moved(adapters))
        moved = torch.stack([moved[j, ids[j + 1]] for j in range(len(ids) - 1)])
        assert not same_bytes(moved, prompt_logprobs(out))
    assert _decisions(runs["prompt_logprobs"][1])[0] == _decisions(runs["lora_solo"])[0]


def test_an_adapter_made_for_another_contract_is_refused(tiny_models, tmp_path):
    from lockstep_serving.common.capture import adapter_hash

    model_dir = tiny_models["qwen3"]
    bad = make_adapter(model_dir, tmp_path / "other", rank=8, contract="sha256:" + "3" * 64)
    with pytest.raises(AdapterError, match="made for contract sha256:3+"):
        adapter_hash(bad, model_dir)


def test_an_export_for_another_base_model_is_refused(tiny_models, tmp_path):
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_serving.common.capture import adapter_hash

    model_dir = tiny_models["qwen3"]
    other = make_tiny(tmp_path / "other", arch="qwen3", seed=9)  # same shapes, other bytes
    ad = make_adapter(model_dir, tmp_path / "a", rank=8)
    with pytest.raises(AdapterError, match="made for base model [0-9a-f]{64}; this base model"):
        adapter_hash(ad, other)


def test_a_peft_adapter_is_hashed_on_load(tiny_models, tmp_path):
    pytest.importorskip("peft")
    from peft_support import peft_adapter

    from lockstep_exact.model import ModelDir
    from lockstep_serving.common.capture import adapter_hash

    model_dir = tiny_models["qwen3-moe"]
    ad = peft_adapter(model_dir, tmp_path / "p", r=4, lora_alpha=8, target_modules=["v_proj"])
    assert adapter_hash(ad, model_dir) == load_adapter(ad, ModelDir(model_dir)).sha256


def test_the_lora_manager_refuses_an_adapter_of_another_base_model(tiny_models, tmp_path):
    from types import SimpleNamespace

    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.model import ModelDir
    from lockstep_serving.vllm.lora import LaneLoRAManager, lora_request_for
    from lockstep_serving.vllm.patches import LaneRefused

    model_dir = tiny_models["qwen3"]
    other = ModelDir(make_tiny(tmp_path / "other", arch="qwen3", seed=9))
    served = SimpleNamespace(geom=other.geometry, contract=other.contract(), model_dir=other.path)
    manager = LaneLoRAManager(served, max_loras=1)
    ad = make_adapter(model_dir, tmp_path / "a", rank=8)
    with pytest.raises(LaneRefused, match="refused adapter lockstep-a: adapter was made for base"):
        manager.add_adapter(lora_request_for(ad))


def test_a_sampler_session_checks_adapters_against_its_own_backend(tmp_path, monkeypatch):
    """``lockstep train``'s long-lived engine hands each adapter to the check of its backend's
    lane (a cuda session once checked against the cpu lane and refused every cuda export)."""
    from lockstep_serving.vllm import session

    seen = []
    monkeypatch.setattr(session, "adapter_hash", lambda *a: seen.append(a) or "sha")
    monkeypatch.setattr(session, "lora_request_for", lambda path, lora_int_id: (path, lora_int_id))
    sampler = object.__new__(session.VllmSampler)  # no engine: only the adapter bookkeeping
    sampler.model, sampler.backend = "MODEL", "cuda"
    sampler._ids, sampler._active, sampler.adapter_id = {}, None, None
    (tmp_path / "a").mkdir()
    request, digest = sampler._lora(tmp_path / "a")
    assert seen == [((tmp_path / "a").resolve(), "MODEL", "cuda")] and digest == "sha"
    assert request == ((tmp_path / "a").resolve(), 1)
