"""The lane sampler's admission and per-row rule, without an engine (vLLM's own
SamplingParams, a stand-in runner)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import serving_support  # noqa: F401  (the environment, before vLLM is imported)
import torch

from lockstep_serving.vllm import sampler as lane_sampler
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


def test_a_requests_rule_is_read_once_and_a_new_request_under_its_id_is_read_again(monkeypatch):
    calls = []
    real = lane_sampler.rule_of

    def counted(rid, sp):
        calls.append(rid)
        return real(rid, sp)

    monkeypatch.setattr(lane_sampler, "rule_of", counted)
    runner = _runner(params(temperature=0.0), params(temperature=0.7, seed=11))
    for _ in range(3):
        assert rows_of(runner, 2)[2] == [0, 11]
    assert calls == ["r0", "r1"]
    # the same id, a new request (new SamplingParams): read again, and its seed is used
    runner.requests["r1"] = SimpleNamespace(sampling_params=params(temperature=0.7, seed=12))
    assert rows_of(runner, 2)[2] == [0, 12] and calls == ["r0", "r1", "r1"]
    # a request that slipped past admission is refused on its first step, not cached
    runner.requests["r1"] = SimpleNamespace(sampling_params=params(temperature=1.0, min_p=0.2))
    with pytest.raises(LaneRefused, match="request r1: Lockstep exact lane: min_p=0.2"):
        rows_of(runner, 2)


def test_the_rule_cache_forgets_requests_that_left_the_batch():
    many = [params(temperature=0.5, seed=i) for i in range(80)]
    runner = _runner(*many, lens=range(80))
    rows_of(runner, 80)
    runner.input_batch.req_ids = ["r0"]
    rows_of(runner, 1)
    assert set(runner._lockstep_rule_rows._by_id) == {"r0"}


def test_a_token_the_rule_could_not_draw_is_refused_by_request_when_it_reaches_the_host():
    lane_sampler.refuse_undrawn(torch.tensor([[3], [0], [7]], dtype=torch.int32), ["a", "b", "c"])
    with pytest.raises(LaneRefused, match="request b: sample.gumbel_topp drew no token"):
        lane_sampler.refuse_undrawn(torch.tensor([[3], [-1], [-1]], dtype=torch.int32), "abc")


class _AsyncOutput:
    """What AsyncGPUModelRunnerOutput holds before get_output: the device tokens (here a cpu
    tensor) and, once the original ran, their host copy."""

    def __init__(self, tokens):
        self._sampled_token_ids = tokens
        self.sampled_token_ids_cpu = tokens.clone()


def test_the_async_output_check_refuses_only_a_lane_steps_undrawn_token(monkeypatch):
    from lockstep_serving.vllm import patches

    def original(self):
        del self._sampled_token_ids  # as vLLM's get_output releases the device tensor
        return "output"

    monkeypatch.setattr(patches.TABLE, "original", lambda name: original)
    lane = torch.tensor([[5], [-1]], dtype=torch.int32)
    setattr(lane, lane_sampler.UNCHECKED, ["r0", "r1"])
    with pytest.raises(LaneRefused, match="request r1: sample.gumbel_topp drew no token"):
        lane_sampler.checked_output(_AsyncOutput(lane))
    good = torch.tensor([[5], [6]], dtype=torch.int32)
    setattr(good, lane_sampler.UNCHECKED, ["r0", "r1"])
    assert lane_sampler.checked_output(_AsyncOutput(good)) == "output"
    # another engine's output (no mark) is handed on untouched, whatever it holds
    assert lane_sampler.checked_output(_AsyncOutput(torch.tensor([[-1]]))) == "output"
