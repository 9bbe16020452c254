"""The lane's sampler inside the real vLLM engine: tokens drawn by sample.gumbel_topp.

One engine takes each prefill whole, a second chunks it by 16 tokens; both run seeded random
requests (which vLLM 0.32's own CPU sampler cannot do with chunked prefill). The tokens must be
the rule's draws over the engine-free reference rows, at the right positions.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from serving_support import (
    assert_same_bytes_and_comparator,
    nudge_engine_weight,
    start_engine,
    stop_engine,
)

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import default_prompts
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import same_bytes

pytestmark = pytest.mark.engine

DECISIONS = 6
PROMPTS = default_prompts(8)
TARGET = 6  # the 51-token prompt: four 16-token chunks at least
SEEDS = [100 + i for i in range(len(PROMPTS))]
# Per prompt: (temperature, top_p); greedy and nucleus rows share the batch with plain ones.
RULES = [
    (1.0, 1.0),
    (0.7, 0.9),
    (0.0, 1.0),
    (1.3, 1.0),
    (1.0, 0.5),
    (1.0, 1.0),
    (0.8, 0.95),
    (2.0, 1.0),
]


def _params(i: int):
    from vllm import SamplingParams

    temperature, top_p = RULES[i]
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=DECISIONS,
        ignore_eos=True,
        logprobs=0,
        seed=SEEDS[i],
    )


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    c = out.outputs[0]
    return list(c.token_ids), sampled_logprobs(c)


@pytest.fixture(scope="module")
def runs(tiny_models):
    model_dir = tiny_models["qwen3"]
    r = {"model_dir": model_dir}
    params = [_params(i) for i in range(len(PROMPTS))]
    llm = start_engine(model_dir, enable_chunked_prefill=False)
    try:
        r["whole"] = llm.generate(PROMPTS, params, use_tqdm=False)
        (r["alone"],) = llm.generate([PROMPTS[TARGET]], [params[TARGET]], use_tqdm=False)
        # control: the same request alone with another seed
        other = params[TARGET].clone()
        other.seed = SEEDS[TARGET] + 1000
        (r["alone_other_seed"],) = llm.generate([PROMPTS[TARGET]], [other], use_tqdm=False)
        r["refused"] = _refusals(llm)
        r["after_refusal"] = llm.generate([PROMPTS[TARGET]], [params[TARGET]], use_tqdm=False)
        r["unseeded"] = _unseeded(llm)
    finally:
        stop_engine(llm)
    llm = start_engine(
        model_dir, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8
    )
    try:
        r["chunked"] = llm.generate(PROMPTS, params, use_tqdm=False)
        # control, last (the engine keeps the moved weight): the final norm's weight 0 one ulp
        llm.apply_model(nudge_engine_weight())
        (r["chunked_moved"],) = llm.generate([PROMPTS[TARGET]], [params[TARGET]], use_tqdm=False)
    finally:
        stop_engine(llm)
    return r


UNSUPPORTED = {
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {3: 1.0},
    "allowed_token_ids": [1, 2, 3],
    "min_tokens": 2,
}


def _refusals(llm) -> dict[str, str]:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    out = {}
    for name, value in UNSUPPORTED.items():
        sp = SamplingParams(temperature=1.0, max_tokens=2, seed=1, **{name: value})
        try:
            llm.generate([PROMPTS[0]], [sp], use_tqdm=False)
        except VLLMValidationError as err:  # a client error (HTTP 400 on the server)
            out[name] = str(err)
        else:
            out[name] = "not refused"
    return out


def _unseeded(llm):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=DECISIONS, ignore_eos=True, logprobs=0)
    return llm.generate(PROMPTS[:2], [sp, sp], use_tqdm=False)


def test_tokens_are_the_rules_draws_over_the_reference_rows(runs):
    model_dir = runs["model_dir"]
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = qwen3.Geometry.from_model_dir(model_dir)
    for i, out in enumerate(runs["whole"]):
        tokens, _ = _decisions(out)
        prompt = list(out.prompt_token_ids)
        ref = qwen3.forward_logprobs(weights, geom, torch.tensor(prompt + tokens))
        rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        temperature, top_p = RULES[i]
        drawn = P.sample(
            rows,
            temperature=temperature,
            top_p=top_p,
            seeds=[SEEDS[i]] * len(tokens),
            positions=[len(prompt) + j for j in range(len(tokens))],
        )
        assert drawn.tolist() == tokens, f"prompt {i}"
        # Control: the seed of the next prompt draws another sequence somewhere.
        if temperature > 0:
            other = P.sample(
                rows,
                temperature=temperature,
                top_p=top_p,
                seeds=[SEEDS[i] + 1000] * len(tokens),
                positions=[len(prompt) + j for j in range(len(tokens))],
            )
            assert other.tolist() != tokens or top_p < 1, f"prompt {i}: the seed is unused"


def test_seeded_sampling_with_chunked_prefill_equals_one_prefill(runs):
    assert len(runs["chunked"][TARGET].prompt_token_ids) > 3 * 16
    for i, (whole, chunked) in enumerate(zip(runs["whole"], runs["chunked"], strict=True)):
        whole_tokens, whole_lps = _decisions(whole)
        chunked_tokens, chunked_lps = _decisions(chunked)
        assert whole_tokens == chunked_tokens, f"prompt {i}"
        assert_same_bytes_and_comparator(whole_lps, chunked_lps, f"prompt {i}: whole vs chunked")
    # control: the chunked engine with one weight one ulp off parts from one prefill
    whole = _decisions(runs["whole"][TARGET])[1]
    assert not same_bytes(whole, _decisions(runs["chunked_moved"])[1])


def test_the_same_seed_draws_the_same_tokens_alone_and_in_a_batch(runs):
    alone_tokens, alone = _decisions(runs["alone"])
    batch_tokens, batch = _decisions(runs["whole"][TARGET])
    assert alone_tokens == batch_tokens
    assert_same_bytes_and_comparator(alone, batch, "alone vs batch of 8")
    # control: the request alone with another seed draws other tokens
    other_tokens, other = _decisions(runs["alone_other_seed"])
    assert other_tokens != batch_tokens and not same_bytes(other, batch)
    after_tokens, _ = _decisions(runs["after_refusal"][0])
    assert after_tokens == alone_tokens  # refused requests left the engine serving


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_sampling_parameter_is_refused_by_name(runs, name):
    message = runs["refused"][name]
    assert f"Lockstep exact lane: {name}=" in message, message
    assert "sample.gumbel_topp" in message


def test_a_random_request_without_a_seed_still_samples(runs):
    for out in runs["unseeded"]:
        assert len(out.outputs[0].token_ids) == DECISIONS


def test_the_sampler_finds_the_lane_model_behind_a_cuda_graph_wrapper():
    """With CUDA graphs vLLM wraps the model (CUDAGraphWrapper); the runner's ``get_model``
    unwraps it. The sampler must see the lane model there, or it would sample with vLLM's
    own rule while the lane model runs (the defect the GPU graph tests first showed)."""
    from types import SimpleNamespace

    from lockstep_serving.vllm.model import LIVE
    from lockstep_serving.vllm.sampler import _is_lane_runner, runner_model

    inner = torch.nn.Linear(1, 1)
    LIVE.add(inner)
    wrapper = SimpleNamespace(unwrap=lambda: inner)
    runner = SimpleNamespace(model=wrapper, get_model=lambda: inner)
    assert runner_model(runner) is inner and _is_lane_runner(runner)
    assert not _is_lane_runner(SimpleNamespace(model=wrapper))  # the wrapper is not the lane
    assert runner_model(SimpleNamespace(model=inner)) is inner  # a runner without get_model
