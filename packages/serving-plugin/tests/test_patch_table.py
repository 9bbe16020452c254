"""The patch table names every vLLM symbol the plugin touches, and each exists as expected."""

from __future__ import annotations

import pytest

from lockstep_serving.vllm import patches


def test_every_patch_table_target_exists_with_its_expected_signature():
    assert patches.problems() == []


def test_a_missing_target_is_reported_by_name():
    gone = patches.Target("vllm.v1.sample.sampler", "Sampler.no_such_method", "patch", "test")
    (problem,) = patches.problems((gone,))
    assert "Sampler.no_such_method" in problem and "missing" in problem


def test_a_changed_signature_is_reported():
    moved = patches.Target(
        "vllm.v1.sample.sampler", "Sampler.compute_logprobs", "patch", "test", params=("x",)
    )
    (problem,) = patches.problems((moved,))
    assert "do not start with ('x',)" in problem


def test_an_unsupported_vllm_version_is_reported():
    old = patches.Target("vllm.v1.sample.sampler", "Sampler", "read", "test", versions=("0.1",))
    (problem,) = patches.problems((old,))
    assert "not among the supported" in problem


def test_check_fails_closed_naming_the_missing_target(monkeypatch):
    gone = patches.Target("vllm.nowhere", "Nothing", "read", "test")
    monkeypatch.setattr(patches, "TABLE", patches.TABLE + (gone,))
    with pytest.raises(patches.LaneRefused, match=r"vllm\.nowhere\.Nothing"):
        patches.check()


def test_the_plugin_patches_only_what_the_table_lists():
    from vllm.v1.sample.sampler import Sampler

    from lockstep_serving.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    patched = {(t.module, t.symbol) for t in patches.TABLE if t.kind == "patch"}
    assert {
        ("vllm.v1.sample.sampler", "Sampler.compute_logprobs"),
        ("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin.load_lora_model"),
    } <= patched
    for t in patches.TABLE:  # every patch row is in effect after register()
        if t.kind == "patch":
            assert t.resolve() is not patches.TABLE.original(t.name), t.name
    assert Sampler.compute_logprobs is vllm_plugin.exact_compute_logprobs


def test_the_vllm_table_is_the_shared_type_and_restores_what_it_patched():
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from lockstep_exact.patching import PatchTable
    from lockstep_serving.vllm import lora
    from lockstep_serving.vllm import plugin as vllm_plugin

    assert isinstance(patches.TABLE, PatchTable)
    vllm_plugin.register()
    stock = patches.TABLE.original("Sampler.compute_logprobs")
    try:
        patches.TABLE.restore()
        assert Sampler.compute_logprobs is stock
        assert LoRAModelRunnerMixin.load_lora_model is not lora.load_lora_model
    finally:
        patches.TABLE.apply()
    assert Sampler.compute_logprobs is vllm_plugin.exact_compute_logprobs
    assert LoRAModelRunnerMixin.load_lora_model is lora.load_lora_model
    assert patches.TABLE.original("Sampler.compute_logprobs") is stock


# --- the tables per vLLM version ---------------------------------------------------------------
def test_each_supported_version_has_its_table_and_this_machine_uses_its_own():
    import vllm

    assert patches.SUPPORTED_VLLM == ("0.32.0", "0.26.0")
    assert set(patches.TABLES) == set(patches.SUPPORTED_VLLM)
    assert patches.TABLE is patches.table_for(vllm.__version__)
    assert patches.TABLES["0.32.0"].versions == ("0.32.0",)
    assert patches.TABLES["0.26.0"].versions == ("0.26.0",)


def test_another_vllm_version_is_refused_naming_the_supported_ones():
    table = patches.table_for("0.27.0")
    assert table.problems() == [
        "vLLM 0.27.0 is not among the supported ('0.32.0', '0.26.0') (the plugin has a patch "
        "table for each: 0.32.0 on CPU machines, 0.26.0 on the GPU)"
    ]
    with pytest.raises(patches.LaneRefused) as err:
        table.check()
    assert str(err.value).startswith(
        "the Lockstep exact lane does not support this vLLM: vLLM 0.27.0 is not among the "
        "supported ('0.32.0', '0.26.0')"
    )


def _source_reader(where: str):
    """module name -> its source text, from a vLLM wheel or an unpacked tree; None if absent."""
    import zipfile
    from pathlib import Path

    root = Path(where)
    if root.is_file():
        zf = zipfile.ZipFile(root)
        names = set(zf.namelist())

        def read(rel):
            return zf.read(rel).decode() if rel in names else None
    else:

        def read(rel):
            p = root / rel
            return p.read_text() if p.is_file() else None

    def source(module: str):
        rel = module.replace(".", "/")
        return read(rel + ".py") or read(rel + "/__init__.py")

    return source


