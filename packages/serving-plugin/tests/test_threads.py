"""Decisions do not depend on the engine's thread count (1 vs 2 threads, separate processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from serving_support import assert_same_bytes_and_comparator

from lockstep_exact.parity import same_bytes

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
import serving_support as conftest
if __name__ == "__main__":
    import torch
    from vllm import SamplingParams
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_serving.vllm.offline import sampled_logprobs
    result = {}
    for model_dir in sys.argv[3:]:
        llm = conftest.start_engine(model_dir)
        threads = llm.apply_model(lambda model: torch.get_num_threads())[0]
        sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, logprobs=0, seed=9)
        outs = llm.generate(default_prompts(8), sp, use_tqdm=False)
        bits = [sampled_logprobs(o.outputs[0]).view(torch.int32).tolist() for o in outs]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        # control, last: the final norm's weight 0 one bf16 ulp up in place, the same requests
        llm.apply_model(conftest.nudge_engine_weight())
        outs = llm.generate(default_prompts(8), sp, use_tqdm=False)
        moved = [sampled_logprobs(o.outputs[0]).view(torch.int32).tolist() for o in outs]
        result[model_dir] = {"threads": threads, "bits": bits, "tokens": tokens, "moved": moved}
        conftest.stop_engine(llm)
    print("RESULT " + json.dumps(result))
"""


def _start(model_dirs, threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, "-", str(Path(__file__).parent), *map(str, model_dirs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(child: subprocess.Popen) -> dict:
    try:
        out, err = child.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert lines, err[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def by_threads(tiny_models):
    # both children at once: their decisions cannot depend on the timing (that is the claim),
    # and the four engine starts overlap (161 s one after the other on two cores)
    dirs = [tiny_models[f] for f in ("qwen3", "qwen3-moe")]
    children = {n: _start(dirs, n) for n in (1, 2)}
    return {n: _result(child) for n, child in children.items()}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_decisions_with_one_thread_equal_decisions_with_two(tiny_models, by_threads, family):
    key = str(tiny_models[family])
    one, two = by_threads[1][key], by_threads[2][key]
    assert (one["threads"], two["threads"]) == (1, 2)
    assert one["tokens"] == two["tokens"]
    for i, (a, b, moved) in enumerate(zip(one["bits"], two["bits"], two["moved"], strict=True)):
        a32 = torch.tensor(a, dtype=torch.int32).view(torch.float32)
        b32 = torch.tensor(b, dtype=torch.int32).view(torch.float32)
        assert_same_bytes_and_comparator(a32, b32, f"{family} prompt {i}: 1 vs 2 threads")
        # control: 2 threads on the model with one weight one ulp off part from 1 thread
        moved32 = torch.tensor(moved, dtype=torch.int32).view(torch.float32)
        assert not same_bytes(a32, moved32), f"{family} prompt {i}: a weight's ulp is missed"
