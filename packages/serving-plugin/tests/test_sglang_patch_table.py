"""The SGLang patch tables: one per supported SGLang (0.5.17 on the GPU, 0.5.21 on CPU), the
version gate, and the 0.5.17 table against the released 0.5.17 source.

Runs in the default environment (no SGLang): the tables are plain data, and the 0.5.17 source
is read with ast, as test_patch_table.py reads vLLM 0.26's. The installed SGLang's own table is
checked on the real package by tests/test_sglang.py (CPU, 0.5.21) and tests/test_sglang_gpu.py
(GPU, 0.5.17).
"""

from __future__ import annotations

import os

import pytest
from test_patch_table import _source_reader, _SourceTree

from lockstep_exact.patching import PatchTable
from lockstep_serving.sglang import hooks as sglang_hooks
from lockstep_serving.sglang import patches as sglang_patches
from lockstep_serving.vllm.patches import LaneRefused

SOURCE_ENV = "LOCKSTEP_SGLANG_0_5_17_SOURCE"


def test_each_supported_sglang_has_its_table():
    assert sglang_patches.SUPPORTED_SGLANG == ("0.5.17", "0.5.21")
    assert tuple(sglang_patches.TABLES) == sglang_patches.SUPPORTED_SGLANG
    for version in sglang_patches.SUPPORTED_SGLANG:
        table = sglang_patches.table_for(version)
        assert isinstance(table, PatchTable) and table is sglang_patches.TABLES[version]
        assert table.versions == (version,) and table.error is LaneRefused
        kinds = {t.kind for t in table}
        assert {"patch", "register", "read", "construct"} == kinds
        assert all(t.replacement is not None for t in table if t.kind == "patch")


def test_both_tables_patch_the_same_three_symbols():
    patched = {
        v: sorted(t.name for t in sglang_patches.TABLES[v] if t.kind == "patch")
        for v in sglang_patches.SUPPORTED_SGLANG
    }
    assert (
        patched["0.5.17"]
        == patched["0.5.21"]
        == [
            "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
            "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager",
            "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
        ]
    )


@pytest.mark.parametrize("version", ["0.5.16", "0.5.18", "0.5.20", "0.5.22", "0.6.0", "?"])
def test_another_sglang_version_is_refused_naming_both_supported_ones(version):
    table = sglang_patches.table_for(version)
    want = (
        f"SGLang {version} is not among the supported ('0.5.17', '0.5.21') (the plugin has a "
        "patch table for each: 0.5.17 on the GPU machine, 0.5.21 on CPU machines)"
    )
    assert table.problems() == [want]
    with pytest.raises(LaneRefused) as err:
        table.check()
    assert str(err.value).startswith(
        f"the Lockstep exact lane does not support this SGLang: {want}"
    )


def test_a_table_checked_against_the_other_version_names_its_own(monkeypatch):
    # A table never passes another version: 0.5.17's rows on an installed 0.5.21 are refused.
    table = sglang_patches.TABLES["0.5.17"]
    monkeypatch.setattr(table, "installed_version", lambda: "0.5.21")
    found = table.problems()
    assert len(found) == len(table)
    assert all("SGLang 0.5.21 is not among the supported ('0.5.17',)" in p for p in found)


def test_the_hooks_accept_both_versions_and_name_both_when_refusing(monkeypatch):
    for version in sglang_patches.SUPPORTED_SGLANG:
        monkeypatch.setattr(sglang_hooks, "sglang_version", lambda v=version: v)
        info = sglang_hooks.lockstep_engine_info()
        assert info.engine_version == version
        assert info.problem is None or "not among the supported" not in info.problem
    monkeypatch.setattr(sglang_hooks, "sglang_version", lambda: "0.5.19")
    info = sglang_hooks.lockstep_engine_info()
    assert sglang_patches.unsupported("0.5.19") in info.problem
    assert "'0.5.17', '0.5.21'" in info.problem


