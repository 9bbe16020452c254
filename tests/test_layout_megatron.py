"""Layout invariance in the trainer: Megatron at tensor-parallel size 2 (two processes over
gloo; Megatron's own ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding hold
each rank's shard) replays a vLLM tp=1 trace byte for byte, with and without a LoRA adapter;
Megatron's MoELayer at expert-parallel size 2 (each rank holds half the experts and its own
share of the sequences; Megatron's token dispatcher moves the routed rows between the ranks)
and at tp 2 x ep 2 (four processes) gives the bytes of one process on a MoE trace from real
vLLM at tp 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cross_support import capture, forge, nudged_copy

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.contract import LayoutRefused
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.parity import same_bytes
from lockstep_exact.plugins import manager
from lockstep_exact.requests import ReplayRequest
from lockstep_exact.testing import perturb_adapter

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# An adapter factor of every rank (attention is not expert-parallel): the LoRA controls move it.
O_PROJ_B = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module")
def dense(pm, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-tp")
    model = make_tiny(root / "model", arch="qwen3", seed=11)
    trace = capture(pm, model, root / "trace")
    return root, model, trace


def _replay(pm, model, trace_dir, tp, control=False, adapter=None, ep=1):
    return pm.hook.lockstep_replay(
        request=ReplayRequest(
            model_dir=model,
            trace_dir=trace_dir,
            tp=tp,
            ep=ep,
            control=control,
            adapter_dir=adapter,
        )
    ).logprobs


def test_megatron_at_tp2_replays_vllm_at_tp1_byte_for_byte(pm, dense):
    root, model, trace = dense
    cmp = compare(trace.logprobs, _replay(pm, model, root / "trace", 2))
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0, str(cmp)


def test_megatron_at_tp2_replays_vllm_lora_decisions_byte_for_byte(pm, dense):
    """Column-parallel sites take this rank's rows of B, row-parallel ones the whole adapter
    over the gathered input."""
    from lockstep_exact.adapters import make_adapter

    root, model, _ = dense
    adapter = make_adapter(model, root / "A", seed=5)
    trace = capture(pm, model, root / "A-trace", adapter=adapter)
    cmp = compare(trace.logprobs, _replay(pm, model, root / "A-trace", 2, adapter=adapter))
    assert cmp.exact and cmp.n == 64, str(cmp)
    # control: the trainer at tp 2 on the adapter with one factor moved by 2^-9 parts from it
    pert = perturb_adapter(adapter, root / "A-pert", O_PROJ_B)
    moved = _replay(pm, model, root / "A-trace", 2, control=True, adapter=pert)
    assert not compare(trace.logprobs, moved).exact


def test_control_megatron_at_tp2_on_a_one_ulp_copy_parts_from_the_trace(pm, dense):
    root, model, trace = dense
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    forged = forge(trace, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(trace.logprobs, _replay(pm, copy, forged, 2, control=True))
    assert not cmp.exact, str(cmp)


def test_megatron_refuses_a_layout_that_does_not_divide_the_contract(pm, dense, moe):
    """Refused before any rank starts, naming both numbers."""
    root, model, _ = dense
    with pytest.raises(LayoutRefused, match="tp 3 does not divide the 8 K partitions"):
        _replay(pm, model, root / "trace", 3)
    with pytest.raises(LayoutRefused, match="ep 2 needs a MoE model; this one has no experts"):
        _replay(pm, model, root / "trace", 1, ep=2)
    mroot, mmodel, _, _ = moe
    with pytest.raises(LayoutRefused, match="ep 3 does not divide the model's 8 experts"):
        _replay(pm, mmodel, mroot / "trace", 1, ep=3)


# --- MoE through Megatron's MoELayer: expert parallelism, tp x ep ----------------------------
# Held by ep rank 1 only (experts 4..7 at ep 2); its element 0 is in tp rank 0's K share. Of
# this expert's elements, a one-ulp change of element 0 reaches 5 of the 64 decisions.
EXPERT_ON_EP_RANK_1 = "model.layers.0.mlp.experts.6.down_proj.weight"


@pytest.fixture(scope="module")
def moe(pm, tmp_path_factory):
    """A tiny MoE (8 experts, top 2), its vLLM tp 1 trace, and Megatron's bytes at tp 1 ep 1."""
    root = tmp_path_factory.mktemp("megatron-ep")
    model = make_tiny(root / "model", arch="qwen3-moe", seed=1)
    trace = capture(pm, model, root / "trace")
    one = _replay(pm, model, root / "trace", 1)
    assert compare(trace.logprobs, one).exact
    return root, model, trace, one


