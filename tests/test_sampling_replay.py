"""Real vLLM samples with chunked prefill on; real Megatron replays the bytes and the tokens.

The capture chunks every prefill by 16 tokens (prompts up to 51 tokens) with seeded random
requests at temperature 0.8 and top-p 0.9: vLLM 0.32's own CPU sampler crashes there, the lane's
sampler does not. Replay recomputes each logprob byte for byte and checks that each sampled
token is the one the trace's rule draws from Megatron's own row; a trace with one token changed
is refused, naming that decision.
"""

from __future__ import annotations

import pytest
from cross_support import forge, nudged_copy, replay

from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.plugins import manager
from lockstep_exact.requests import CaptureRequest
from lockstep_exact.trace import Trace

pytestmark = pytest.mark.engine

CHUNK = 16


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module")
def chunked(pm, tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    model = make_tiny(root / "model", arch="qwen3", seed=11)
    out = root / "trace"
    pm.hook.lockstep_capture(
        request=CaptureRequest(
            model_dir=model,
            prompts=tuple(default_prompts(8)),
            decisions=8,
            out_dir=out,
            seed=3,
            temperature=0.8,
            top_p=0.9,
            options={
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": CHUNK,
                "max_num_seqs": 8,
            },
        )
    )
    return root, model, out


def test_a_chunked_prefill_capture_records_the_rule_and_every_seed(chunked):
    _, _, trace_dir = chunked
    trace = Trace.load(trace_dir)
    assert max(len(trace.prompt(i)) for i in range(trace.num_sequences)) > 3 * CHUNK
    s = trace.sampling
    assert (s.temperature, s.top_p, s.rule) == (0.8, 0.9, "sample.gumbel_topp@1{rounds=3}")
    assert s.seeds == tuple(3 + i for i in range(8))


def test_megatron_replays_a_chunked_prefill_capture_byte_for_byte_tokens_checked(pm, chunked):
    _, model, trace_dir = chunked
    trace = Trace.load(trace_dir)
    cmp = compare(trace.logprobs, replay(pm, model, trace_dir))
    assert trace.num_decisions == 64 and cmp.exact and cmp.k3_max == 0.0, str(cmp)


def test_control_megatron_on_a_one_ulp_model_copy_parts_from_the_chunked_capture(pm, chunked):
    """The trace admitted as if sampled from a copy with one norm weight one bf16 ulp off
    (without its rule: the tokens are not re-drawn), replayed: the logprob bytes differ."""
    root, model, trace_dir = chunked
    original = Trace.load(trace_dir)
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    forged = forge(original, root / "forged-model", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(original.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None, str(cmp)


def test_a_trace_with_one_token_changed_is_refused_naming_the_decision(pm, chunked):
    root, model, trace_dir = chunked
    from lockstep_megatron.replay import TokenMismatch

    original = Trace.load(trace_dir)
    seq, step = 2, 3
    sampled = [original.sampled(i).clone() for i in range(original.num_sequences)]
    old = int(sampled[seq][step])
    sampled[seq][step] = (old + 1) % 1024
    forged = forge(original, root / "forged", sampled=sampled)
    position = len(original.prompt(seq)) + step
    with pytest.raises(TokenMismatch) as err:
        replay(pm, model, forged)
    message = str(err.value)
    assert f"sequence {seq}, position {position} (step {step})" in message, message
    assert f"the trace has token {(old + 1) % 1024} but sample.gumbel_topp" in message
    assert f"draws {old}" in message
