"""The exact lane inside real vLLM 0.26 on a GPU (issue 11), byte for byte.

Run on the GPU machine with ``pytest -m gpu`` (skipped elsewhere by the repository conftest;
the engine tests also skip where vLLM is not importable). What is asserted, each on raw bytes
with a one-ulp negative control:

- the 0.26.0 patch table holds on the installed vLLM;
- attention over a paged cache (pages in any order, anything in the unused slots) gives the
  contiguous ``attention.blocked`` cuda program's bytes, both the program's own
  ``attention_paged`` and the lane model's ``paged_attention`` (which writes the new rows
  through the slot mapping first);
- a trace captured from real vLLM 0.26 on cuda (dense and MoE, 8 prompts x 8 decisions) is
  replayed by real megatron-core on cuda byte for byte;
- inside one engine: a request alone equals the same request among 8 and among 64; a
  prefix-cache hit equals the miss; a chunked prefill equals one prefill; base, adapter A and
  adapter B in one batch each equal their solo runs.

- with CUDA graphs (``engine_args(cuda_graphs=True)``): one-token decode steps replay
  captured graphs (no Python forward runs) with the eager engine's bytes, and Megatron
  replays such a trace byte for byte; the paged decode step's programs themselves are gated
  in packages/shared-exact/tests/test_programs_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lockstep_exact.programs import Program

# The contract's program parameters (programs.CATALOG), never restated here.
BLOCK = Program.of("attention.blocked").param("block")
SEGMENT = Program.of("attention.blocked").param("segment")

pytestmark = pytest.mark.gpu

# The lane's sampler lives on vLLM's V1 model runner (vllm/model.py refuses V2, naming this).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

BF16 = torch.bfloat16
DECISIONS = 8
GPU_MEMORY = 0.25  # of the device per engine: one engine at a time, freed between them


def _vllm():
    return pytest.importorskip("vllm")


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)


def _control(a, b, what):
    """a and b are byte-identical, and the same check rejects b moved by one ulp."""
    from lockstep_exact.parity import same_bytes
    from lockstep_exact.testing import assert_same_bytes, nudge_ulp

    assert_same_bytes(a, b, what)
    assert not same_bytes(a, nudge_ulp(b)), f"{what}: the check misses a one-ulp change"


# --- the patch table ---------------------------------------------------------------------------
def test_the_0_26_patch_table_holds_on_the_installed_vllm():
    vllm = _vllm()
    from lockstep_serving.vllm import patches

    if vllm.__version__ != "0.26.0":
        pytest.skip(f"vLLM {vllm.__version__} here; this checks the 0.26.0 table")
    assert patches.TABLE is patches.TABLES["0.26.0"]
    assert patches.TABLES["0.26.0"].problems() == []
    # control: a row the installed vLLM does not have is reported by name
    gone = patches.Target("vllm.v1.sample.sampler", "Sampler.gone_in_0_26", "read", "control")
    (problem,) = patches.TABLES["0.26.0"].with_targets((gone,)).problems()
    assert "Sampler.gone_in_0_26" in problem and "missing" in problem


# --- attention over a paged cache ---------------------------------------------------------------
PAGE, HKV, HQ, D = 16, 2, 8, 64
SEQS = (  # (keys in the cache, first query position): prefill, chunk, decode, one-token prefill
    (77, 0),
    (130, 97),
    (301, 300),
    (1, 0),
    (2100, 2040),  # crosses the 2048-key segment
)


def _paged(seqs, seed):
    """Contiguous K/V per sequence, and the same rows scattered into shuffled pages of one
    cache whose unused slots hold NaN/inf. Returns (k, v, key_cache, value_cache, tables)."""
    pages = [-(-s // PAGE) for s, _ in seqs]
    num_blocks = sum(pages) + 5
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).cuda()
    key_cache = torch.full((num_blocks, HKV, PAGE, D), float("nan"), dtype=BF16, device="cuda")
    value_cache = torch.full_like(key_cache, float("inf"))
    ks, vs, tables, at = [], [], [], 0
    for i, (s, _) in enumerate(seqs):
        k = _rand(s, HKV, D, seed=seed + 10 * i)
        v = _rand(s, HKV, D, seed=seed + 10 * i + 1)
        table = perm[at : at + pages[i]]
        at += pages[i]
        t = torch.arange(s, device="cuda")
        key_cache[table[t // PAGE], :, t % PAGE] = k
        value_cache[table[t // PAGE], :, t % PAGE] = v
        ks.append(k)
        vs.append(v)
        tables.append(table)
    return ks, vs, key_cache, value_cache, tables


@pytest.mark.parametrize("block", [32, 64])
def test_attention_paged_gives_the_contiguous_programs_bytes(block):
    from lockstep_exact import programs as P
    from lockstep_exact.programs.cuda.attention import attention_paged

    ks, vs, key_cache, value_cache, tables = _paged(SEQS, seed=3)
    for i, (s, first) in enumerate(SEQS):
        q = _rand(s - first, HQ, D, seed=100 + i)
        pos = torch.arange(first, s, device="cuda")
        want = P.attention(q, ks[i], vs[i], pos, block=block, segment=SEGMENT)
        got = attention_paged(
            q, key_cache, value_cache, tables[i].int(), s, pos, block=block, segment=SEGMENT
        )
        _control(want, got, f"sequence {i} ({s} keys, rows from {first})")


@pytest.mark.parametrize("form", ["per request", "one call"])
def test_the_lane_models_paged_attention_gives_the_contiguous_programs_bytes(form):
    """vllm.model.paged_attention: new rows written through the slot mapping, then each
    request attends over its pages; a batch of five requests of every kind at once, through
    the op site per request or in one call of its many-sequence form (one launch)."""
    _vllm()
    from lockstep_exact import programs as P
    from lockstep_exact.programs import kernels as K
    from lockstep_serving.vllm.attn_backend import LaneAttentionMetadata
    from lockstep_serving.vllm.model import CachePlaces, paged_attention

    ks, vs, key_cache, value_cache, tables = _paged(SEQS, seed=5)
    kv_cache = torch.cat([key_cache, value_cache], dim=-1)  # the lane's [.., K|V] layout
    # the rows of this step are not in the cache yet: blank them, the call must write them
    qs, news, rows_k, rows_v, slots, reqs, start = [], [], [], [], [], [], 0
    for i, (s, first) in enumerate(SEQS):
        t = torch.arange(first, s, device="cuda")
        kv_cache[tables[i][t // PAGE], :, t % PAGE] = float("nan")
        qs.append(_rand(s - first, HQ, D, seed=200 + i))
        news.append(t)
        rows_k.append(ks[i][first:])
        rows_v.append(vs[i][first:])
        slots.append(tables[i][t // PAGE].long() * PAGE + t % PAGE)
        reqs.append((i, start, start + s - first, s))
        start += s - first
    max_blocks = max(len(t) for t in tables)
    table = torch.zeros(len(SEQS), max_blocks, dtype=torch.int32, device="cuda")
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    qsl = torch.tensor([0] + [e for _, _, e, _ in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in SEQS], dtype=torch.int32)
    md = LaneAttentionMetadata(
        num_actual_tokens=start,
        num_reqs=len(SEQS),
        max_query_len=max(s - f for s, f in SEQS),
        max_seq_len=max(s for s, _ in SEQS),
        query_start_loc=qsl.cuda(),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.cuda(),
        seq_lens_cpu=seq_lens,
        block_table=table,
        slot_mapping=torch.cat(slots),
    )

    class Site:  # the op site's two forms, as lanes.ops.AttentionSite has them
        def __call__(self, q, k, v, p):
            return P.attention(q, k, v, p, block=BLOCK, segment=SEGMENT)

        def varlen(self, q, k, v, p, q_starts, k_starts, *, max_rows):
            return P.attention_varlen(
                q, k, v, p, q_starts, k_starts, max_rows=max_rows, block=BLOCK, segment=SEGMENT
            )

    core = Site()
    positions = torch.cat(news)
    places = CachePlaces(md, md.slot_mapping, reqs, positions, PAGE, kv_cache.device)
    with K.noting() as notes:
        out = paged_attention(
            torch.cat(qs), torch.cat(rows_k), torch.cat(rows_v), positions, md, kv_cache,
            places, core=core, one_call=form == "one call",
        )  # fmt: skip
    assert ("cuda.attention_varlen" in notes) == (form == "one call"), notes
    for i, (r, a, b, s) in enumerate(reqs):
        want = P.attention(qs[i], ks[i], vs[i], news[i], block=BLOCK, segment=SEGMENT)
        _control(want, out[a:b], f"request {r} ({s} keys)")


# --- real vLLM 0.26 on cuda ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    _vllm()
    from lockstep_exact.app.tiny import make_tiny

    root = tmp_path_factory.mktemp("gpu-models")
    return {arch: make_tiny(root / arch, arch=arch) for arch in ("qwen3", "qwen3-moe")}


def _start(model_dir, **overrides):
    from serving_support import start_engine

    overrides.setdefault("gpu_memory_utilization", GPU_MEMORY)
    return start_engine(model_dir, **overrides)


def _stop(llm):
    from serving_support import stop_engine

    stop_engine(llm)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_megatron_on_cuda_replays_a_trace_captured_from_vllm_026(
    arch, graphs, gpu_models, tmp_path
):
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.k3 import compare
    from lockstep_exact.requests import CaptureRequest
    from lockstep_exact.testing import nudge_ulp
    from lockstep_megatron.convert import build
    from lockstep_megatron.replay import replay, score
    from lockstep_serving.vllm.capture import capture

    model_dir = gpu_models[arch]
    trace = capture(
        CaptureRequest(
            model_dir=model_dir,
            prompts=tuple(default_prompts(8)),
            decisions=DECISIONS,
            out_dir=tmp_path / "trace",
            seed=3,
            backend="cuda",
            options={"gpu_memory_utilization": GPU_MEMORY, "cuda_graphs": graphs},
        )
    )
    torch.cuda.empty_cache()
    assert trace.num_decisions == 64
    assert trace.engine["version"] == "0.26.0"
    assert trace.contract["backend"] == "cuda"
    got, seconds = replay(model_dir, tmp_path / "trace", backend="cuda")
    cmp = compare(torch.as_tensor(trace.logprobs), got)
    mode = "cuda graphs" if graphs else "eager"
    print(f"{arch} ({mode}): vLLM 0.26 cuda -> Megatron cuda: {cmp} ({seconds:.1f} s)")
    assert cmp.exact and cmp.n == 64 and cmp.k3_max == 0.0
    # control: one final-norm weight one ulp off in the trainer is caught
    model = build(model_dir).cuda().eval()
    w = model.gpt.decoder.final_layernorm.weight
    with torch.no_grad():
        w.copy_(nudge_ulp(w, 3))
    assert not compare(torch.as_tensor(trace.logprobs), score(model, trace, control=True)).exact


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_decode_steps_replayed_from_cuda_graphs_give_the_eager_bytes(arch, gpu_models):
    """The same 8 seeded requests in an eager engine and in one with CUDA graphs: every
    decision byte-equal, and with graphs no decode step ran the Python forward (each was a
    graph replay), while the eager engine ran them all."""
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_serving.vllm.offline import python_decode_steps

    prompts = default_prompts(8)
    runs = {}
    for graphs in (False, True):
        llm = _start(gpu_models[arch], cuda_graphs=graphs, max_num_seqs=16)
        try:
            before = sum(llm.apply_model(python_decode_steps))
            outs = llm.generate(prompts, _params(8), use_tqdm=False)
            runs[graphs] = (outs, sum(llm.apply_model(python_decode_steps)) - before)
        finally:
            _stop(llm)
    (eager, eager_steps), (graph, graph_steps) = runs[False], runs[True]
    print(f"{arch}: Python decode steps eager {eager_steps}, with graphs {graph_steps}")
    assert eager_steps >= DECISIONS - 1
    assert graph_steps == 0, "a decode step ran eagerly in the engine with CUDA graphs"
    for i in range(8):
        _same(eager[i], graph[i], f"prompt {i}: eager vs CUDA graphs")


_V2_CHILD = """
import os, sys
sys.path.insert(0, sys.argv[2])
os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
import serving_support
from lockstep_serving.vllm.patches import LaneRefused
if __name__ == "__main__":
    try:
        serving_support.start_engine(sys.argv[1], gpu_memory_utilization=0.2)
        print("STARTED")
    except Exception as err:
        print("REFUSED:", type(err).__name__, err)