class _SourceTree:
    """What PatchTable.problems() checks on an installed vLLM, read from source with ast:
    the symbol (following ``from x import y``), leading parameters, class attributes (body,
    ``self.x`` in ``__init__``, bases)."""

    def __init__(self, source):
        import ast

        self.ast = ast
        self.source = source
        self.trees: dict = {}

    def module(self, name):
        if name not in self.trees:
            text = self.source(name)
            self.trees[name] = None if text is None else self.ast.parse(text)
        return self.trees[name]

    def _imported(self, module, tree, name):
        ast = self.ast
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = module.split(".")
                        if node.level:
                            is_pkg = self.source(module + ".__init__") is not None
                            base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                            target = ".".join(base + ([node.module] if node.module else []))
                        else:
                            target = node.module
                        return target, alias.name
        return None

    def top(self, module, name, depth=0):
        """(module, node) of a top-level ``name`` in ``module``, through re-exports."""
        ast = self.ast
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == name:
                    return module, node
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return module, node
        found = self._imported(module, tree, name)
        if found is None:
            return None
        target, real = found
        if self.module(target) is None:  # a submodule imported by name
            sub = f"{target}.{real}"
            return (sub, self.module(sub)) if self.module(sub) is not None else None
        return self.top(target, real, depth + 1)

    def members(self, module, cls, depth=0) -> dict:
        """name -> node of everything a class defines, bases first."""
        ast = self.ast
        out: dict = {}
        if depth > 8:
            return out
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else None
            if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name):
                name = base.value.id
            found = self.top(module, name) if name else None
            if found and isinstance(found[1], ast.ClassDef):
                out.update(self.members(found[0], found[1], depth + 1))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node
        init = out.get("__init__")
        if isinstance(init, ast.FunctionDef):
            for node in ast.walk(init):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        out.setdefault(t.attr, node)
        return out

    def problems(self, target) -> list[str]:
        ast = self.ast
        first, *rest = target.symbol.split(".")
        found = self.top(target.module, first)
        if found is None:
            return [f"{target.name}: missing"]
        module, node = found
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return [f"{target.name}: {part} is not inside a class"]
            node = self.members(module, node).get(part)
            if node is None:
                return [f"{target.name}: missing"]
        out = []
        if target.params:
            fn = node
            if isinstance(fn, ast.ClassDef):
                fn = self.members(module, fn).get("__init__")
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return [f"{target.name}: no signature"]
            a = fn.args
            names = [x.arg for x in a.posonlyargs + a.args]
            if any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list):
                names = names[1:]  # as inspect.signature gives a classmethod: bound, no cls
            names += [a.vararg.arg] if a.vararg else []
            names += [x.arg for x in a.kwonlyargs]
            if tuple(names[: len(target.params)]) != target.params:
                out.append(f"{target.name}: parameters {names} do not start with {target.params}")
        if target.attrs:
            have = self.members(module, node) if isinstance(node, ast.ClassDef) else {}
            missing = [x for x in target.attrs if x not in have]
            if missing:
                out.append(f"{target.name}: lacks field(s) {missing}")
        return out


def test_the_0_26_table_matches_the_vllm_0_26_source():
    """Every row of the 0.26.0 table against the released 0.26.0 source, read with ast (the
    wheel cannot be installed beside the CPU torch). LOCKSTEP_VLLM_0_26_SOURCE names the
    wheel (vllm-0.26.0-...whl) or a directory holding its ``vllm/``; skipped without it. The
    GPU suite runs ``problems()`` on the installed 0.26.0 (tests/test_vllm_gpu.py)."""
    import dataclasses
    import os

    where = os.environ.get("LOCKSTEP_VLLM_0_26_SOURCE")
    if not where or not os.path.exists(where):
        pytest.skip("set LOCKSTEP_VLLM_0_26_SOURCE to the vLLM 0.26.0 wheel to run this")
    tree = _SourceTree(_source_reader(where))
    assert tree.source("vllm.version") is not None or tree.source("vllm") is not None
    found = [p for t in patches.TABLES["0.26.0"] for p in tree.problems(t)]
    assert found == []
    # control: 0.32.0 rows that changed in 0.26.0 are caught by the same reader
    by_name = {t.name: t for t in patches.TABLES["0.32.0"]}
    gone = by_name["vllm.v1.kv_cache_interface.create_kv_cache_views"]
    assert tree.problems(gone) == [f"{gone.name}: missing"]
    (watermark,) = tree.problems(by_name["vllm.sampling_params.SamplingParams"])
    assert "lacks field(s) ['watermarking']" in watermark
    (layouts,) = tree.problems(by_name["vllm.v1.attention.backend.AttentionBackend"])
    assert "supported_kv_cache_layouts" in layouts
    # the hybrid lane's 0.32.0-only rows: 0.26.0 adds no mamba enum member and binds no state
    # layer through the layer (next_state.register and the runner's views replace them)
    for gone in (
        "vllm.v1.attention.backends.registry.MambaAttentionBackendEnum.register",
        "vllm.model_executor.layers.mamba.abstract.MambaBase.bind_kv_cache",
    ):
        assert tree.problems(by_name[gone]) == [f"{gone}: missing"]
    # a classmethod's parameters are read as inspect.signature gives them: without cls
    align = by_name["vllm.platforms.interface.Platform._align_hybrid_block_size"]
    assert align.params == ("vllm_config", "backend_cls") and tree.problems(align) == []
    (moved,) = tree.problems(dataclasses.replace(align, params=("cls", "vllm_config")))
    assert "do not start with ('cls', 'vllm_config')" in moved
