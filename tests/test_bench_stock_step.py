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


def test_the_stock_steps_lora_trains_only_its_adapters(tmp_path):
    """``--rank``: the stock model frozen, a LoRA side path on its linear layers; B = 0 leaves
    the log-probabilities' bytes as they were, a backward reaches only the adapters, and a
    non-zero B moves the log-probabilities (the control)."""
    from lockstep_exact.app.tiny import make_tiny

    bench = _bench()
    model_dir = make_tiny(tmp_path / "m", arch="qwen3")
    stock, _ = bench.stock_megatron(model_dir, "cpu")
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(3, 1000, (24,), generator=gen).tolist()
    with torch.no_grad():
        (before,) = bench.token_logprobs(stock, [seq], [4], "cpu")
    params = bench.attach_lora(stock, 4, 8.0, "cpu")
    layers = len(stock.module.decoder.layers)
    assert len(params) == 2 * 4 * layers  # A and B on qkv, proj, fc1, fc2 of every layer
    (after,) = bench.token_logprobs(stock, [seq], [4], "cpu")
    assert torch.equal(before, after.detach())
    after.mean().backward()
    assert all(p.grad is None for p in stock.parameters() if not any(p is q for q in params))
    assert all(p.grad is not None for p in params)
    with torch.no_grad():
        params[1].add_(0.01)  # layer 0's first B
        (moved,) = bench.token_logprobs(stock, [seq], [4], "cpu")
    assert not torch.equal(before, moved)
