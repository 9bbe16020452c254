"""The repository conftest's rule for GPU tests: asked for without a CUDA device they are an
error, not a silent skip; on a machine with one, a skip is a failure unless it names missing
hardware ("needs ...") or a case the test does not cover ("not applicable: ...")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = """
import pytest

pytestmark = pytest.mark.gpu


def test_runs():
    pass


def test_engine_missing():
    pytest.skip("vLLM does not import here")


def test_two_gpus():
    pytest.skip("needs 2 CUDA devices, 1 here")


def test_other_case():
    pytest.skip("not applicable: the dense lane only")
"""


def _run(tmp_path: Path, *args: str, cuda: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")
    (tmp_path / "test_policy_sample.py").write_text(TESTS)
    # With ``cuda``, torch is made to report a device before the conftest asks.
    code = (
        "import sys, torch, pytest\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # the fast tier's 10-minute budget; CI's --all runs it
def test_asking_for_gpu_tests_without_a_device_is_an_error_naming_the_torch_build(tmp_path):
    run = _run(tmp_path, "-m", "gpu", cuda=False)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "-m gpu asks for the GPU tests, but this machine has no usable CUDA device" in (
        run.stderr
    )
    assert "built for" in run.stderr
    # Not asked for: skipped, and the run passes.
    plain = _run(tmp_path, cuda=False)
    assert plain.returncode == 0, plain.stdout
    assert "4 skipped" in plain.stdout


@pytest.mark.slow  # the fast tier's 10-minute budget; CI's --all runs it
def test_on_a_gpu_machine_a_skip_fails_unless_it_names_hardware_or_an_uncovered_case(tmp_path):
    run = _run(tmp_path, "-m", "gpu", cuda=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 1 passed, 2 skipped" in run.stdout
    assert "FAILED test_policy_sample.py::test_engine_missing" in run.stdout
    assert "a GPU test skipped on a machine with a CUDA device (vLLM does not import here)" in (
        run.stdout
    )


ENGINE_TESTS = """
import pytest


def test_unmarked_starts_an_engine():
    from vllm import LLM

    LLM()


@pytest.mark.engine
def test_marked_starts_an_engine():
    from vllm import LLM

    LLM()


def test_unmarked_starts_none():
    pass
"""


def test_a_test_that_starts_a_vllm_engine_without_the_engine_marker_fails(tmp_path):
    """The repository conftest counts vLLM's ``LLM`` constructions (a stand-in vLLM package
    here, first on the path): an unmarked test that builds one fails naming the marker; a
    marked one and an unmarked one that builds none pass."""
    fake = tmp_path / "vllm"
    (fake / "entrypoints").mkdir(parents=True)
    (fake / "__init__.py").write_text("from .entrypoints.llm import LLM\n")
    (fake / "entrypoints" / "__init__.py").write_text("")
    (fake / "entrypoints" / "llm.py").write_text(
        "class LLM:\n    def __init__(self):\n        pass\n"
    )
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: a GPU test\n    engine: an engine\n    slow: slow\n"
    )
    (tmp_path / "test_engine_sample.py").write_text(ENGINE_TESTS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "test_engine_sample.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    out = run.stdout
    assert "FAILED test_engine_sample.py::test_unmarked_starts_an_engine" in out, out[-3000:]
    assert "mark it @pytest.mark.engine" in out
    assert "PASSED test_engine_sample.py::test_marked_starts_an_engine" in out
    assert "PASSED test_engine_sample.py::test_unmarked_starts_none" in out
