"""Shapes vLLM's own attention kernels refuse or rarely see, sampled by real vLLM on the lane's
attention backend and replayed by real Megatron: every decision's bytes are equal.

On a machine with AVX2 only, vLLM's CPU kernels refuse head_dim 8, 16 and 24 at every block
size (head_dim 16 passes on AVX-512 machines): the lane never runs them. Also one KV head, and
block sizes that are no multiple of 32 (16, 48, 5). 8 prompts x 8 decisions each (64).
"""

from __future__ import annotations

import pytest
from cross_support import capture, forge, nudged_copy, replay

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash
from lockstep_exact.plugins import manager

pytestmark = pytest.mark.engine

# name: (arch, geometry, sampler engine options)
SHAPES = {
    # the model of issue 10, at vLLM's default block size
    "hd16-moe": ("qwen3-moe", dict(hidden=96, heads=6, kv_heads=2, head_dim=16), {}),
    "hd8-mqa-b16": ("qwen3", dict(hidden=64, heads=4, kv_heads=1, head_dim=8), {"block_size": 16}),
    "hd24-b48": ("qwen3", dict(hidden=96, heads=4, kv_heads=2, head_dim=24), {"block_size": 48}),
    "hd16-kv3-b5": ("qwen3", dict(hidden=96, heads=6, kv_heads=3, head_dim=16), {"block_size": 5}),
}


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def odd(request, pm, tmp_path_factory):
    arch, geometry, options = SHAPES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny(root / "model", arch=arch, seed=11, **geometry)
    trace = capture(pm, model, root / "trace", **options)
    return request.param, root, model, trace


def test_megatron_replays_odd_shape_captures_byte_for_byte(pm, odd):
    name, root, model, trace = odd
    assert trace.num_decisions == 64 and trace.engine["name"] == "vllm"
    replayed = replay(pm, model, root / "trace")
    cmp = compare(trace.logprobs, replayed)
    assert cmp.exact and cmp.k3_max == 0.0, f"{name}: {cmp}"
    # control: the trainer on a copy with the final norm's element 0 one bf16 ulp off (the
    # trace admitted as if sampled from it) parts from the sampler's bytes at this shape
    copy = nudged_copy(model, root / "nudged-norm", "model.norm.weight")
    forged = forge(trace, root / "forged-norm", keep_rule=False, model_hash=model_hash(copy))
    cmp = compare(trace.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None, f"{name}: {cmp}"


@pytest.mark.parametrize("odd", ["hd16-moe"], indirect=True)
def test_a_one_ulp_k_norm_in_the_trainers_copy_is_caught_at_head_dim_16(pm, odd):
    _, root, model, trace = odd
    key = "model.layers.0.self_attn.k_norm.weight"  # every key the cache holds in layer 0
    copy = nudged_copy(model, root / "nudged", key)
    # The sampler's bytes, admitted as if sampled from the copy: only the model differs.
    forged = forge(trace, root / "forged", keep_rule=False, model_hash=model_hash(copy))
    cmp = compare(trace.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None and cmp.k3_max > 0.0
