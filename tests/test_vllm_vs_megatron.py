"""Real vLLM samples, real Megatron replays: every decision's logprob bytes are equal.

8 prompts of different lengths in one batch, 8 decisions each (64), dense and MoE, with and
without a LoRA adapter; the sampler's batching (vLLM's scheduler) and the trainer's (padded
micro-batches of 3) differ on purpose.
"""

from __future__ import annotations

import pytest
import torch
from cross_support import capture, forge, nudged_copy, replay

from lockstep_exact.adapters import make_adapter
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.plugins import manager
from lockstep_exact.programs import Program
from lockstep_exact.requests import CaptureRequest
from lockstep_exact.testing import perturb_adapter
from lockstep_exact.trace import Trace

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lane(request, pm, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny(root / "model", arch=request.param, seed=11)
    out = root / "base-trace"
    pm.hook.lockstep_capture(
        request=CaptureRequest(
            model_dir=model, prompts=tuple(default_prompts(8)), decisions=8, out_dir=out, seed=3
        )
    )
    return root, model, out


def test_megatron_replays_every_vllm_decision_byte_for_byte(pm, lane):
    _, model, trace_dir = lane
    trace = Trace.load(trace_dir)
    assert trace.num_decisions == 64 and trace.engine["name"] == "vllm"
    cmp = compare(trace.logprobs, replay(pm, model, trace_dir))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)


def test_a_one_ulp_model_copy_reports_the_first_differing_decision(pm, lane):
    root, model, trace_dir = lane
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    original = Trace.load(trace_dir)
    # The sampler's bytes, admitted as if sampled from the copy: only the model differs.
    forged = forge(original, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(original.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None and cmp.k3_max > 0.0


def test_zero_adapter_is_the_base_bytes_in_both_engines(pm, lane):
    root, model, trace_dir = lane
    zero = make_adapter(model, root / "zero", zero_b=True, seed=4)
    base = Trace.load(trace_dir)
    zt = capture(pm, model, root / "zero-trace", adapter=zero)
    assert torch.equal(zt.sampled_tokens, base.sampled_tokens)
    assert compare(base.logprobs, zt.logprobs).exact
    assert compare(zt.logprobs, replay(pm, model, root / "zero-trace", adapter=zero)).exact
    # control: the trainer on the zero adapter with one B element moved by 2^-9 parts from them
    moved = perturb_adapter(zero, root / "zero-pert", _down_proj_b(model))
    assert not compare(
        zt.logprobs, replay(pm, model, root / "zero-trace", adapter=moved, control=True)
    ).exact


def _down_proj_b(model) -> str:
    """A B factor of layer 0's MLP (expert 0's on the MoE lane)."""
    return (
        "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_B.weight"
        if (model / "config.json").read_text().count("Moe")
        else "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    )


def test_megatron_replays_vllm_lora_decisions_byte_for_byte(pm, lane):
    root, model, _ = lane
    ad = make_adapter(model, root / "A", seed=5)
    trace = capture(pm, model, root / "A-trace", adapter=ad)
    cmp = compare(trace.logprobs, replay(pm, model, root / "A-trace", adapter=ad))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)
    # control: the trainer on an adapter one factor 2^-9 away sees different bytes
    pert = perturb_adapter(ad, root / "A-pert", _down_proj_b(model))
    assert not compare(
        trace.logprobs, replay(pm, model, root / "A-trace", adapter=pert, control=True)
    ).exact


def _prompt_of_at_least(model, n_tokens: int) -> str:
    """English words appended one at a time until the model's tokenizer gives ``n_tokens`` or
    more (a word is 1-3 tokens here: count, never assume)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = " ".join(default_prompts(8)).split()
    text, i = words[0], 1
    while len(tok.encode(text).ids) < n_tokens:
        text += " " + words[i % len(words)]
        i += 1
    return text


@pytest.mark.slow  # the fast tier's 10-minute budget; CI's --all runs it
def test_megatron_replays_decisions_that_cross_an_attention_segment(pm, tmp_path):
    """Around attention.blocked's segment (512 keys): one prompt's prefill crosses it, another's
    decode steps do (vLLM decodes those rows one by one, Megatron takes them in one prefill);
    every decision's bytes are equal, and a one-ulp model copy is caught."""
    segment = Program.of("attention.blocked").param("segment")
    model = make_tiny(tmp_path / "model", arch="qwen3", seed=12)
    prompts = (
        _prompt_of_at_least(model, segment + 20),
        _prompt_of_at_least(model, segment - 12),
        default_prompts(1)[0],
    )
    out = tmp_path / "trace"
    pm.hook.lockstep_capture(
        request=CaptureRequest(model_dir=model, prompts=prompts, decisions=16, out_dir=out, seed=5)
    )
    trace = Trace.load(out)
    lens = [len(trace.prompt(i)) for i in range(3)]
    assert lens[0] > segment and lens[1] < segment < lens[1] + 16, lens
    cmp = compare(trace.logprobs, replay(pm, model, out))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)
    copy = nudged_copy(model, tmp_path / "nudged", "model.norm.weight")
    forged = forge(trace, tmp_path / "forged", keep_rule=False, model_hash=dir_hash(copy))
    assert not compare(trace.logprobs, replay(pm, copy, forged)).exact
