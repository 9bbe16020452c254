"""Training the hybrid lane (Qwen3-Next, issue 16) in Megatron: the backward of the whole
composition (``NextOps(grad=True)``: each program's bytes forward, its ideal op's VJP backward).

The claims: under grad Megatron's log-probabilities keep their bytes; the gradient of a loss
w.r.t. the GatedDeltaNet's in_proj weight repeats byte for byte, and its in_proj_qkvz rows are
the composition's own gradient w.r.t. HF's in_proj_qkvz, byte for byte; ``lockstep train``
(``run.train``) trains a LoRA adapter on the hybrid lane whose bytes repeat run to run (a
one-ulp change of a factor is caught). Sequences cross the lane's 64-token GDN chunk.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import next_composition_trace

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import ModelDir, geometry_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.requests import TrainRequest
from lockstep_exact.testing import assert_same_bytes, nudge_ulp
from lockstep_megatron import gdn
from lockstep_megatron.convert import build, load_hf_weights

# (prompt length, sampled tokens): the trace the adapter trains on, across the chunk and not
PLAN = ((70, 4), (5, 6), (3, 5))


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("next-train") / "m", arch="qwen3-next")


def nll(lp: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of each next token ([b, s, V] or [s, V] log-probs)."""
    lp = lp.reshape(-1, lp.shape[-2], lp.shape[-1])
    toks = toks.reshape(-1, toks.shape[-1])
    return -lp[:, :-1].gather(-1, toks[:, 1:, None]).mean()


def megatron_grad(model, toks):
    w = model.gpt.decoder.layers[0].self_attention.in_proj.weight
    w.requires_grad_(True)
    try:
        w.grad = None
        lp = model(toks)
        nll(lp, toks).backward()
        return lp.detach(), w.grad.clone()
    finally:
        w.requires_grad_(False)
        w.grad = None


def test_the_gradient_wrt_a_gdn_projection_repeats_and_is_the_compositions(next_dir):
    model = build(next_dir).eval()
    assert model.geom.layer_types[0] == N.LINEAR
    toks = torch.randint(0, model.geom.vocab, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(toks)
    lp1, g1 = megatron_grad(model, toks)
    assert_same_bytes(lp1, plain, "Megatron's log-probabilities under grad")
    _, g2 = megatron_grad(model, toks)
    assert g1.dtype == torch.bfloat16 and bool((g1 != 0).any())
    assert_same_bytes(g2, g1, "the in_proj gradient, run twice")
    # input control: the last token changed moves the last row under grad and the gradient
    other = toks.clone()
    other[0, -1] = (other[0, -1] + 1) % model.geom.vocab
    lp_o, g_o = megatron_grad(model, other)
    assert not same_bytes(lp_o[:, -1], plain[:, -1])
    assert_same_bytes(lp_o[:, :-1], plain[:, :-1], "rows before the changed token")
    assert not same_bytes(g_o, g1)
    # The composition on HF's weights, differentiated w.r.t. in_proj_qkvz: Megatron's rows.
    weights = dict(load_hf_weights(next_dir))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    weights[name] = weights[name].clone().requires_grad_(True)
    ops = N.NextOps(geometry_contract(model.geom), grad=True)
    lp = N.forward_logprobs(weights, model.geom, toks[0], ops=ops)
    assert_same_bytes(lp, plain[0], "the composition's log-probabilities")
    (ref,) = torch.autograd.grad(nll(lp, toks[0]), [weights[name]])
    rows = gdn.in_proj_parts(model.gpt.config)["in_proj_qkvz"]
    assert_same_bytes(g1[rows], ref, "Megatron's in_proj_qkvz gradient vs the composition's")
    # input control: the composition on in_proj_qkvz one bf16 ulp off at element 7 (as
    # test_lane_next.py moves it) parts from Megatron's log-probabilities and gradient
    moved = dict(weights)
    moved[name] = nudge_ulp(weights[name].detach(), 7).requires_grad_(True)
    lp_m = N.forward_logprobs(moved, model.geom, toks[0], ops=ops)
    assert not same_bytes(lp_m.detach(), plain[0])
    (ref_m,) = torch.autograd.grad(nll(lp_m, toks[0]), [moved[name]])
    assert not same_bytes(ref_m, g1[rows])


def composition_trace(model_dir, out):
    return next_composition_trace(model_dir, out, PLAN)


def adapter(path):
    return load_file(str(path / "adapter_model.safetensors"))


def test_lockstep_train_trains_a_lora_adapter_on_the_hybrid_lane_byte_repeatably(
    next_dir, tmp_path
):
    from lockstep_megatron.export import adapter_hash
    from lockstep_megatron.run import train

    trace = composition_trace(next_dir, tmp_path / "t")

    def run(out, lr=1e-2, seed=0):  # lr large enough to move bf16 factors in two steps
        return train(
            TrainRequest(
                model_dir=next_dir, trace_dir=trace, adapter_in=None, adapter_out=out,
                steps=2, rank=4, lr=lr, seed=seed,
            )
        )  # fmt: skip

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert a.losses == b.losses and len(a.losses) == 2
    assert a.backbone_hash_before == a.backbone_hash_after  # the backbone stays frozen
    ta, tb = adapter(a.adapter_dir), adapter(b.adapter_dir)
    assert set(ta) == set(tb) and any("linear_attn.in_proj_qkvz" in k for k in ta)
    for k in ta:
        assert_same_bytes(ta[k], tb[k], k)
    base = ModelDir(next_dir, hybrid=True)
    assert adapter_hash(a.adapter_dir, base) == adapter_hash(b.adapter_dir, base)
    gdn_b = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    assert bool((ta[gdn_b] != 0).any())  # trained: B starts at zero
    # input control: the same run with seed 1 (another A at the start) trains other bytes
    tc = adapter(run(tmp_path / "c", seed=1).adapter_dir)
    assert not same_bytes(tc[gdn_b], ta[gdn_b])


def test_every_parameter_of_the_gdn_and_attention_layers_gets_a_gradient(next_dir):
    """The full backward: a loss reaches every parameter of both mixers (GatedDeltaNet's
    in_proj, conv1d, A_log, dt_bias, out_norm, out_proj; the gated attention's), the norms,
    the router, the chosen experts and the shared expert, the embedding and the final norm."""
    model = build(next_dir).eval()
    toks = torch.randint(0, model.geom.vocab, (2, 20), generator=torch.Generator().manual_seed(4))
    params = dict(model.gpt.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    try:
        nll(model(toks), toks).backward()
        missing = sorted(n for n, p in params.items() if p.grad is None or not p.grad.any())
        # a routed expert no token chose gets none (legitimately); every other tensor must
        assert [n for n in missing if ".local_experts." not in n] == [], missing
        assert len(missing) < sum(".local_experts." in n for n in params)
        assert all(bool(p.grad.isfinite().all()) for p in params.values() if p.grad is not None)
    finally:
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None
