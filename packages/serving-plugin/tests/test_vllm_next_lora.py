"""LoRA on the qwen3-next lane inside the real vLLM engine: adapters per request
(``LoRARequest``), applied by ``lora.LaneLoRAManager`` through the shared composition.

One engine samples a batch mixing the base model, adapter A and adapter B (and A on a second
prompt), then each request alone; every request's decisions in the batch are its solo run's
bytes, A's are the composition's with A, and a zero adapter's the base model's. Prompt
lengths put a prefill across the 64-token gdn chunk and decode steps across it. A second
engine with a 24-token budget chunks the prefills (steps mixing adapters, chunks and decodes);
its greedy decisions are the composition's too. Every
comparison has a one-ulp negative control.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from serving_support import _ROOT, next_composition, start_engine, stop_engine

from lockstep_exact.adapters import load_adapter, make_adapter
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import assert_same_bytes, nudge_ulp, perturb_adapter
from lockstep_serving.vllm.patches import LaneRefused

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DECISIONS = 6
LENGTHS = (5, 61, 70)
BUDGET = 24  # the chunked engine's token budget
GDN_B = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"


def _same_and_comparator(a, b, what: str) -> None:
    """Byte-equal, and the comparator sees b moved by one ulp (no negative control: the tests'
    controls change an input, an adapter factor, and show the compared side moves)."""
    assert_same_bytes(a, b, what)
    assert not same_bytes(a, nudge_ulp(b)), f"{what}: the check misses a one-ulp change"


def _params(greedy: bool = False):
    from vllm import SamplingParams

    if greedy:  # vLLM 0.32 on CPU: a seeded request and a chunked prefill do not mix
        return SamplingParams(temperature=0.0, max_tokens=DECISIONS, logprobs=0, ignore_eos=True)
    return SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=DECISIONS, logprobs=0, seed=7, ignore_eos=True
    )


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    c = out.outputs[0]
    return list(c.token_ids), sampled_logprobs(c)


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny(_ROOT / "models" / "qwen3-next", arch="qwen3-next")


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    from lockstep_serving.vllm.lora import lora_request_for

    tmp = tmp_path_factory.mktemp("next-adapters")
    a = make_adapter(model_dir, tmp / "a", rank=8, seed=1)
    b = make_adapter(model_dir, tmp / "b", rank=8, seed=2)
    zero = make_adapter(model_dir, tmp / "zero", rank=8, zero_b=True)
    # the control: the zero adapter with one B element of the GDN in_proj moved by 2^-9
    zero_moved = perturb_adapter(zero, tmp / "zero-moved", GDN_B)
    gen = torch.Generator().manual_seed(16)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    # (prompt index, adapter): base, A, B, A again on another prompt, zero
    plan = [(0, None), (1, "a"), (2, "b"), (2, "a"), (1, "zero"), (1, None)]
    requests = {"a": lora_request_for(a, 1), "b": lora_request_for(b, 2)}
    requests["zero"] = lora_request_for(zero, 3)
    requests["zero-moved"] = lora_request_for(zero_moved, 4)
    r = {"prompts": prompts, "plan": plan, "dirs": {"a": a, "b": b, "zero": zero}}
    llm = start_engine(model_dir, enable_lora=True, max_loras=4, max_lora_rank=8)
    try:
        r["batch"] = _generate(llm, prompts, requests, plan)
        r["solo"] = [_generate(llm, prompts, requests, [item])[0] for item in plan]
        (r["zero_moved"],) = _generate(llm, prompts, requests, [(1, "zero-moved")])
    finally:
        stop_engine(llm)
    # chunked prefill: a 24-token budget splits the 61- and 70-token prefills (across the gdn
    # chunk boundary 64), and a step mixes one request's chunk with another's decode
    llm = start_engine(
        model_dir,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=8,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
    )
    try:
        r["chunked"] = _generate(llm, prompts, requests, plan, greedy=True)
    finally:
        stop_engine(llm)
    return r


def _generate(llm, prompts, requests, items, greedy=False):
    from vllm.inputs import TokensPrompt

    return llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[i]) for i, _ in items],
        _params(greedy),
        lora_request=[requests[k] if k else None for _, k in items],
        use_tqdm=False,
    )


@pytest.mark.engine
def test_base_a_and_b_in_one_batch_each_equal_their_solo_runs(runs):
    for (i, k), batch, solo in zip(runs["plan"], runs["batch"], runs["solo"], strict=True):
        bt, blp = _decisions(batch)
        st, slp = _decisions(solo)
        assert bt == st, f"prompt {i} adapter {k}"
        _same_and_comparator(slp, blp, f"prompt {i}, adapter {k}: batch vs solo")
    # control: prompt 1 alone under the zero adapter with one factor moved parts from the
    # batched prompt 1 under the zero adapter
    moved_tokens, moved = _decisions(runs["zero_moved"])
    zero_tokens, zero = _decisions(runs["batch"][4])
    assert moved_tokens != zero_tokens or not same_bytes(moved, zero)
    # the adapters are really different: the same prompt under A and under B differs
    _, a = _decisions(runs["batch"][3])
    _, b = _decisions(runs["batch"][2])
    assert not same_bytes(a, b)


def _equal_the_composition(runs, model_dir, key: str, what: str) -> None:
    """Each request of ``runs[key]`` (prompt i under adapter k, base for k = 0) has the
    decisions of one composition forward over its prompt and sampled tokens, byte for byte."""
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = N.Geometry.from_model_dir(model_dir)
    base = ModelDir(model_dir, hybrid=True)
    for (i, k), out in zip(runs["plan"], runs[key], strict=True):
        tokens, got = _decisions(out)
        prompt = runs["prompts"][i]
        mods = load_adapter(runs["dirs"][k], base).modules if k else None
        want = next_composition(weights, geom, prompt, tokens, adapters=mods)
        _same_and_comparator(want, got, f"prompt {i}, adapter {k}: {what} vs composition")
        if k == "a":  # control: the composition on A with one B element moved by 2^-9
            key = next(m for m in mods if "in_proj_qkvz" in m)
            fa, fb, scale = mods[key]
            fb_moved = fb.float().clone()
            fb_moved.view(-1)[0] += 2.0**-9
            moved = {**mods, key: (fa, fb_moved.to(fb.dtype), scale)}
            moved_lp = next_composition(weights, geom, prompt, tokens, adapters=moved)
            assert not same_bytes(moved_lp, got), f"prompt {i}: a moved factor is missed"


@pytest.mark.engine
def test_an_adapter_request_equals_the_composition_with_that_adapter(runs, model_dir):
    _equal_the_composition(runs, model_dir, "batch", "vLLM")


@pytest.mark.engine
def test_chunked_prefills_with_adapters_equal_the_composition(runs, model_dir):
    _equal_the_composition(runs, model_dir, "chunked", "chunked vLLM")


@pytest.mark.engine
def test_the_zero_adapter_gives_exactly_the_base_bytes(runs):
    zero_tokens, zero = _decisions(runs["batch"][4])
    base_tokens, base = _decisions(runs["batch"][5])
    assert zero_tokens == base_tokens
    _same_and_comparator(base, zero, "zero adapter vs base")
    # control: the zero adapter with one B element moved by 2^-9 parts from the base bytes
    moved_tokens, moved = _decisions(runs["zero_moved"])
    assert moved_tokens != base_tokens or not same_bytes(moved, base)


def test_the_lora_manager_refuses_an_adapter_of_another_contract(model_dir, tmp_path):
    from types import SimpleNamespace

    from lockstep_exact.model import geometry_contract
    from lockstep_serving.vllm.lora import LaneLoRAManager, lora_request_for

    geom = N.Geometry.from_model_dir(model_dir)
    model = SimpleNamespace(
        geom=geom, model_dir=model_dir, contract=geometry_contract(geom), device=None
    )
    manager = LaneLoRAManager(model, max_loras=2)
    bad = make_adapter(model_dir, tmp_path / "bad", rank=8, contract="sha256:" + "3" * 64)
    with pytest.raises(
        LaneRefused, match=r"refused adapter lockstep-bad: adapter was made for contract sha256:3"
    ):
        manager.add_adapter(lora_request_for(bad))
    good = make_adapter(model_dir, tmp_path / "good", rank=8)
    assert manager.add_adapter(lora_request_for(good, 2))


def test_lora_is_no_longer_refused_at_start(model_dir):
    from types import SimpleNamespace

    from lockstep_serving.vllm.next import check_hybrid

    geom = N.Geometry.from_model_dir(model_dir)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            enable_prefix_caching=False, mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        lora_config=object(),
    )
    check_hybrid(config, geom)


def test_tokens_of_an_adapter_not_loaded_are_refused(model_dir, monkeypatch):
    from test_vllm_next import _bare_model, _state_md

    from lockstep_serving.vllm.next import STATE_PREFIX

    model = _bare_model(model_dir, {STATE_PREFIX.format(0): _state_md([0, 3], [3])}, monkeypatch)
    model.set_token_adapters((7, 7, 7), {})
    with pytest.raises(
        LaneRefused, match=r"tokens of adapter id 7 arrived before the adapter was loaded"
    ):
        model.forward(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]))