@pytest.fixture(scope="module")
def moe_control(moe):
    """The MoE model with one element of an expert that only ep rank 1 holds one ulp off, and
    its trace forged to that model (the sampler never ran it)."""
    root, model, trace, _ = moe
    copy = nudged_copy(model, root / "nudged", EXPERT_ON_EP_RANK_1)
    return copy, forge(trace, root / "forged", keep_rule=False, model_hash=dir_hash(copy))


def test_megatron_moe_at_ep2_gives_the_bytes_of_ep1(moe):
    """Each ep rank scores its own micro-batches; its experts ran on rows of tokens that only
    the other rank held (counted by the rank: zero if the dispatcher were bypassed)."""
    from lockstep_megatron.parallel import replay_tp

    root, model, trace, one = moe
    stats: dict = {}
    two, _ = replay_tp(model, root / "trace", None, "cpu", 3, False, 1, 2, stats=stats)
    assert two.numel() == 64 and same_bytes(two, one)
    assert len(stats["rows_received"]) == 2 and min(stats["rows_received"]) > 0, stats
    cmp = compare(trace.logprobs, two)
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0, str(cmp)


def test_megatron_moe_at_ep2_replays_vllm_lora_decisions_byte_for_byte(pm, moe):
    """Each rank loads the adapters of its own experts (and every attention adapter)."""
    from lockstep_exact.adapters import make_adapter

    root, model, _, _ = moe
    adapter = make_adapter(model, root / "A", seed=5)
    trace = capture(pm, model, root / "A-trace", adapter=adapter)
    cmp = compare(trace.logprobs, _replay(pm, model, root / "A-trace", 1, adapter=adapter, ep=2))
    assert cmp.exact and cmp.n == 64, str(cmp)
    # control: the trainer at ep 2 on the adapter with one factor moved by 2^-9 parts from it
    pert = perturb_adapter(adapter, root / "A-pert", O_PROJ_B)
    moved = _replay(pm, model, root / "A-trace", 1, control=True, adapter=pert, ep=2)
    assert not compare(trace.logprobs, moved).exact


def test_control_megatron_moe_at_ep2_with_a_rank_1_expert_one_ulp_off_differs(pm, moe, moe_control):
    _, _, _, one = moe
    copy, forged = moe_control
    two = _replay(pm, copy, forged, 1, ep=2, control=True)
    assert two.numel() == 64 and not same_bytes(two, one)


def test_megatron_moe_at_tp2_ep2_gives_the_bytes_of_tp1(pm, moe):
    root, model, trace, one = moe
    four = _replay(pm, model, root / "trace", 2, ep=2)
    assert four.numel() == 64 and same_bytes(four, one)
    cmp = compare(trace.logprobs, four)
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0, str(cmp)


def test_control_megatron_moe_at_tp2_ep2_with_one_shard_one_ulp_off_differs(pm, moe, moe_control):
    """Element 0 of that expert's down_proj sits in the K share of tp rank 0, ep rank 1."""
    _, _, _, one = moe
    copy, forged = moe_control
    four = _replay(pm, copy, forged, 2, ep=2, control=True)
    assert four.numel() == 64 and not same_bytes(four, one)


def test_megatron_moe_refusals_inside_one_process(moe):
    """A model asked for an ep its parallel state lacks; an expert another rank owns; adapter
    export at ep > 1 (each rank holds only its experts' adapters); a token dispatcher other
    than allgather."""
    from lockstep_megatron.convert import build
    from lockstep_megatron.export import export_peft
    from lockstep_megatron.spec import LockstepGPT

    _, model, _, _ = moe
    built = build(model)
    with pytest.raises(RuntimeError, match="expert-parallel group has 1 ranks, not 2"):
        LockstepGPT(built.geom, 1, 2)
    with pytest.raises(RuntimeError, match=r"expert 8 is not on this rank \(it holds 0..7\)"):
        built.gpt.decoder.layers[0].mlp.local_index(8)
    with pytest.raises(NotImplementedError, match="exporting an adapter from Megatron at ep > 1"):
        export_peft(SimpleNamespace(tp=1, ep=2), model / "never", model)
    from lockstep_megatron.moe import classes

    other = SimpleNamespace(moe_token_dispatcher_type="alltoall")
    with pytest.raises(NotImplementedError, match="Megatron's allgather token dispatcher, not 'a"):
        classes()["layer"](other)
