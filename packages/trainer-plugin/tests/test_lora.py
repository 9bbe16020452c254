"""LoRA on the exact lane: adapter bytes match the reference, training moves only adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_support import reference_trace

from lockstep_exact.k3 import compare
from lockstep_exact.lanes import qwen3
from lockstep_exact.requests import TrainRequest
from lockstep_exact.testing import perturb_adapter
from lockstep_exact.trace import Trace
from lockstep_megatron import adapters as AD
from lockstep_megatron.convert import build, load_hf_weights
from lockstep_megatron.replay import replay
from lockstep_megatron.run import train

# the last layer's (the tiny models have 2) o_proj B factor: it feeds the residual directly
O_PROJ_B = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"


def _randomize(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in AD.adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _seq(vocab, n=14):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(5))


def move_b(model, hf_module: str, delta: float = 2.0**-9) -> None:
    """One element of the attached adapter's B factor at ``hf_module`` moved by ``delta`` in
    place (the perturbed-adapter control on a loaded model: no second build)."""
    (site,) = [s for s in AD.sites(model) if s.hf_module == hf_module]
    with torch.no_grad():
        site.linear.lora[site.part].B.view(-1)[0] += delta


def test_zero_adapter_changes_no_byte(model_dir):
    model = build(model_dir).eval()
    seq = _seq(model.geom.vocab)
    with torch.no_grad():
        base = model(seq[None])
        AD.attach(model, 8, 16.0)
        with_zero = model(seq[None])
    assert torch.equal(base, with_zero)
    # input control: the zero adapter with one o_proj B element moved by 2^-9
    move_b(model, f"model.layers.{model.geom.layers - 1}.self_attn.o_proj")
    with torch.no_grad():
        assert not torch.equal(base, model(seq[None]))


def test_adapter_logprobs_equal_reference_with_the_same_adapter(model_dir):
    model = build(model_dir).eval()
    AD.attach(model, 8, 16.0)
    _randomize(model)
    weights, seq = load_hf_weights(model_dir), _seq(model.geom.vocab)
    with torch.no_grad():
        lp = model(seq[None])[0]
    ref = qwen3.forward_logprobs(weights, model.geom, seq, AD.bf16_adapters(model))
    assert torch.equal(lp, ref)
    # negative control: one bf16 ulp in one adapter element (the largest B entry of the last
    # layer's o_proj, which feeds the residual stream directly) is caught
    ads = AD.bf16_adapters(model)
    key = f"model.layers.{model.geom.layers - 1}.self_attn.o_proj.weight"
    a, b, s = ads[key]
    b = b.clone()
    b.view(torch.int16).view(-1)[b.float().abs().argmax()] += 1
    ads[key] = (a, b, s)
    assert not torch.equal(lp, qwen3.forward_logprobs(weights, model.geom, seq, ads))


def test_moe_expert_adapters_have_rank_r_over_topk(moe_dir):
    model = AD.attach(build(moe_dir), 8, 16.0)
    experts = [s for s in AD.sites(model) if s.is_expert]
    assert experts and all(
        s.linear.lora[s.part].A.shape[0] == 8 // model.geom.topk for s in experts
    )
    scales = {s.is_expert: s.linear.lora[s.part].scale for s in AD.sites(model)}
    assert scales == {False: 16.0 / 8, True: 16.0 / 4}  # lora_alpha / each module's rank


def test_backward_reaches_every_adapter_and_no_backbone_tensor(model_dir):
    model = AD.attach(build(model_dir), 8, 16.0)
    _randomize(model)
    seq = _seq(model.geom.vocab, 64)  # long enough that every expert receives tokens
    lp = model(seq[None, :-1])
    lp[0].gather(-1, seq[1:, None]).sum().backward()
    grads = [p.grad for p in AD.adapter_parameters(model)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora." not in n)


def test_training_moves_adapters_and_keeps_the_backbone(dense_dir, dense_trace, tmp_path):
    result = train(
        TrainRequest(
            model_dir=dense_dir,
            trace_dir=dense_trace,
            adapter_in=None,
            adapter_out=tmp_path / "adapter",
            steps=2,
            lr=1e-2,
        )
    )
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.backbone_hash_before == result.backbone_hash_after
    model = build(dense_dir)
    assert AD.backbone_hash(model) == result.backbone_hash_before  # the files never moved
    from lockstep_megatron.export import load_into

    load_into(model, result.adapter_dir, dense_dir)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith(".B"))


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_trained_adapter_replays_byte_equal(arch, dense_dir, moe_dir, tmp_path, request):
    model_dir = dense_dir if arch == "dense" else moe_dir
    trace0 = request.getfixturevalue(f"{arch}_trace")
    out = train(
        TrainRequest(
            model_dir=model_dir,
            trace_dir=trace0,
            adapter_in=None,
            adapter_out=tmp_path / "adapter",
            steps=1,
            lr=1e-2,
        )
    ).adapter_dir
    trace = reference_trace(model_dir, tmp_path / "trace", adapter_dir=out)
    lps, _ = replay(model_dir, trace, adapter_dir=out, micro_batch=4)
    cmp = compare(Trace.load(trace).logprobs, lps)
    assert cmp.byte_equal == cmp.n and cmp.k3_max == 0.0
    base = Trace.load(trace0).logprobs
    assert not torch.equal(base, lps)  # the adapter is not a no-op
    # input control: the trained adapter with one o_proj B element moved by 2^-9
    moved = perturb_adapter(out, tmp_path / "moved", O_PROJ_B)
    mlps, _ = replay(model_dir, trace, adapter_dir=moved, micro_batch=4, control=True)
    assert compare(Trace.load(trace).logprobs, mlps).byte_equal < cmp.n


def test_shared_make_adapter_replays_byte_equal_and_zero_b_is_the_base(model_dir, tmp_path):
    """Adapters made by lockstep_exact.adapters (what the sampler's tests load) work here."""
    from lockstep_exact.adapters import make_adapter

    nonzero = make_adapter(model_dir, tmp_path / "a", rank=4, alpha=8.0, seed=2)
    zero = make_adapter(model_dir, tmp_path / "z", rank=4, alpha=8.0, seed=2, zero_b=True)
    base_trace = reference_trace(model_dir, tmp_path / "t0")
    trace = reference_trace(model_dir, tmp_path / "t1", adapter_dir=nonzero)
    lps, _ = replay(model_dir, trace, adapter_dir=nonzero, micro_batch=3)
    assert torch.equal(lps, Trace.load(trace).logprobs)
    zlps, _ = replay(model_dir, base_trace, adapter_dir=zero, control=True)
    assert torch.equal(zlps, Trace.load(base_trace).logprobs)
    assert not torch.equal(lps, zlps)
    # input controls: each adapter with one o_proj B element moved by 2^-9
    for adapter, t, what in ((nonzero, trace, "a"), (zero, base_trace, "z")):
        moved = perturb_adapter(adapter, tmp_path / f"{what}-moved", O_PROJ_B)
        mlps, _ = replay(model_dir, t, adapter_dir=moved, control=True)
        assert not torch.equal(mlps, Trace.load(t).logprobs), what


def test_surrogate_gradients_descend_the_grpo_loss(dense_dir, dense_trace):
    """The backward is the ideal op's VJP: full-batch AdamW steps lower the token loss."""
    from lockstep_megatron.run import open_job

    job = open_job(
        TrainRequest(dense_dir, dense_trace, None, Path("unused"), lr=1e-2, micro_batch=7)
    )
    losses = job.run(5)
    assert losses[-1] < losses[0], losses
