"""Layout invariance in the trainer: Megatron at tensor-parallel size 2 (two processes over
gloo; Megatron's own ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding hold
each rank's shard) replays a vLLM tp=1 trace byte for byte, with and without a LoRA adapter."""

from __future__ import annotations

import pytest
from cross_support import capture, forge, nudged_copy

from lockstep_exact.contract import LayoutRefused
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.plugins import manager
from lockstep_exact.requests import ReplayRequest
from lockstep_exact.tiny import make_tiny

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module")
def dense(pm, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-tp")
    model = make_tiny(root / "model", arch="qwen3", seed=11)
    trace = capture(pm, model, root / "trace")
    return root, model, trace


def _replay(pm, model, trace_dir, tp, control=False, adapter=None):
    return pm.hook.lockstep_replay(
        request=ReplayRequest(
            model_dir=model, trace_dir=trace_dir, tp=tp, control=control, adapter_dir=adapter
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


def test_control_megatron_at_tp2_on_a_one_ulp_copy_parts_from_the_trace(pm, dense):
    root, model, trace = dense
    copy = nudged_copy(model, root / "nudged", "model.norm.weight")
    forged = forge(trace, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
    cmp = compare(trace.logprobs, _replay(pm, copy, forged, 2, control=True))
    assert not cmp.exact, str(cmp)


def test_megatron_refuses_a_tp_that_does_not_divide_and_moe_at_tp2(pm, dense, tmp_path):
    root, model, _ = dense
    with pytest.raises(LayoutRefused, match="tp 3 does not divide the 8 K partitions"):
        _replay(pm, model, root / "trace", 3)
    moe = make_tiny(tmp_path / "moe", arch="qwen3-moe", seed=1)
    with pytest.raises(NotImplementedError, match="Megatron MoE layers at tp > 1 are not wired"):
        _replay(pm, moe, root / "trace", 2)
