"""The patch-table type both plugins use: check, apply (recording originals), restore."""

from __future__ import annotations

import sys
import types

import pytest

from lockstep_exact.patching import PatchTable, PatchTableError, Target


class Refused(RuntimeError):
    pass


@pytest.fixture
def engine(monkeypatch):
    """A stand-in engine module: a version, a class with a static and a plain method."""
    mod = types.ModuleType("fake_engine")
    mod.__version__ = "1.2"

    class Base:
        def inherited(self, x):
            return ("base", x)

    class Sampler(Base):
        @staticmethod
        def compute(logits, scale=1):
            return ("stock", logits)

        def step(self, batch, device):
            return ("stock step", batch)

    mod.Sampler = Sampler
    mod.helper = lambda: "stock helper"
    monkeypatch.setitem(sys.modules, "fake_engine", mod)
    return mod


def _table(*targets: Target, versions=("1.2",)) -> PatchTable:
    return PatchTable(
        "fake", "fake_engine", versions, targets, error=Refused, refusal="no lane here"
    )


def _patch(symbol, value, **kw) -> Target:
    return Target("fake_engine", symbol, "patch", "test", replacement=lambda: value, **kw)


def test_a_sound_table_has_no_problems(engine):
    table = _table(
        Target("fake_engine", "Sampler.compute", "read", "test", params=("logits",)),
        Target("fake_engine", "Sampler", "construct", "test", attrs=("step", "compute")),
    )
    assert table.problems() == []
    table.check()


def test_check_names_every_missing_or_changed_target(engine):
    table = _table(
        Target("fake_engine", "Sampler.gone", "read", "missing one"),
        Target("fake_engine", "Sampler.step", "read", "moved one", params=("self", "x")),
        Target("fake_engine", "Sampler", "read", "lacking one", attrs=("nope",)),
        Target("fake_engine", "helper", "read", "old one", versions=("0.9",)),
    )
    with pytest.raises(Refused) as err:
        table.check()
    message = str(err.value)
    assert message.startswith("no lane here: fake_engine.Sampler.gone (read: missing one): missing")
    assert (
        "fake_engine.Sampler.step (read: moved one): parameters ('self', 'batch', 'device') "
        "do not start with ('self', 'x')"
    ) in message
    assert "fake_engine.Sampler (read: lacking one): lacks field(s) ['nope']" in message
    assert "fake_engine.helper (read: old one): fake 1.2 is not among the supported ('0.9',)" in (
        message
    )


def test_an_engine_version_the_table_was_not_written_for_is_refused(engine):
    table = _table(_patch("helper", lambda: "lane"), versions=("2.0",))
    with pytest.raises(Refused, match=r"fake 1\.2 is not among the supported \('2\.0',\)"):
        table.apply()
    assert engine.helper() == "stock helper" and not table.applied


def test_apply_replaces_records_originals_and_restore_puts_them_back(engine):
    stock_compute = engine.Sampler.__dict__["compute"]
    table = _table(
        _patch(
            "Sampler.compute",
            staticmethod(lambda *a, **k: ("lane", *a)),
            params=("logits", "scale"),
        ),
        _patch("Sampler.inherited", lambda self, x: ("lane inherited", x)),
        _patch("helper", lambda: "lane helper"),
        _patch("optional", 7, may_be_absent=True),
        Target("fake_engine", "Sampler.step", "read", "read only"),
    )
    table.apply()
    table.apply()  # idempotent
    assert table.applied
    assert table.problems() == []  # checked on the originals, not on the replacements
    more = table + (Target("fake_engine", "Sampler", "read", "another row"),)
    assert more.problems() == [] and more.original("helper")() == "stock helper"
    assert engine.Sampler.compute(3) == ("lane", 3)
    assert engine.Sampler().inherited(1) == ("lane inherited", 1)
    assert engine.helper() == "lane helper" and engine.optional == 7
    assert table.original("Sampler.compute")(3) == ("stock", 3)  # a patch can call through
    assert table.original("fake_engine.helper")() == "stock helper"
    assert table.original("Sampler.inherited")(engine.Sampler(), 2) == ("base", 2)
    assert table.original("optional") is None
    table.restore()
    assert not table.applied
    assert engine.Sampler.__dict__["compute"] is stock_compute
    assert "inherited" not in engine.Sampler.__dict__  # inherited again, not shadowed
    assert engine.helper() == "stock helper" and not hasattr(engine, "optional")
    with pytest.raises(KeyError, match="helper is not a patch of the applied fake table"):
        table.original("helper")


def test_a_failing_replacement_leaves_nothing_patched(engine):
    def broken():
        raise RuntimeError("cannot build")

    table = _table(
        _patch("helper", lambda: "lane helper"),
        Target("fake_engine", "Sampler.step", "patch", "test", replacement=broken),
    )
    with pytest.raises(RuntimeError, match="cannot build"):
        table.apply()
    assert engine.helper() == "stock helper" and not table.applied


def test_malformed_tables_are_refused_naming_the_target(engine):
    with pytest.raises(PatchTableError, match=r"fake_engine\.helper: kind 'swap' is not one of"):
        Target("fake_engine", "helper", "swap", "test")
    with pytest.raises(PatchTableError, match="only 'patch' targets carry a replacement"):
        Target("fake_engine", "helper", "read", "test", replacement=lambda: 1)
    with pytest.raises(PatchTableError, match="say why the plugin touches it"):
        Target("fake_engine", "helper", "read", "")
    with pytest.raises(PatchTableError, match=r"lists \['fake_engine.helper'\] more than once"):
        _table(_patch("helper", 1), _patch("helper", 2))
    bare = Target("fake_engine", "helper", "patch", "test")
    assert _table(bare).problems() == []  # a bare patch row can be checked ...
    with pytest.raises(PatchTableError, match=r"\['fake_engine.helper'\] have no replacement"):
        _table(bare).apply()  # ... not applied


def test_a_table_reads_like_a_tuple_of_its_targets(engine):
    one = _patch("helper", 1)
    two = Target("fake_engine", "Sampler", "read", "test")
    table = _table(one) + (two,)
    assert list(table) == [one, two] and len(table) == 2
    assert table.error is Refused and table.versions == ("1.2",)
