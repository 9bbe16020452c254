"""`lockstep doctor --model` on a Qwen3-Next model: admitted where both halves serve it, and a
half that refuses it is named with its message."""

from __future__ import annotations

import pytest

from lockstep_exact import plugins
from lockstep_exact.app.cli import main
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.hookspecs import hookimpl
from lockstep_exact.model import ModelDir
from lockstep_exact.requests import EngineInfo

REFUSAL = "the hybrid lane is not served by this test's trainer"


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("doctor") / "qwen3-next", arch="qwen3-next")


def test_doctor_admits_qwen3_next_where_both_halves_serve_it(next_model, capsys):
    rc = main(["doctor", "--model", str(next_model)])
    out = capsys.readouterr().out
    fingerprint = ModelDir(next_model, hybrid=True).contract().fingerprint
    line = next(s for s in out.splitlines() if s.startswith("contract "))
    assert line.split() == [
        "contract",
        "qwen3-next/bf16/cpu:",
        fingerprint,
        "sampler=same",
        "trainer=same",
    ]
    assert "refused" not in out
    assert rc == 0, out


class _Half:
    """A plugin of one role whose contract hook serves or refuses the model."""

    def __init__(self, role: str, refuse: bool):
        self.role, self.refuse = role, refuse

    @hookimpl
    def lockstep_engine_info(self):
        return EngineInfo(
            plugin=f"fake-{self.role}",
            role=self.role,
            engine="fake",
            engine_version="0",
            plugin_version="0",
        )

    def _contract(self, model_dir):
        if self.refuse:
            raise NotImplementedError(REFUSAL)
        return ModelDir(model_dir, hybrid=True).contract()


class _Sampler(_Half):
    @hookimpl
    def lockstep_sampler_contract(self, model_dir, adapter_dir, backend):
        return self._contract(model_dir)


class _Trainer(_Half):
    @hookimpl
    def lockstep_trainer_contract(self, model_dir, adapter_dir, backend):
        return self._contract(model_dir)


def test_doctor_names_the_half_that_refuses_qwen3_next(next_model, capsys, monkeypatch):
    pm = plugins.manager(load_entry_points=False)
    pm.register(_Sampler("sampler", refuse=False))
    pm.register(_Trainer("trainer", refuse=True))
    monkeypatch.setattr(plugins, "manager", lambda: pm)
    rc = main(["doctor", "--model", str(next_model)])
    out = capsys.readouterr().out
    assert "sampler=same  trainer=REFUSED" in out
    assert f"refused       the trainer half refuses {next_model}: {REFUSAL}" in out
    assert rc == 1
