"""tools/bench/bench_stock_step.py's Megatron side: megatron-core's own local-spec model takes
the lane's Megatron state (the same names and fused layouts) and computes nearly, not
exactly, the exact lane's log-probabilities. The bound is loose on purpose: the stock model is
not exact (that gap is what the bench's K3 reports); the control shows the check sees a wrong
layout (a projection moved between layers)."""

from __future__ import annotations

import pytest
import torch

# A bench's own check, two Megatron models a case: CI's tier (`tools/check --all`), not the
# fast one.
pytestmark = pytest.mark.slow


def _bench():
    from tool_support import load_tool

    return load_tool("tools/bench/bench_stock_step.py")


def _k3_mean(a: torch.Tensor, b: torch.Tensor) -> float:
    d = b.double() - a.double()
    return float((torch.exp(d) - 1 - d).mean())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_megatrons_own_model_takes_the_lanes_weights(arch, tmp_path):
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_megatron.convert import build

    bench = _bench()
    model_dir = make_tiny(tmp_path / arch, arch=arch)
    lane = build(model_dir)
    stock, _ = bench.stock_megatron(model_dir, "cpu")
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(3, lane.geom.vocab, (48,), generator=gen).tolist()
    start = 8
    with torch.no_grad():
        (got,) = bench.token_logprobs(stock, [seq], [start], "cpu")
        lane_lp = lane(torch.tensor(seq)[None])[0, start - 1 : -1]
    want = lane_lp.gather(-1, torch.tensor(seq[start:])[:, None])[:, 0].float()
    near = _k3_mean(want, got)
    assert near < 1e-2, near
    # control: layer 0's fused qkv projection swapped with layer 1's in the stock model
    qkv = [layer.self_attention.linear_qkv.weight for layer in stock.module.decoder.layers[:2]]
    with torch.no_grad():
        a, b = qkv[0].clone(), qkv[1].clone()
        qkv[0].copy_(b)
        qkv[1].copy_(a)
        (moved,) = bench.token_logprobs(stock, [seq], [start], "cpu")
    assert _k3_mean(want, moved) > 10 * near
