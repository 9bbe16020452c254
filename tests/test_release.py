"""Both plugins refuse to run beside a lockstep-exact they were not released against."""

from __future__ import annotations

import pytest

import lockstep_exact.release as release
from lockstep_exact.plugins import manager


def test_plugins_pin_the_installed_lockstep_exact():
    import lockstep_megatron._release as trainer
    import lockstep_serving._release as serving

    assert serving.EXACT_VERSION == trainer.EXACT_VERSION == release.__version__
    serving.check()
    trainer.check()


def test_a_skewed_lockstep_exact_is_refused_with_the_version_to_install(monkeypatch):
    import lockstep_megatron._release as trainer
    import lockstep_serving._release as serving

    monkeypatch.setattr(release, "__version__", "9.9.9")
    for module, name in ((serving, "lockstep-serving"), (trainer, "lockstep-megatron")):
        with pytest.raises(release.VersionSkew, match=rf"{name} .*install lockstep-exact==0\.1\.0"):
            module.check()
    problems = [i.problem for i in manager().hook.lockstep_engine_info() if i is not None]
    assert len(problems) == 2 and all("lockstep-exact 9.9.9 is installed" in p for p in problems)


def test_building_the_trainer_model_is_refused_under_skew(monkeypatch, tmp_path):
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.lanes.qwen3 import Geometry
    from lockstep_megatron.spec import LockstepGPT

    monkeypatch.setattr(release, "__version__", "9.9.9")
    geom = Geometry.from_model_dir(make_tiny(tmp_path / "m", arch="qwen3", hidden=64, vocab=300))
    with pytest.raises(release.VersionSkew):
        LockstepGPT(geom)
