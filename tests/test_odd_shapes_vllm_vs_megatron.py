"""Shapes vLLM's own attention kernels refuse or rarely see, sampled by real vLLM on the lane's
attention backend and replayed by real Megatron: every decision's bytes are equal.

On a machine with AVX2 only, vLLM's CPU kernels refuse head_dim 8, 16 and 24 at every block
size (head_dim 16 passes on AVX-512 machines): the lane never runs them. Also one KV head, and
block sizes that are no multiple of 32 (16, 48, 5). 8 prompts x 8 decisions each (64).
"""

from __future__ import annotations

import pytest
from cross_support import capture, replay
from safetensors.torch import load_file, save_file

from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash
from lockstep_exact.parity import nudge_ulp
from lockstep_exact.plugins import manager
from lockstep_exact.tiny import make_tiny
from lockstep_exact.trace import Trace

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
    # control: the comparison sees a one-ulp change of a single decision
    assert not compare(trace.logprobs, nudge_ulp(replayed, 37)).exact


@pytest.mark.parametrize("odd", ["hd16-moe"], indirect=True)
def test_a_one_ulp_k_norm_in_the_trainers_copy_is_caught_at_head_dim_16(pm, odd):
    _, root, model, trace = odd
    copy = root / "nudged"
    copy.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    w = load_file(str(model / "model.safetensors"))
    key = "model.layers.0.self_attn.k_norm.weight"  # every key the cache holds in layer 0
    w[key] = nudge_ulp(w[key], 0)
    save_file(w, str(copy / "model.safetensors"))
    # The sampler's bytes, admitted as if sampled from the copy: only the model differs.
    forged = Trace.from_sequences(
        [trace.prompt(i) for i in range(trace.num_sequences)],
        [trace.sampled(i) for i in range(trace.num_sequences)],
        [trace.sequence_logprobs(i) for i in range(trace.num_sequences)],
        contract_fingerprint=trace.contract_fingerprint,
        contract=trace.contract,
        model_hash=model_hash(copy),
    ).save(root / "forged")
    cmp = compare(trace.logprobs, replay(pm, copy, forged))
    assert not cmp.exact and cmp.first_diff is not None and cmp.k3_max > 0.0
