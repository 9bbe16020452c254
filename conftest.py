"""Repository-wide pytest setup: GPU tests run only where a CUDA device is present, and there
they pass or fail.

- Without a usable CUDA device every ``gpu`` test is skipped; but asking for them
  (``pytest -m gpu``) on such a machine, a CPU build of torch included, is an error that says
  so, not a run that skips everything and exits 0.
- With one, a ``gpu`` test that skips is reported as failed (a missing engine, a wrong engine
  version: the GPU machine must have what the test needs), unless its reason starts with
  ``needs `` (hardware this machine lacks: more GPUs, another capability) or
  ``not applicable: `` (a parametrized case the test does not cover).
- A test that starts a vLLM engine in the test process (vLLM's ``LLM``) carries the ``engine``
  marker (or ``gpu``, or ``slow``, which tiers select on their own), else it fails, naming the
  marker: the marker is what tells the engine tests apart.
"""

import importlib.abc
import importlib.util
import sys

import pytest

ALLOWED_GPU_SKIPS = ("needs ", "not applicable: ")
ENGINE_MARKS = ("engine", "gpu", "slow")  # a test that starts an engine carries one
_STARTED: list[str] = []  # the engines started in the test phase running now


class _EngineWatch(importlib.abc.MetaPathFinder):
    """Counts vLLM's ``LLM`` constructions: wraps it as ``vllm.entrypoints.llm`` is first
    imported (so importing this conftest imports no vLLM)."""

    target = "vllm.entrypoints.llm"

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # the real spec, found once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            init = module.LLM.__init__

            def counted(self, *args, **kwargs):
                _STARTED.append("vLLM's LLM")
                return init(self, *args, **kwargs)

            module.LLM.__init__ = counted

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _EngineWatch) for f in sys.meta_path):
    sys.meta_path.insert(0, _EngineWatch())
_HAS_GPU = pytest.StashKey[bool]()  # whether this run sees a usable CUDA device


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _torch_build() -> str:
    try:
        import torch
    except ImportError:
        return "no torch"
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return f"torch {torch.__version__}, built for {built}"


def gpu_asked(markexpr: str) -> bool:
    """``-m`` selects the gpu tests (``gpu``, ``gpu and not slow``), not excludes them."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pytest_configure(config):
    config.stash[_HAS_GPU] = _has_gpu()
    if gpu_asked(config.option.markexpr or "") and not config.stash[_HAS_GPU]:
        raise pytest.UsageError(
            f"-m gpu asks for the GPU tests, but this machine has no usable CUDA device "
            f"({_torch_build()}); run them on the GPU machine (tools/gpu/suite), where a test "
            "that cannot run fails instead of skipping"
        )


def pytest_collection_modifyitems(config, items):
    if config.stash[_HAS_GPU]:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started, _STARTED[:] = list(_STARTED), []
    if started and report.passed and not any(m in item.keywords for m in ENGINE_MARKS):
        report.outcome = "failed"
        report.longrepr = (
            f"this test started an engine ({started[0]}) in its {report.when} but is not "
            "marked: mark it @pytest.mark.engine (the marker tells the engine tests apart)"
        )
        return
    if not (report.skipped and item.config.stash[_HAS_GPU] and "gpu" in item.keywords):
        return
    if hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if reason.startswith(ALLOWED_GPU_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"a GPU test skipped on a machine with a CUDA device ({reason}); on the GPU machine "
        "a missing engine or another engine version is a failure"
    )
