"""The trainer half's hooks: entry point, engine info, contract, a resumable train job."""

from __future__ import annotations

from importlib.metadata import entry_points

from lockstep_exact.model import lane_contract
from lockstep_exact.requests import TrainRequest
from lockstep_megatron import adapters as AD
from lockstep_megatron import plugin
from lockstep_megatron.convert import build
from lockstep_megatron.export import load_into


def test_entry_point_lockstep_megatron_names_the_plugin_module():
    eps = {ep.name: ep.value for ep in entry_points(group="lockstep")}
    assert eps.get("megatron") == "lockstep_megatron.plugin"


def test_engine_info_is_the_trainer_on_megatron_core():
    info = plugin.lockstep_engine_info()
    assert info.role == "trainer" and info.engine == "megatron-core"
    assert info.engine_version == "0.16.1" and info.problem is None


def test_trainer_contract_is_the_lane_contract(model_dir):
    got = plugin.lockstep_trainer_contract(model_dir=model_dir, adapter_dir=None, backend="cpu")
    assert got.fingerprint == lane_contract(model_dir).fingerprint


def test_train_job_resumes_from_its_latest_checkpoint(dense_dir, dense_trace, tmp_path):
    import pytest

    from lockstep_megatron.checkpoint import CheckpointError

    def job(steps, out, lr=1e-2):
        return plugin.lockstep_train_step(
            TrainRequest(
                model_dir=dense_dir,
                trace_dir=dense_trace,
                adapter_in=None,
                adapter_out=tmp_path / out,
                steps=steps,
                lr=lr,
                checkpoint_dir=tmp_path / "ckpt",
            )
        )

    first = job(2, "a")
    second = job(1, "b")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2", "step-3"]
    # Another number of steps continues; another learning rate is refused, naming it.
    with pytest.raises(CheckpointError, match=r"was made with lr = 0\.01, this job has 0\.02"):
        job(1, "c", lr=2e-2)
    assert first.backbone_hash_before == second.backbone_hash_after
    a = load_into(build(dense_dir), first.adapter_dir, dense_dir)
    b = load_into(build(dense_dir), second.adapter_dir, dense_dir)
    assert a != b  # the resumed job moved the adapter further
    assert AD.backbone_hash(build(dense_dir)) == first.backbone_hash_before


def test_train_job_refuses_a_checkpoint_of_another_model(dense_dir, tmp_path):
    import pytest
    from trainer_support import nudge_one_ulp, reference_trace

    from lockstep_megatron.checkpoint import CheckpointError

    other = nudge_one_ulp(dense_dir, tmp_path / "other")

    def job(model_dir, name):
        return plugin.lockstep_train_step(
            TrainRequest(
                model_dir=model_dir,
                trace_dir=reference_trace(model_dir, tmp_path / f"trace-{name}"),
                adapter_in=None,
                adapter_out=tmp_path / name,
                steps=1,
                checkpoint_dir=tmp_path / "ckpt",
            )
        )

    job(dense_dir, "a")
    with pytest.raises(CheckpointError, match="model_hash"):
        job(other, "b")


def test_train_job_learns_from_the_advantages_it_is_given(dense_dir, dense_trace, tmp_path):
    import pytest

    from lockstep_exact.adapters import load_adapter
    from lockstep_exact.lanes.qwen3 import Geometry
    from lockstep_exact.parity import same_bytes
    from lockstep_exact.trace import Trace

    n = Trace.load(dense_trace).num_sequences
    geom = Geometry.from_model_dir(dense_dir)

    def job(advantages, out):
        result = plugin.lockstep_train_step(
            TrainRequest(
                model_dir=dense_dir,
                trace_dir=dense_trace,
                adapter_in=None,
                adapter_out=tmp_path / out,
                steps=1,
                lr=1e-2,
                advantages=advantages,
            )
        )
        return load_adapter(result.adapter_dir, geom).modules

    up = job(tuple(1.0 if i % 2 else -1.0 for i in range(n)), "up")
    down = job(tuple(-1.0 if i % 2 else 1.0 for i in range(n)), "down")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not same_bytes(up[name][1], down[name][1])  # opposite rewards, other updates
    with pytest.raises(ValueError, match="advantages for"):
        job((1.0,) * (n + 1), "bad")