def test_the_table_module_imports_no_sglang():
    import subprocess
    import sys

    code = (
        "import sys; import lockstep_serving.sglang.patches as sp; "
        "assert sp.TABLES and 'sglang' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the 0.5.17 table against the released 0.5.17 source ----------------------------------------
class _SglangSourceTree(_SourceTree):
    """``_SourceTree`` with two forms SGLang uses: a module-level instance standing for its
    class (``ModelRegistry = _ModelRegistry()``: its fields are the class's) and a classmethod
    (read through the class, it has no ``cls`` parameter)."""

    def top(self, module, name, depth=0):
        ast = self.ast
        found = super().top(module, name, depth)
        if found is None:
            return None
        mod, node = found
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
        ):
            cls = super().top(mod, node.value.func.id, depth + 1)
            if cls is not None and isinstance(cls[1], ast.ClassDef):
                return cls
        return found

    def problems(self, target):
        ast = self.ast
        first, *rest = target.symbol.split(".")
        found = self.top(target.module, first)
        node = None
        if found is not None and rest:
            module, node = found
            for part in rest:
                node = self.members(module, node).get(part) if node is not None else None
        if isinstance(node, ast.FunctionDef) and target.params:
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            if "classmethod" in decorators:
                # what inspect.signature gives for the bound classmethod
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args][1:]
                if tuple(names[: len(target.params)]) != target.params:
                    return [f"{target.name}: parameters {names} do not start with {target.params}"]
                return []
        return super().problems(target)


def _tree():
    where = os.environ.get(SOURCE_ENV)
    if not where or not os.path.exists(where):
        pytest.skip(f"set {SOURCE_ENV} to the SGLang 0.5.17 wheel or its unpacked tree")
    tree = _SglangSourceTree(_source_reader(where))
    version = tree.source("sglang.version") or ""
    assert tree.module("sglang.srt.model_executor.model_runner") is not None, where
    return tree, version


def test_the_0_5_17_table_matches_the_sglang_0_5_17_source():
    """Every row of the 0.5.17 table against the released 0.5.17 source, read with ast (its
    wheel cannot be installed beside the CPU torch). LOCKSTEP_SGLANG_0_5_17_SOURCE names the
    wheel (sglang-0.5.17-...whl) or a directory holding its ``sglang/``; skipped without it.
    The GPU suite runs ``problems()`` on the installed 0.5.17 (tests/test_sglang_gpu.py)."""
    tree, _ = _tree()
    found = [p for t in sglang_patches.TABLES["0.5.17"] for p in tree.problems(t)]
    assert found == []


def test_the_source_reader_catches_what_is_not_there():
    """The control: the same reader names a missing symbol, a missing field and a parameter
    list that changed, in the 0.5.17 source."""
    tree, _ = _tree()
    T = sglang_patches.Target
    gone = T("sglang.srt.layers.sampler", "Sampler.no_such_method", "read", "test")
    assert tree.problems(gone) == [f"{gone.name}: missing"]
    field = T("sglang.srt.models.registry", "ModelRegistry", "read", "t", attrs=("no_field",))
    assert tree.problems(field) == [f"{field.name}: lacks field(s) ['no_field']"]
    moved = T(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo.from_schedule_batch",
        "patch",
        "t",
        params=("batch", "other"),
    )
    (problem,) = tree.problems(moved)
    assert "do not start with ('batch', 'other')" in problem


def test_an_installed_sglang_that_does_not_import_is_named_with_the_failed_import(monkeypatch):
    """An SGLang environment missing a dependency is an error naming the import that failed,
    not "SGLang (not installed)"; with no SGLang at all the table refuses as before."""
    import builtins
    import sys
    from importlib import metadata

    real_import = builtins.__import__

    def no_sglang(name, *args, **kwargs):
        if name == "sglang":
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_sglang)
    monkeypatch.setattr(metadata, "version", lambda dist: "0.5.21")
    with pytest.raises(LaneRefused) as err:
        sglang_patches.installed_version()
    assert str(err.value) == (
        f"SGLang 0.5.21 is installed for {sys.executable} but does not import "
        "(ModuleNotFoundError: No module named 'triton'); rebuild its environment with "
        "`bash tools/setup --sglang`"
    )

    def missing(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", missing)
    assert sglang_patches.installed_version() == "(not installed)"
