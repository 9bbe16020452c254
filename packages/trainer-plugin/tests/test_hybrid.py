"""The hybrid lane (Qwen3-Next, issue 16) in Megatron: megatron-core's own GatedDeltaNet,
gated SelfAttention and MoELayer with its shared expert, the lane's programs in their slots.

The claim: Megatron's log-probabilities are the composition's (``lanes.qwen3_next.forward``)
bytes, for sequences longer than the GDN chunk (64: the lane's contract) and shorter, alone or
right-padded in a batch; a one-ulp weight change is caught; ``lockstep replay`` of a trace made
by the composition is exact; what is not built yet is refused by name, naming what works.

Models: the default tiny qwen3-next (hidden 128, one GDN then one attention layer, 2 key heads
for 4 value heads) and an odd one (hidden 96, three GDN layers then attention, one key head for
four value heads, one kv head, 4 experts top-3, tied embeddings).
"""

from __future__ import annotations

import sys

import pytest
import torch
from trainer_support import next_composition_trace, nudge_one_ulp

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.contract import LayoutRefused
from lockstep_exact.k3 import compare
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.requests import TrainerSessionRequest
from lockstep_exact.testing import nudge_ulp
from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace
from lockstep_megatron import gdn
from lockstep_megatron.convert import build, load_hf_weights
from lockstep_megatron.replay import replay

pytestmark = pytest.mark.slow

ODD = {
    "hidden": 96,
    "layers": 4,
    "heads": 4,
    "kv_heads": 1,
    "head_dim": 16,
    "experts": 4,
    "topk": 3,
    "moe_intermediate": 40,
    "vocab": 1024,
    "tie_embeddings": True,
}
# (prompt length, sampled tokens): sequences that cross the 64-token GDN chunk and that do not
PLAN = ((70, 8), (5, 66), (40, 30), (3, 5), (100, 12), (64, 3))


@pytest.fixture(scope="module", params=["default", "odd"])
def next_dir(request, tmp_path_factory):
    kw = ODD if request.param == "odd" else {}
    return make_tiny(
        tmp_path_factory.mktemp(f"next-{request.param}") / "m", arch="qwen3-next", **kw
    )


@pytest.fixture(scope="module")
def loaded(next_dir):
    return build(next_dir).eval(), load_hf_weights(next_dir)


def _batch(seqs, pad: int) -> torch.Tensor:
    toks = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks


def _sequences(vocab: int, lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def composition_trace(model_dir, out):
    """A trace of ``PLAN`` whose logprobs are the composition's (no engine, no adapter)."""
    return next_composition_trace(model_dir, out, PLAN)


@pytest.fixture(scope="module")
def next_trace(next_dir, tmp_path_factory):
    return composition_trace(next_dir, tmp_path_factory.mktemp("trace") / "t")


# --- the model is megatron-core's ----------------------------------------------------------------
def test_the_model_is_megatron_cores_gdn_attention_and_moe_without_fla(loaded):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    model, _ = loaded
    geom = model.geom
    names = set(model.gpt.state_dict())
    for i, (kind, layer) in enumerate(zip(geom.layer_types, model.gpt.decoder.layers, strict=True)):
        mixer, p = layer.self_attention, f"decoder.layers.{i}.self_attention."
        if kind == N.LINEAR:
            assert isinstance(mixer, GatedDeltaNet)
            for name in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight"):
                assert p + name in names
            assert p + "out_proj.weight" in names
            assert mixer.in_proj.weight.shape[0] == mixer.in_proj_dim
        else:
            assert isinstance(mixer, SelfAttention) and model.gpt.config.attention_output_gate
            assert p + "linear_qkv.weight" in names
        assert isinstance(layer.mlp, MoELayer)
        assert isinstance(layer.mlp.shared_experts, SharedExpertMLP)
        assert f"decoder.layers.{i}.mlp.shared_experts.gate_weight" in names
    assert not any(m == "fla" or m.startswith("fla.") for m in sys.modules)


def test_the_gated_delta_net_modules_own_forward_is_the_compositions_mixer(loaded):
    """Megatron's GatedDeltaNet called as Megatron calls it ([s, b, h] in, (out, bias) back):
    each batch column's rows are the composition's GDN mixer bytes on HF's weights."""
    model, weights = loaded
    geom = model.geom
    ops, slots = N.default_ops(geom), N.DictSlots(weights, geom)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(90, 2, geom.hidden, generator=g) * 0.5).to(torch.bfloat16)
    for i, kind in enumerate(geom.layer_types):
        if kind != N.LINEAR:
            continue
        with torch.no_grad():
            out, bias = model.gpt.decoder.layers[i].self_attention(x, None)
        assert bias is None and out.shape == x.shape
        for col, n in ((0, 90), (1, 70)):  # a shorter sequence: its first 70 rows
            seg = [(0, n, N.NextCache.empty(geom))]
            ref = N.Layer(geom, i, ops, slots).gdn(x[:n, col].contiguous(), seg)
            assert torch.equal(out[:n, col], ref), (i, col)
        # input control: the composition's mixer on x with its largest element one ulp off
        xc = x[:90, 0].contiguous()
        moved = nudge_ulp(xc, int(xc.float().argmax()))
        ref_m = N.Layer(geom, i, ops, slots).gdn(moved, [(0, 90, N.NextCache.empty(geom))])
        assert not torch.equal(out[:, 0], ref_m), i
    with pytest.raises(gdn.HybridRefused, match="takes no packed_seq_params"):
        model.gpt.decoder.layers[0].self_attention(x, None, packed_seq_params=object())


