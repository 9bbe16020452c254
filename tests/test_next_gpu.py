"""The qwen3-next (hybrid, Gated DeltaNet) lane inside real vLLM 0.26 on a GPU, byte for byte.

Run on the GPU machine with ``pytest -m gpu`` (skipped elsewhere by the repository conftest;
the engine tests also skip where vLLM is not importable); docs/gpu.md records its runs. What is
asserted, each on raw bytes with a one-ulp negative control:

- the 0.26.0 patch table, hybrid rows included, holds on the installed vLLM (the dense
  suite's ``test_the_0_26_patch_table_holds_on_the_installed_vllm`` checks the whole table;
  here the hybrid rows are named so a failure says which);
- a trace captured from real vLLM 0.26 on cuda (the tiny qwen3-next, eager: 8 prompts x 8
  decisions, batched, so prefills and decode steps cross the 64-token gdn chunk) is replayed
  by real megatron-core on cuda byte for byte, and a one-ulp move of one GDN ``in_proj``
  weight in the trainer is caught;
- CUDA graphs are refused for this lane by name.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

# The lane's sampler lives on vLLM's V1 model runner (vllm/model.py refuses V2, naming this).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

DECISIONS = 8
GPU_MEMORY = 0.25  # of the device per engine: one engine at a time, freed between them


def _vllm():
    return pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    _vllm()
    from lockstep_exact.app.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("next-gpu") / "qwen3-next", arch="qwen3-next")


def test_the_hybrid_rows_of_the_0_26_table_hold_on_the_installed_vllm():
    vllm = _vllm()
    from lockstep_serving.vllm import patches

    if vllm.__version__ != "0.26.0":
        pytest.skip(f"vLLM {vllm.__version__} here; this checks the 0.26.0 table")
    table = patches.TABLES["0.26.0"]
    hybrid = {t.name for t in patches.HYBRID_SHARED} | {
        f"vllm.v1.attention.backends.registry.MambaAttentionBackendEnum{s}"
        for s in ("", ".is_overridden", ".get_path")
    }
    rows = tuple(t for t in table if t.name in hybrid)
    assert len(rows) == len(hybrid)
    assert table.with_targets(rows).problems() == []
    # control: the 0.32-only hybrid row is reported missing on 0.26
    gone = next(t for t in patches.HYBRID_0_32 if t.symbol == "MambaBase.bind_kv_cache")
    (problem,) = table.with_targets((gone,)).problems()
    assert "MambaBase.bind_kv_cache" in problem and "missing" in problem


def test_megatron_on_cuda_replays_a_hybrid_trace_captured_from_vllm_026(next_dir, tmp_path):
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.k3 import compare
    from lockstep_exact.lanes import qwen3_next as N
    from lockstep_exact.requests import CaptureRequest
    from lockstep_megatron.convert import build
    from lockstep_megatron.replay import replay, score
    from lockstep_serving.vllm.capture import capture

    trace = capture(
        CaptureRequest(
            model_dir=next_dir,
            prompts=tuple(default_prompts(8)),
            decisions=DECISIONS,
            out_dir=tmp_path / "trace",
            seed=3,
            backend="cuda",
            options={"gpu_memory_utilization": GPU_MEMORY},
        )
    )
    torch.cuda.empty_cache()
    assert trace.num_decisions == 64
    assert trace.engine["version"] == "0.26.0"
    assert trace.contract["backend"] == "cuda"
    got, seconds = replay(next_dir, tmp_path / "trace", backend="cuda")
    cmp = compare(torch.as_tensor(trace.logprobs), got)
    print(f"qwen3-next (eager): vLLM 0.26 cuda -> Megatron cuda: {cmp} ({seconds:.1f} s)")
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0
    # control: one GDN in_proj weight one ulp off in the trainer is caught (a norm weight
    # near 0 would be absorbed: the lane's norms scale by 1 + w)
    model = build(next_dir).cuda().eval()
    i = model.geom.layer_types.index(N.LINEAR)
    w = model.gpt.decoder.layers[i].self_attention.in_proj.weight
    with torch.no_grad():
        w.view(torch.int16).view(-1)[0] += 1
    assert not compare(torch.as_tensor(trace.logprobs), score(model, trace, control=True)).exact


# An engine that fails to start is run in a child process (as the dense suite's V2 refusal):
# a failed start in this process can leave its GPU state behind for the tests after it.
_GRAPHS_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
import serving_support
if __name__ == "__main__":
    try:
        serving_support.start_engine(sys.argv[1], cuda_graphs=True, gpu_memory_utilization=0.2)
        print("STARTED")
    except Exception as err:
        print("REFUSED:", type(err).__name__, err, err.__cause__ or "")
"""


def test_cuda_graphs_are_refused_for_the_hybrid_lane_by_name(next_dir):
    tests = os.path.join(os.path.dirname(__file__), "..", "packages", "serving-plugin", "tests")
    child = subprocess.run(
        [sys.executable, "-c", _GRAPHS_CHILD, str(next_dir), os.path.abspath(tests)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0"},
    )
    print(child.stdout[-2000:])
    out = child.stdout + child.stderr
    assert "STARTED" not in child.stdout, out[-3000:]
    refusal = "CUDA graphs (cudagraph_mode FULL_DECODE_ONLY) on the qwen3-next lane"
    assert refusal in out, out[-3000:]
