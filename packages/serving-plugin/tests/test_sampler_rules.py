"""The lane sampler's admission and per-row rule, without an engine (vLLM's own
SamplingParams, a stand-in runner)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import serving_support  # noqa: F401  (the environment, before vLLM is imported)
import torch

from lockstep_serving.vllm.patches import LaneRefused
from lockstep_serving.vllm.sampler import prepare, refusal, rows_of


def params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**kw)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("top_k", 5, "top-k truncation"),
        ("min_p", 0.1, "min-p truncation"),
        ("presence_penalty", 0.5, "a penalty"),
        ("frequency_penalty", -0.5, "a penalty"),
        ("repetition_penalty", 1.2, "a penalty"),
        ("logit_bias", {3: 1.0}, "a logit bias"),
        ("allowed_token_ids", [1, 2], "a mask"),
        ("bad_words", ["x"], "a mask"),
        ("min_tokens", 2, "EOS included, even with ignore_eos"),
        ("thinking_token_budget", 8, "forced tokens"),
        ("watermarking", True, "a watermark bias"),
        ("seed", 2**64, "a seed outside int64"),
    ],
)
def test_each_parameter_outside_the_rule_is_refused_by_name(name, value, why):
    message = refusal(params(temperature=1.0, **{name: value}))
    assert message is not None and message.startswith(f"Lockstep exact lane: {name}=")
    assert why in message and "sample.gumbel_topp@1{rounds=3}" in message


def test_structured_output_is_refused_by_name():
    from vllm.sampling_params import StructuredOutputsParams

    sp = params(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert refusal(sp).startswith("Lockstep exact lane: structured_outputs=")


def test_admission_raises_a_client_error_naming_the_parameter():
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="Lockstep exact lane: top_k=5") as err:
        prepare(params(top_k=5, seed=1))
    assert err.value.parameter == "top_k"


def test_admission_seeds_a_random_request_once_and_leaves_greedy_and_seeded_ones():
    sp = params(temperature=1.0)
    prepare(sp)
    seed = sp.seed
    assert isinstance(seed, int) and 0 <= seed < 2**63
    prepare(sp)
    assert sp.seed == seed
    greedy = params(temperature=0.0)
    prepare(greedy)
    assert greedy.seed is None
    seeded = params(temperature=0.7, seed=42)
    prepare(seeded)
    assert seeded.seed == 42


def _runner(*sps, lens=(5, 9)):
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[f"r{i}" for i in range(len(sps))]),
        requests={f"r{i}": SimpleNamespace(sampling_params=sp) for i, sp in enumerate(sps)},
        optimistic_seq_lens_cpu=torch.tensor(list(lens) + [0, 0], dtype=torch.int32),
    )


def test_rows_give_greedy_temperature_zero_and_the_position_of_the_token_being_chosen():
    runner = _runner(params(temperature=0.0), params(temperature=0.7, top_p=0.9, seed=11))
    temps, tops, seeds, positions = rows_of(runner, 2)
    assert temps == [0.0, pytest.approx(0.7)] and tops[0] == 1.0 and seeds == [0, 11]
    assert positions.tolist() == [5, 9] and positions.dtype == torch.int64


def test_a_random_row_without_a_seed_stops_the_lane():
    with pytest.raises(LaneRefused, match="request r1 reached the lane's sampler without a seed"):
        rows_of(_runner(params(temperature=0.0), params(temperature=1.0)), 2)


def test_a_row_whose_parameters_slipped_past_admission_stops_the_lane():
    with pytest.raises(LaneRefused, match="request r0: Lockstep exact lane: min_p=0.2"):
        rows_of(_runner(params(temperature=1.0, min_p=0.2, seed=1)), 1)