def test_fused_weights_hold_the_hf_projections_bytes(loaded):
    model, weights = loaded
    slots = gdn.NextSlots(model)
    for i, kind in enumerate(model.geom.layer_types):
        names = (
            ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")
            if kind == N.LINEAR
            else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        )
        for name in (*names, "mlp.shared_expert.up_proj", "mlp.experts.1.down_proj"):
            hf = weights[f"model.layers.{i}.{name}.weight"]
            assert torch.equal(slots.weight(i, f"{name}.weight"), hf), (i, name)


# --- bytes ---------------------------------------------------------------------------------------
def test_megatron_logprobs_equal_the_composition_bytes_in_padded_batches(loaded):
    model, weights = loaded
    seqs = _sequences(model.geom.vocab, (150, 70, 9, 64, 65))
    for pad in (0, model.geom.vocab - 1):  # what fills the padding must not matter
        with torch.no_grad():
            lp = model(_batch(seqs, pad))
        assert lp.dtype == torch.float32
        for i, s in enumerate(seqs):
            ref = N.forward_logprobs(weights, model.geom, s)
            assert torch.equal(lp[i, : len(s)], ref), f"sequence {i} (len {len(s)}), pad {pad}"


@pytest.mark.parametrize("where", ["in_proj", "A_log", "conv1d"])
def test_one_ulp_gdn_weight_change_is_caught(next_dir, where):
    model = build(next_dir).eval()
    weights = load_hf_weights(next_dir)
    seq = _sequences(model.geom.vocab, (80,))[0]
    i = model.geom.layer_types.index(N.LINEAR)
    mixer = model.gpt.decoder.layers[i].self_attention
    t = {"in_proj": mixer.in_proj.weight, "A_log": mixer.A_log, "conv1d": mixer.conv1d.weight}
    with torch.no_grad():
        t[where].view(torch.int16).view(-1)[0] += 1  # one bf16 ulp
        lp = model(seq[None])
    assert not torch.equal(lp[0], N.forward_logprobs(weights, model.geom, seq))


# --- replay --------------------------------------------------------------------------------------
def test_replay_of_a_composition_trace_is_exact_for_every_decision(next_dir, next_trace):
    trace = Trace.load(next_trace)
    lps, _ = replay(next_dir, next_trace, micro_batch=4)
    cmp = compare(trace.logprobs, lps)
    assert cmp.n == trace.num_decisions == sum(n for _, n in PLAN)
    assert cmp.byte_equal == cmp.n and cmp.k3_max == 0.0