"""


def test_the_v2_model_runner_is_refused_naming_the_variable(gpu_models):
    tests = os.path.join(os.path.dirname(__file__), "..", "packages", "serving-plugin", "tests")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    child = subprocess.run(
        [sys.executable, "-c", _V2_CHILD, str(gpu_models["qwen3"]), os.path.abspath(tests)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    print(child.stdout[-2000:])
    assert "REFUSED:" in child.stdout, child.stderr[-3000:]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in child.stdout


def _params(n, greedy=False, seed=7):
    from vllm import SamplingParams

    if greedy:
        return [SamplingParams(temperature=0.0, max_tokens=DECISIONS, logprobs=0)] * n
    return [
        SamplingParams(temperature=1.0, max_tokens=DECISIONS, logprobs=0, seed=seed + i)
        for i in range(n)
    ]


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    return list(out.outputs[0].token_ids), sampled_logprobs(out.outputs[0])


def _same(a, b, what):
    ta, la = _decisions(a)
    tb, lb = _decisions(b)
    assert ta == tb, f"{what}: tokens differ"
    _control(la, lb, what)


TARGET = 6  # default_prompts(8)[6] is longer than one 32-token block, so prefixes can hit


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def engine_runs(request, gpu_models, tmp_path_factory):
    from lockstep_exact.adapters import make_adapter
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.model import ModelDir
    from lockstep_serving.vllm.lora import lora_request_for

    model_dir = gpu_models[request.param]
    tmp = tmp_path_factory.mktemp(f"gpu-adapters-{request.param}")
    lane = ModelDir(model_dir).contract("cuda").fingerprint  # adapters name the cuda lane
    a = lora_request_for(make_adapter(model_dir, tmp / "a", rank=8, seed=1, contract=lane), 1)
    b = lora_request_for(make_adapter(model_dir, tmp / "b", rank=8, seed=2, contract=lane), 2)
    prompts = [f"{p} ({i // 8})" if i >= 8 else p for i, p in enumerate(default_prompts(8) * 8)]
    r = {"family": request.param, "prompts": prompts}
    llm = _start(model_dir, block_size=32, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:

        def gen(ps, params, loras=None):
            return llm.generate(ps, params, lora_request=loras, use_tqdm=False)

        seeded = _params(64)  # one seed per prompt, the same wherever the prompt runs
        llm.reset_prefix_cache()
        (r["miss"],) = gen([prompts[TARGET]], [seeded[TARGET]])
        (r["hit"],) = gen([prompts[TARGET]], [seeded[TARGET]])
        llm.reset_prefix_cache()
        r["batch8"] = gen(prompts[:8], seeded[:8])
        llm.reset_prefix_cache()
        r["batch64"] = gen(prompts, seeded)
        llm.reset_prefix_cache()
        r["greedy"] = gen(prompts[:8], _params(8, greedy=True))
        three = [prompts[1], prompts[2], prompts[3]]
        solo = []
        for p, sp, lr in zip(three, seeded[1:4], (None, a, b), strict=True):
            llm.reset_prefix_cache()
            solo += gen([p], [sp], lr)
        r["adapter_solo"] = solo
        llm.reset_prefix_cache()
        r["adapter_mixed"] = gen(three, seeded[1:4], [None, a, b])
        # controls of the adapter test: the same prompt under A and under B differs
        r["a_on_1"], r["b_on_1"] = gen([prompts[1]] * 2, [seeded[1]] * 2, [a, b])
    finally:
        _stop(llm)
    llm = _start(model_dir, block_size=32, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        r["chunked"] = llm.generate(prompts[:8], _params(8, greedy=True), use_tqdm=False)
    finally:
        _stop(llm)
    return r


def test_alone_equals_inside_a_batch_of_8_and_of_64(engine_runs):
    r = engine_runs
    _same(r["miss"], r["batch8"][TARGET], "alone vs batch of 8")
    _same(r["miss"], r["batch64"][TARGET], "alone vs batch of 64")
    for i in range(8):
        _same(r["batch8"][i], r["batch64"][i], f"prompt {i}: 8 vs 64 concurrent")


def test_a_prefix_cache_hit_equals_the_miss(engine_runs):
    r = engine_runs
    assert r["miss"].num_cached_tokens == 0
    assert r["hit"].num_cached_tokens > 0, "the second run should reuse cached KV blocks"
    _same(r["miss"], r["hit"], "prefix-cache miss vs hit")


def test_a_chunked_prefill_equals_one_prefill(engine_runs):
    r = engine_runs
    assert len(r["chunked"][TARGET].prompt_token_ids) > 3 * 16
    for i, (whole, chunked) in enumerate(zip(r["greedy"], r["chunked"], strict=True)):
        _same(whole, chunked, f"prompt {i}: one prefill vs chunks of 16")


def test_base_adapter_a_and_adapter_b_in_one_batch_each_equal_their_solo_runs(engine_runs):
    r = engine_runs
    for solo, mixed, what in zip(
        r["adapter_solo"], r["adapter_mixed"], ("base", "adapter A", "adapter B"), strict=True
    ):
        _same(solo, mixed, f"{what}: solo vs mixed batch")
    assert _decisions(r["a_on_1"])[1].tolist() != _decisions(r["b_on_1"])[1].tolist()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_once_started_the_lane_compiles_no_triton_kernel_while_it_serves(arch, gpu_models):
    """The lane's warm-up (``model.warm_up_lane``, run inside vLLM's kernel warm-up) and its
    kernels' specializations (no row count or sequence length is a specialization key: the
    kernels' ``do_not_specialize``): once the engine has started, a burst of prompts of many
    lengths (prefill rows from 1 to a few hundred, batched and alone, seeded and greedy, decode
    steps replayed from CUDA graphs) compiles no kernel of the lane: Triton's post-compile
    hook, which vLLM's JIT monitor uses, sees none from ``lockstep_exact``. vLLM's own kernels
    (its slot mapping, say) are listed in the message, not counted: stock vLLM runs them too.
    Control: the same hook sees the compile of a lane gemm on a shape nothing ran before."""
    from triton import knobs

    from lockstep_exact.programs.cuda.gemm import gemm as cuda_gemm

    llm = _start(gpu_models[arch], cuda_graphs=True, max_model_len=1024)
    compiled: list[tuple[str, str, str]] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        fn = kwargs.get("fn")
        compiled.append(
            (getattr(fn, "module", "?"), getattr(fn, "name", "?"), str(kwargs.get("repr")))
        )
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        gen = torch.Generator().manual_seed(5)
        lengths = [1, 2, 5, 16, 17, 33, 64, 65, 100, 129, 255, 300]
        prompts = [
            {"prompt_token_ids": torch.randint(3, 900, (n,), generator=gen).tolist()}
            for n in lengths
        ]
        llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
        llm.generate(prompts[:3], _params(3, greedy=True), use_tqdm=False)
        for p in prompts[::4]:
            llm.generate([p], _params(1), use_tqdm=False)
        served = list(compiled)
        # control: K = 48 at bk 16 loads 16 columns a step (BLOCK_K = 16), which no lane site
        # of these models takes (their K are multiples of 64); a tiling of its own per case,
        # since a kernel compiled by an earlier case of this process is not compiled again
        x = torch.ones(3, 48, dtype=BF16, device="cuda")
        w = torch.ones(24, 48, dtype=BF16, device="cuda")
        cuda_gemm(x, w, bk=16, tiling={"qwen3": "m64n32s8", "qwen3-moe": "m64n64s6"}[arch])
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = previous
        _stop(llm)
    lane = [c for c in served if c[0].startswith("lockstep")]
    assert lane == [], f"the lane compiled while serving: {lane}; all compiles: {served}"
    control = compiled[len(served) :]
    assert any(c[0].startswith("lockstep") for c in control), (
        "the hook saw no lane compile for the control, so it could not have seen one while "
        f"serving: {control}"
    )
