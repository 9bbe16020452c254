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
- with CUDA graphs (decode steps captured, batches padded to a captured size) every request's
  decisions are the eager engine's bytes, and no decode step runs the Python forward;
- on cuda a request's decisions are the same bytes alone and inside a batch of 64, equal the
  composition run directly with the cuda programs (the cuda lane's contract; its bytes are not the
  cpu lane's), decode across the 64-token chunk equals one prefill of prompt + decisions, and a
  prefill chunked by a 24-token budget equals one prefill (controls: another seed, a weight one
  ulp off, a prompt's last token changed); with a LoRA adapter on the GDN, attention and expert
  projections (the adapter made for the cuda lane's contract), vLLM's cuda decisions replay byte
  for byte in Megatron on cuda, and the replay with one GDN factor moved by 2^-9 does not.
"""

from __future__ import annotations

import os

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


def test_megatron_on_cuda_replays_vllm_cuda_lora_decisions_on_the_hybrid_lane(next_dir, tmp_path):
    from lockstep_exact.adapters import make_adapter
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.k3 import compare
    from lockstep_exact.model import ModelDir
    from lockstep_exact.requests import CaptureRequest
    from lockstep_exact.testing import perturb_adapter
    from lockstep_megatron.replay import replay
    from lockstep_serving.vllm.capture import capture

    # The adapter names the cuda lane (the cuda programs' contract is not the cpu one's)
    cuda = ModelDir(next_dir, hybrid=True).contract("cuda").fingerprint
    ad = make_adapter(next_dir, tmp_path / "A", rank=8, seed=5, contract=cuda)
    trace = capture(
        CaptureRequest(
            model_dir=next_dir,
            prompts=tuple(default_prompts(4)),
            decisions=DECISIONS,
            out_dir=tmp_path / "A-trace",
            seed=3,
            adapter_dir=ad,
            backend="cuda",
            options={"gpu_memory_utilization": GPU_MEMORY},
        )
    )
    torch.cuda.empty_cache()
    assert trace.adapter_hash is not None and trace.num_decisions == 4 * DECISIONS
    assert any("linear_attn.in_proj_qkvz.lora_shrink" in k for k in trace.contract["sites"])
    got, _ = replay(next_dir, tmp_path / "A-trace", ad, backend="cuda", micro_batch=2)
    cmp = compare(torch.as_tensor(trace.logprobs), got)
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)
    # control: the trainer on an adapter one GDN factor 2^-9 away sees different bytes
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    pert = perturb_adapter(ad, tmp_path / "A-pert", key)
    moved, _ = replay(
        next_dir, tmp_path / "A-trace", pert, backend="cuda", micro_batch=2, control=True
    )
    assert not compare(torch.as_tensor(trace.logprobs), moved).exact


# --- on cuda: alone = in a batch of 64 = the composition on cuda; chunked; decode ---
LENGTHS = (5, 61, 64, 100, 200)  # prompts around the gdn chunk boundaries (64, 128, 192)
ACROSS = 1  # the 61-token prompt: its decisions sit at positions 61..68, across 64
LONG = 4
BATCH = 64
BUDGET = 24  # the chunked engine's token budget: every long prefill is chunked


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(16)
    more = torch.randint(3, 120, (BATCH - len(LENGTHS),), generator=gen).tolist()
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (*LENGTHS, *more)]


def _params(greedy: bool = False, seed: int = 7):
    from serving_support import rule_params

    return rule_params(DECISIONS, greedy=greedy, seed=seed)


def _decisions(out):
    from serving_support import decisions_of

    return decisions_of(out)


def _same_and_comparator(a, b, what: str) -> None:
    from serving_support import assert_same_bytes_and_comparator

    assert_same_bytes_and_comparator(a, b, what)


@pytest.fixture(scope="module")
def cuda_runs(next_dir):
    from serving_support import start_engine, stop_engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lockstep_serving.vllm.offline import prompt_logprobs

    prompts = _prompts()
    asked = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    first = asked[: len(LENGTHS)]
    r = {"prompts": prompts}
    llm = start_engine(next_dir, gpu_memory_utilization=GPU_MEMORY)
    try:
        r["batch"] = llm.generate(asked, _params(), use_tqdm=False)
        r["alone"] = {
            i: llm.generate([asked[i]], _params(), use_tqdm=False)[0] for i in (ACROSS, LONG)
        }
        (r["alone_seed_8"],) = llm.generate([asked[LONG]], _params(seed=8), use_tqdm=False)
        r["greedy"] = llm.generate(first, _params(greedy=True), use_tqdm=False)
        tokens, _ = _decisions(r["batch"][ACROSS])
        one = SamplingParams(max_tokens=1, prompt_logprobs=0, seed=7)
        whole = TokensPrompt(prompt_token_ids=prompts[ACROSS] + tokens)
        r["prompt_logprobs"] = prompt_logprobs(llm.generate([whole], one, use_tqdm=False)[0])
        moved = prompts[ACROSS][:-1] + [3 + (prompts[ACROSS][-1] - 2) % 997] + tokens
        out = llm.generate([TokensPrompt(prompt_token_ids=moved)], one, use_tqdm=False)[0]
        r["prompt_logprobs_moved"] = prompt_logprobs(out)
    finally:
        stop_engine(llm)
    torch.cuda.empty_cache()
    llm = start_engine(
        next_dir, gpu_memory_utilization=GPU_MEMORY, max_num_batched_tokens=BUDGET, max_num_seqs=8
    )
    try:
        r["chunked"] = llm.generate(first, _params(greedy=True), use_tqdm=False)
        moved = prompts[LONG][:-1] + [3 + (prompts[LONG][-1] - 2) % 997]
        (r["chunked_moved"],) = llm.generate(
            [TokensPrompt(prompt_token_ids=moved)], _params(greedy=True), use_tqdm=False
        )
    finally:
        stop_engine(llm)
    torch.cuda.empty_cache()
    return r


def test_on_cuda_a_request_alone_equals_it_in_a_batch_of_64_and_the_cuda_composition(
    cuda_runs, next_dir
):
    from safetensors.torch import load_file
    from serving_support import assert_alone_equals_batched, assert_equals_composition

    from lockstep_exact.lanes import qwen3_next as N

    for i in (ACROSS, LONG):  # control (another seed) for the long one
        seed = cuda_runs["alone_seed_8"] if i == LONG else None
        assert_alone_equals_batched(
            cuda_runs["alone"][i], cuda_runs["batch"][i], seed,
            f"prompt {i}: alone vs a batch of {BATCH} (cuda)",
        )  # fmt: skip
    # the composition on the cuda backend (the lane's contract there), prompt + decisions in
    # one pass (its log_softmax included): no engine, no cache, no batch
    weights = load_file(str(next_dir / "model.safetensors"))
    geom = N.Geometry.from_model_dir(next_dir)
    n = len(LENGTHS)
    assert_equals_composition(
        cuda_runs["batch"][:n], cuda_runs["prompts"][:n], weights, geom,
        "vLLM cuda vs the cuda composition", backend="cuda",
    )  # fmt: skip


def test_on_cuda_decode_across_the_gdn_chunk_equals_one_prefill(cuda_runs):
    from serving_support import assert_decode_equals_prefill

    n = LENGTHS[ACROSS]
    assert n < 64 < n + DECISIONS
    assert_decode_equals_prefill(
        cuda_runs["batch"][ACROSS], cuda_runs["prompt_logprobs"],
        cuda_runs["prompt_logprobs_moved"], n, DECISIONS, "decode vs one prefill (cuda)",
    )  # fmt: skip


def test_on_cuda_a_chunked_prefill_equals_one_prefill(cuda_runs):
    from lockstep_exact.parity import same_bytes

    for i, (whole, chunked) in enumerate(
        zip(cuda_runs["greedy"], cuda_runs["chunked"], strict=True)
    ):
        want_tokens, want = _decisions(whole)
        tokens, got = _decisions(chunked)
        assert tokens == want_tokens, f"prompt {i} chunked"
        _same_and_comparator(want, got, f"prompt {i}: one prefill vs chunks of {BUDGET} (cuda)")
    # control: the long prompt with its last token changed, chunked, parts from one prefill
    _, long = _decisions(cuda_runs["greedy"][LONG])
    assert not same_bytes(long, _decisions(cuda_runs["chunked_moved"])[1])


def test_on_cuda_graphs_give_the_eager_engines_bytes_and_replay_every_decode_step(
    cuda_runs, next_dir
):
    """An engine with CUDA graphs (``FULL_DECODE_ONLY``): 61 of the 64 prompts (their decode
    steps padded to a captured batch of 64, three padding rows) and the long prompt alone give
    the eager engine's bytes (that engine ran the same requests in a batch of 64 and alone) and
    the cuda composition's (no engine, no cache: the graph = eager comparison alone would hold
    for a decode step both run wrong), and every decode step was a graph replay (the Python
    forward ran none). Control: the eager engine's run with another seed differs."""
    from safetensors.torch import load_file
    from serving_support import assert_equals_composition, start_engine, stop_engine
    from vllm.inputs import TokensPrompt

    from lockstep_exact.lanes import qwen3_next as N
    from lockstep_exact.parity import same_bytes
    from lockstep_serving.vllm.offline import python_decode_steps

    asked = [TokensPrompt(prompt_token_ids=p) for p in cuda_runs["prompts"]]
    llm = start_engine(next_dir, cuda_graphs=True, gpu_memory_utilization=GPU_MEMORY)
    try:
        before = sum(llm.apply_model(python_decode_steps))
        batch = llm.generate(asked[:61], _params(), use_tqdm=False)
        (alone,) = llm.generate([asked[LONG]], _params(), use_tqdm=False)
        steps = sum(llm.apply_model(python_decode_steps)) - before
    finally:
        stop_engine(llm)
    torch.cuda.empty_cache()
    print(f"qwen3-next with CUDA graphs: {steps} decode steps ran the Python forward")
    assert steps == 0, "a decode step ran eagerly in the engine with CUDA graphs"
    for i, out in enumerate(batch):
        want_tokens, want = _decisions(cuda_runs["batch"][i])
        tokens, got = _decisions(out)
        assert tokens == want_tokens, f"prompt {i}: graphs vs eager tokens"
        _same_and_comparator(want, got, f"prompt {i}: CUDA graphs (61 padded to 64) vs eager")
    want_tokens, want = _decisions(cuda_runs["alone"][LONG])
    tokens, got = _decisions(alone)
    assert tokens == want_tokens
    _same_and_comparator(want, got, "the long prompt alone: CUDA graphs vs eager")
    assert not same_bytes(got, _decisions(cuda_runs["alone_seed_8"])[1])
    n = len(LENGTHS)
    assert_equals_composition(
        batch[:n], cuda_runs["prompts"][:n], load_file(str(next_dir / "model.safetensors")),
        N.Geometry.from_model_dir(next_dir), "vLLM cuda graphs vs the cuda composition",
        backend="cuda",
    )  # fmt: skip