def decoded_trace(model_dir, out, temperature=0.8, top_p=0.9):
    """A trace drawn as a sampler draws it: the prompt prefilled, then one token per step from
    the composition's cache (decode crosses the 64-token chunk), each token the lane's sampling
    rule's draw; the trace records the rule and the seeds, so replay checks every token."""
    from lockstep_exact.trace import SamplingSettings

    geom = N.Geometry.from_model_dir(model_dir)
    weights = load_hf_weights(model_dir)
    ops = N.default_ops(geom)
    g = torch.Generator().manual_seed(9)
    prompts, sampled, lps, seeds = [], [], [], []
    for i, (plen, n) in enumerate(((60, 10), (5, 7), (63, 3))):
        seed, cache = 100 + i, N.NextCache.empty(geom)
        prompt = torch.randint(0, geom.vocab, (plen,), generator=g)
        row = N.forward_logprobs(weights, geom, prompt, cache, ops=ops)[-1:]
        toks, lp = [], []
        for j in range(n):
            tok = ops.sample(
                "sample",
                row,
                temperature=temperature,
                top_p=top_p,
                seeds=[seed],
                positions=[plen + j],
            )
            toks.append(tok)
            lp.append(row[0, tok])
            row = N.forward_logprobs(weights, geom, tok, cache, ops=ops)
        prompts.append(prompt)
        sampled.append(torch.cat(toks))
        lps.append(torch.cat(lp))
        seeds.append(seed)
    invoked = ops.invoked_contract()
    rule = ops.program("sample", "sample.gumbel_topp").ident
    return Trace.from_sequences(
        prompts,
        sampled,
        lps,
        contract_fingerprint=invoked.fingerprint,
        contract=invoked.to_json(),
        model_hash=dir_hash(model_dir),
        sampling=SamplingSettings(temperature, top_p, seed=100, seeds=tuple(seeds), rule=rule),
        engine={"name": "composition, decoded"},
    ).save(out, overwrite=True)


def test_replay_of_a_decoded_trace_with_its_sampling_rule_is_exact(next_dir, tmp_path):
    """Teacher forcing in Megatron (every position in one forward) against token-by-token
    decode in the composition: byte-equal, and every token is the rule's draw."""
    path = decoded_trace(next_dir, tmp_path / "decoded")
    trace = Trace.load(path)
    assert trace.sampling.rule is not None
    lps, _ = replay(next_dir, path, micro_batch=2)
    cmp = compare(trace.logprobs, lps)
    assert cmp.n == 20 and cmp.byte_equal == cmp.n
    # input control: the decoded trace (its rule kept) replayed on the one-ulp copy
    nudged, forged = nudged_and_forged(next_dir, path, tmp_path, keep_rule=True)
    lps, _ = replay(nudged, forged, micro_batch=2)
    assert compare(trace.logprobs, lps).byte_equal < cmp.n


def nudged_and_forged(next_dir, next_trace, tmp_path, keep_rule=False):
    """A copy with one GDN in_proj_qkvz element one bf16 ulp off, and the trace's bytes (from
    the original model) admitted against it: the input control of the replays."""
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"  # layer 0 is a GDN layer
    nudged = nudge_one_ulp(next_dir, tmp_path / "nudged", name)
    original = Trace.load(next_trace)
    forged = Trace.from_sequences(
        [original.prompt(i) for i in range(original.num_sequences)],
        [original.sampled(i) for i in range(original.num_sequences)],
        [original.sequence_logprobs(i) for i in range(original.num_sequences)],
        contract_fingerprint=original.contract_fingerprint,
        contract=original.contract,
        model_hash=dir_hash(nudged),
        sampling=original.sampling if keep_rule else SamplingSettings(rule=TEACHER_FORCED),
    ).save(tmp_path / "trace")
    return nudged, forged


def test_replay_on_a_one_ulp_copy_reports_a_difference(next_dir, next_trace, tmp_path):
    original = Trace.load(next_trace)
    nudged, forged = nudged_and_forged(next_dir, next_trace, tmp_path)
    lps, _ = replay(nudged, forged, micro_batch=4)
    cmp = compare(original.logprobs, lps)
    assert cmp.byte_equal < cmp.n and cmp.first_diff is not None


def test_lockstep_replay_cli_on_a_qwen3_next_model(next_dir, next_trace, tmp_path, capsys):
    import json

    from lockstep_exact.app.cli import main

    report = tmp_path / "report.json"
    args = ["replay", "--model", str(next_dir), "--trace", str(next_trace), "--out", str(report)]
    assert main(args) == 0
    n = Trace.load(next_trace).num_decisions
    assert f"EXACT: {n}/{n} decisions byte-equal" in capsys.readouterr().out
    assert json.loads(report.read_text())["byte_equal"] == n
    # input control: the CLI on the one-ulp copy (the trace admitted against it)
    nudged, forged = nudged_and_forged(next_dir, next_trace, tmp_path)
    moved = tmp_path / "moved.json"
    assert (
        main(["replay", "--model", str(nudged), "--trace", str(forged), "--out", str(moved)]) == 1
    )
    assert "NOT EXACT" in capsys.readouterr().out
    assert json.loads(moved.read_text())["byte_equal"] < n


# --- refusals ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("next-refusals") / "m", arch="qwen3-next")


