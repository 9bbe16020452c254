"""The lane's kernel warm-up: after vLLM's own, a lane model runs its programs once at each row
count that can bring a cuda kernel to compile (``model.warm_up_lane``), so a served engine
compiles nothing during its first requests.

What compiles is a cuda matter (the GPU suite's server bench counts JIT lines in the log after
start-up). Here: the row counts, the patch that calls the warm-up with the engine's limits, and
what the warm-up runs inside a real engine: every program the served steps run, through an Ops
of its own, leaving the engine's record and its bytes alone.
"""

from __future__ import annotations

import types

import pytest
from serving_support import start_engine, stop_engine

from lockstep_exact.app.tiny import make_tiny
from lockstep_serving.vllm import plugin
from lockstep_serving.vllm.model import warm_attention_requests, warm_rows


def test_the_row_counts_reach_every_gemm_tiling_bucket_on_and_off_the_16_grid():
    rows = warm_rows(8192)
    assert rows[0] == 1 and rows[-2:] == [8191, 8192]
    for lo, hi in ((2, 63), (64, 256), (257, 768), (769, 2048), (2049, 8192)):
        bucket = [n for n in rows if lo <= n <= hi]
        assert any(n % 16 == 0 for n in bucket) and any(n % 16 for n in bucket), (lo, hi)
    assert warm_rows(20) == [1, 2, 16, 17, 19, 20]
    assert warm_rows(1) == [1]


def test_the_prefill_attention_is_warmed_at_every_max_model_len():
    """Requests of several blocks and segments where the engine allows them, cut to its
    bound where not: an engine of max_model_len 1024 ran no warm-up attention and compiled
    the many-sequence kernel during its first burst (a JIT line in the server bench's log)."""
    assert warm_attention_requests(4096) == [(1, 1025), (17, 1040)]
    assert warm_attention_requests(1024) == [(1, 1024), (17, 1024)]
    assert warm_attention_requests(8) == [(1, 8), (8, 8)]
    assert warm_attention_requests(1) == [(1, 1)]


def test_the_patched_kernel_warmup_runs_vllms_then_the_lanes_with_the_engines_limits(
    monkeypatch,
):
    calls = []

    class Lane:
        def warm_up_lane(self, max_tokens, max_seqs):
            calls.append(("lane", max_tokens, max_seqs))

    worker = types.SimpleNamespace(
        get_model=lambda: Lane(),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=64),
    )
    monkeypatch.setattr(plugin, "_original_kernel_warmup", lambda: lambda w: calls.append("vllm"))
    plugin._lane_kernel_warmup()(worker)
    assert calls == ["vllm", ("lane", 2048, 64)]
    # a stock model (no warm_up_lane) gets vLLM's warm-up only
    calls.clear()
    worker.get_model = lambda: object()
    plugin._lane_kernel_warmup()(worker)
    assert calls == ["vllm"]


def _warm_under(model, *, max_positions: int) -> list[int]:
    """``model.warm(20, 3)`` as in an engine whose max_model_len is ``max_positions``."""
    kept = model.max_positions
    model.max_positions = max_positions
    try:
        return model.warm(20, 3)
    finally:
        model.max_positions = kept


@pytest.mark.engine
@pytest.mark.parametrize(
    "arch", [pytest.param("qwen3", marks=pytest.mark.slow), "qwen3-moe"]
)  # the MoE engine runs the dense programs too, and the grouped experts
def test_the_warm_up_runs_every_served_program_and_leaves_the_engine_alone(tmp_path, arch):
    from vllm import SamplingParams

    model = make_tiny(tmp_path / arch, arch=arch, seed=11)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, logprobs=0, seed=3)
    llm = start_engine(model)
    try:
        (before,) = llm.generate(["a warm start"], params, use_tqdm=False)
        served = llm.apply_model(lambda m: (dict(m.ops.invoked), m.warm_up_lane(64, 4)))[0]
        rows = llm.apply_model(lambda m: m.warm(20, 3))[0]
        # steps of more rows than max_model_len: the warm-up's positions stay in its bound
        short = llm.apply_model(lambda m: _warm_under(m, max_positions=8))[0]
        warm = llm.apply_model(lambda m: (dict(m.warm_ops.invoked), dict(m.ops.invoked)))[0]
        (after,) = llm.generate(["a warm start"], params, use_tqdm=False)
        other = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, logprobs=0, seed=4)
        (control,) = llm.generate(["a warm start"], other, use_tqdm=False)
    finally:
        stop_engine(llm)
    invoked, on_cpu = served
    assert on_cpu == []  # cpu compiles nothing: the engine's warm-up runs none there
    assert rows == [1, 2, 16, 17, 19, 20] and short == rows
    warm_sites, still = warm
    assert still == invoked  # the served record is what served
    assert set(invoked) - {"sample"} <= set(warm_sites)  # every program the steps ran
    assert warm_sites == {**warm_sites, **invoked}  # the same program at each site
    got = [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
           for o in (before.outputs[0], after.outputs[0], control.outputs[0])]  # fmt: skip
    assert got[0] == got[1]  # the warm-up moved no byte of a later request
    assert got[2] != got[0]  # control: another seed (an input) parts
