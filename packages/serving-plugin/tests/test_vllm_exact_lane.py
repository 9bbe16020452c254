"""The exact lane inside the real vLLM engine: reference parity and invariance, byte for byte.

One engine per family does every run (alone, batch of 8, prefix-cache miss/hit, repeat,
prompt logprobs); a second one with a 16-token budget chunks the prefill. Tests compare.
Controls change an input on the same engines: a hit on pages whose first K entry is one ulp off,
and, last on each engine, the final norm's weight 0 one bf16 ulp up in place.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from serving_support import (
    FAMILIES,
    assert_same_bytes_and_comparator,
    nudge_engine_weight,
    nudge_every_page,
    nudged_weights,
    start_engine,
    stop_engine,
)

from lockstep_exact.app.tiny import default_prompts
from lockstep_exact.lanes import qwen3
from lockstep_exact.model import lane_contract
from lockstep_exact.parity import same_bytes

pytestmark = pytest.mark.engine  # starts real vLLM engines

DECISIONS = 6
PROMPTS = default_prompts(8)
TARGET = 6  # the 51-token prompt: longer than one 32-token KV block, so prefixes can hit


def _params(greedy: bool = False):
    from vllm import SamplingParams

    if greedy:
        # vLLM 0.32 on CPU crashes on a seeded request whose prefill is chunked (it rewinds
        # the generator: "CPU Generator does not use offset"), so chunking is compared greedy.
        return SamplingParams(temperature=0.0, max_tokens=DECISIONS, logprobs=0)
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=DECISIONS, logprobs=0, seed=7)


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    c = out.outputs[0]
    return list(c.token_ids), sampled_logprobs(c)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request, tiny_models):
    from vllm.inputs import TokensPrompt

    from lockstep_serving.vllm.offline import lane_fingerprint, prompt_logprobs

    model_dir = tiny_models[request.param]
    r = {"family": request.param, "model_dir": model_dir}
    llm = start_engine(model_dir)
    try:
        gen = lambda prompts: llm.generate(prompts, _params(), use_tqdm=False)  # noqa: E731
        r["fingerprint"] = lane_fingerprint(llm)
        llm.reset_prefix_cache()
        (r["miss"],) = gen([PROMPTS[TARGET]])
        (r["hit"],) = gen([PROMPTS[TARGET]])
        # control: a hit on the cached pages with their first K entry one ulp off
        llm.apply_model(nudge_every_page)
        (r["hit_moved"],) = gen([PROMPTS[TARGET]])
        llm.reset_prefix_cache()
        (r["repeat"],) = gen([PROMPTS[TARGET]])
        llm.reset_prefix_cache()
        r["batch"] = gen(PROMPTS)
        r["greedy_batch"] = llm.generate(PROMPTS, _params(greedy=True), use_tqdm=False)
        miss_tokens, _ = _decisions(r["miss"])
        full = list(r["miss"].prompt_token_ids) + miss_tokens
        from vllm import SamplingParams

        (pl,) = llm.generate(
            [TokensPrompt(prompt_token_ids=full)],
            SamplingParams(max_tokens=1, prompt_logprobs=0, seed=7),
            use_tqdm=False,
        )
        r["prompt_logprobs"] = prompt_logprobs(pl)
        # controls, last (the engine keeps the moved weight): the final norm's weight 0 one ulp
        llm.apply_model(nudge_engine_weight())
        llm.reset_prefix_cache()
        (r["moved"],) = gen([PROMPTS[TARGET]])
        (pl,) = llm.generate(
            [TokensPrompt(prompt_token_ids=full)],
            SamplingParams(max_tokens=1, prompt_logprobs=0, seed=7),
            use_tqdm=False,
        )
        r["prompt_logprobs_moved"] = prompt_logprobs(pl)
    finally:
        stop_engine(llm)
    llm = start_engine(model_dir, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        r["chunked_batch"] = llm.generate(PROMPTS, _params(greedy=True), use_tqdm=False)
        llm.apply_model(nudge_engine_weight())  # control: the moved weight, chunked
        (r["chunked_moved"],) = llm.generate(
            [PROMPTS[TARGET]], _params(greedy=True), use_tqdm=False
        )
    finally:
        stop_engine(llm)
    return r


def test_sampled_logprobs_equal_the_engine_free_reference_forward(runs):
    model_dir = runs["model_dir"]
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = qwen3.Geometry.from_model_dir(model_dir)

    def reference(weights, out):
        tokens, prompt = _decisions(out)[0], list(out.prompt_token_ids)
        ref = qwen3.forward_logprobs(weights, geom, torch.tensor(prompt + tokens))
        return torch.stack([ref[len(prompt) - 1 + j, t] for j, t in enumerate(tokens)])

    for i, out in enumerate(runs["batch"]):
        got = _decisions(out)[1]
        assert_same_bytes_and_comparator(reference(weights, out), got, f"{runs['family']} {i}")
    # control: the reference on the model with the final norm's weight 0 one ulp off
    moved = reference(nudged_weights(weights, "model.norm.weight"), runs["batch"][TARGET])
    assert not same_bytes(moved, _decisions(runs["batch"][TARGET])[1])


def test_decisions_alone_equal_decisions_inside_a_batch_of_8(runs):
    alone_tokens, alone = _decisions(runs["miss"])
    batch_tokens, batch = _decisions(runs["batch"][TARGET])
    assert alone_tokens == batch_tokens
    assert_same_bytes_and_comparator(alone, batch, "alone vs batch of 8")
    # control: the request alone on the engine with one weight one ulp off parts from the batch
    assert not same_bytes(_decisions(runs["moved"])[1], batch)


def test_decisions_do_not_depend_on_chunked_prefill(runs):
    assert len(runs["chunked_batch"][TARGET].prompt_token_ids) > 3 * 16  # 4 chunks at least
    pairs = zip(runs["greedy_batch"], runs["chunked_batch"], strict=True)
    for i, (whole, chunked) in enumerate(pairs):
        assert _decisions(whole)[0] == _decisions(chunked)[0]
        assert_same_bytes_and_comparator(
            _decisions(whole)[1], _decisions(chunked)[1], f"prompt {i}: one prefill vs chunks"
        )
    # control: the chunked engine with one weight one ulp off parts from one prefill
    whole = _decisions(runs["greedy_batch"][TARGET])[1]
    assert not same_bytes(whole, _decisions(runs["chunked_moved"])[1])


def test_decisions_on_a_prefix_cache_hit_equal_those_on_a_miss(runs):
    assert runs["miss"].num_cached_tokens == 0
    assert runs["hit"].num_cached_tokens > 0, "the second run should reuse cached KV blocks"
    miss_tokens, miss = _decisions(runs["miss"])
    hit_tokens, hit = _decisions(runs["hit"])
    assert miss_tokens == hit_tokens
    assert_same_bytes_and_comparator(miss, hit, "prefix-cache miss vs hit")
    # control: a hit on pages whose first K entry is one ulp off parts from the miss
    assert runs["hit_moved"].num_cached_tokens > 0
    assert not same_bytes(miss, _decisions(runs["hit_moved"])[1])


def test_repeated_runs_give_identical_decisions(runs):
    a_tokens, a = _decisions(runs["miss"])
    b_tokens, b = _decisions(runs["repeat"])
    assert a_tokens == b_tokens
    assert_same_bytes_and_comparator(a, b, "run 1 vs run 2")
    # control: the run on the engine with one weight one ulp off parts from run 1
    assert not same_bytes(a, _decisions(runs["moved"])[1])


def test_prompt_logprobs_equal_decode_logprobs_at_the_same_positions(runs):
    n_prompt = len(runs["miss"].prompt_token_ids)
    _, decode = _decisions(runs["miss"])
    # prompt_logprobs(...)[j] is the logprob of token j+1; sampled token i sits at n_prompt+i.
    prefill = runs["prompt_logprobs"][n_prompt - 1 : n_prompt - 1 + DECISIONS]
    assert_same_bytes_and_comparator(decode, prefill, "decode vs prompt logprobs")
    # control: the prefill on the engine with one weight one ulp off parts from the decode
    moved = runs["prompt_logprobs_moved"][n_prompt - 1 : n_prompt - 1 + DECISIONS]
    assert not same_bytes(decode, moved)


def test_the_engine_reports_the_contract_fingerprint_of_its_lane(runs):
    assert runs["fingerprint"] == lane_contract(runs["model_dir"]).fingerprint