def test_the_trainer_session_opens_on_cpu_and_another_backend_is_refused_by_name(default_dir):
    """The trainer session (``lockstep train``, the ladder's gate) takes the hybrid lane on
    cpu: a policy with adapters on the GatedDeltaNet, a frozen model; cuda passes the
    refusal (tests/test_train_gpu.py trains there), another backend is refused, naming what
    works."""
    from lockstep_megatron import adapters as AD
    from lockstep_megatron.session import open_session

    policy = open_session(TrainerSessionRequest(model_dir=default_dir, role="policy", rank=4))
    assert any(".lora." in n for n, _ in policy.model.named_parameters())
    assert any("linear_attn.in_proj_qkvz" in s.hf_module for s in AD.sites(policy.model))
    frozen = open_session(TrainerSessionRequest(model_dir=default_dir, role="frozen"))
    assert frozen.backbone_hash() == policy.backbone_hash()
    want = "training: the hybrid lane .* cpu or cuda .* 'mps': run it with --backend cpu or"
    with pytest.raises(gdn.HybridRefused, match=want):
        gdn.refuse_training(default_dir, "mps")
    gdn.refuse_training(default_dir, "cpu")
    gdn.refuse_training(default_dir, "cuda")


def test_replay_refuses_another_layout_and_another_backend(default_dir, tmp_path, monkeypatch):
    with pytest.raises(LayoutRefused, match="qwen3-next lane runs on one device so far"):
        replay(default_dir, tmp_path / "t", tp=2)
    with pytest.raises(LayoutRefused, match="qwen3-next lane runs on one device so far"):
        gdn.check_replay(default_dir, None, "cuda", 2, 1)
    with pytest.raises(gdn.HybridRefused, match="replays in Megatron on cpu or cuda, not 'tpu'"):
        gdn.check_replay(default_dir, None, "tpu", 1, 1)
    # cuda on one GPU passes on to the contract's layout check (its bytes: test_next_gpu.py);
    # the cuda contract imports Triton, which this machine may lack, so the check is watched
    from lockstep_megatron.gdn import refusals

    seen = []
    monkeypatch.setattr(refusals, "geometry_contract", lambda g, **kw: seen.append(kw))
    gdn.check_replay(default_dir, None, "cuda", 1, 1)
    assert seen == [{"backend": "cuda", "tp": 1, "ep": 1}]


def test_the_trainer_contract_hook_answers_for_the_hybrid_lane(default_dir, tmp_path):
    from lockstep_exact.model import ModelDir
    from lockstep_megatron import plugin

    contract = plugin.lockstep_trainer_contract(default_dir, None, "cpu")
    assert contract.lane == "qwen3-next/bf16/cpu"
    assert contract.fingerprint == ModelDir(default_dir, hybrid=True).contract().fingerprint
    # adapters are the trainer's (test_hybrid_lora.py); a directory without one is named
    with pytest.raises(Exception, match="not a PEFT adapter directory"):
        plugin.lockstep_trainer_contract(default_dir, tmp_path / "adapter", "cpu")


def test_an_adapter_of_the_hybrid_lane_exports_and_loads_by_its_model_path(default_dir, tmp_path):
    """``export.export_peft`` / ``load_into`` take a Qwen3-Next model directory by path (the
    Megatron plugin runs the hybrid lane): the loaded adapter gives the exporting model's
    log-probabilities byte for byte, one with a factor moved does not; an adapter of another
    model is refused by name."""
    from lockstep_exact.adapters import AdapterError
    from lockstep_exact.testing import perturb_adapter
    from lockstep_megatron import adapters as AD
    from lockstep_megatron import export

    model = AD.attach(build(default_dir), 4, 8.0, seed=2)
    for s in AD.sites(model):  # B away from 0: the adapter moves the bytes
        with torch.no_grad():
            s.linear.lora[s.part].B.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[3, 17, 5, 9, 11]])
    with torch.no_grad():
        want = model(ids)
    out = export.export_peft(model, tmp_path / "a", default_dir)
    loaded = build(default_dir)
    export.load_into(loaded, out, default_dir)
    with torch.no_grad():
        assert torch.equal(loaded(ids), want)
    # control: the same adapter with one GDN factor moved by 2^-9 gives other bytes
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    moved = build(default_dir)
    export.load_into(moved, perturb_adapter(out, tmp_path / "moved", key), default_dir)
    with torch.no_grad():
        assert not torch.equal(moved(ids), want)
    other = make_tiny(tmp_path / "other", arch="qwen3-next", seed=1)
    with pytest.raises(AdapterError, match="model"):
        export.read_adapter(out, other)
