"""The qwen3-next lane inside the real vLLM engine (``vllm.next``), byte for byte.

One engine (one prefill per prompt) samples a batch, a prompt alone, a greedy batch and the
prompt logprobs of prompt + decisions; a second one with a 24-token budget chunks every
prefill. Prompt lengths put prefills, chunks and decode steps on both sides of the gdn chunk
boundaries (64, 128, 192): a lone 200-token request is chunked [48, 72) (across 64),
[120, 144) (across 128), [168, 192) (ending on 192) and [192, 200) (starting on it); the
61-token prompt's decode steps cross 64. Every comparison has a one-ulp negative control.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from serving_support import (
    _ROOT,
    assert_alone_equals_batched,
    assert_decode_equals_prefill,
    assert_equals_composition,
    decisions_of,
    embedding_nudged,
    next_composition,
    rule_params,
    start_engine,
    stop_engine,
)

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import geometry_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import Program
from lockstep_exact.testing import assert_same_bytes, nudge_ulp
from lockstep_serving.vllm.patches import LaneRefused

# The contract's program parameters (programs.CATALOG), never restated here.
CHUNK = Program.of("gdn.chunked").param("chunk")

DECISIONS = 8
LENGTHS = (5, 61, 64, 100, 200)
LONG = LENGTHS.index(200)
ACROSS = LENGTHS.index(61)  # decodes positions 61..68, across the gdn chunk boundary 64
BUDGET = 24  # the chunked engine's token budget


def _same_and_comparator(a, b, what: str) -> None:
    """a and b are byte-identical, and the comparator sees b moved by one ulp (no negative
    control: each test's control changes an input and shows the compared side moves)."""
    assert_same_bytes(a, b, what)
    assert not same_bytes(a, nudge_ulp(b)), f"{what}: the check misses a one-ulp change"


def _bf16_ulp_up(t: torch.Tensor) -> None:
    """Every element of ``t`` (a page entry, in place) one bf16 ulp further from zero: 2^16
    ulps of an fp32 element, one of a bf16 element."""
    if t.dtype == torch.float32:
        t.view(torch.int32).add_(1 << 16)
    else:
        t.view(torch.int16).add_(1)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(16)
    return [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in LENGTHS]


def _params(greedy: bool = False, seed: int = 7):
    # vLLM 0.32 on CPU and a seeded request whose prefill is chunked do not mix
    # (ENVIRONMENT.md), so the chunked engine is compared on greedy decisions.
    return rule_params(DECISIONS, greedy=greedy, seed=seed)


_decisions = decisions_of


@contextlib.contextmanager
def _spans(log: list):
    """Record (first position, row count) of every request in every step the lane runs."""
    original = N.hidden

    def hidden(ops, geom, slots, batch):
        log.append([(c.position, int(t.shape[0])) for t, c in batch])
        return original(ops, geom, slots, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(N, "hidden", hidden)
        yield log


@contextlib.contextmanager
def _after_store(position: int, move):
    """Call ``move(pages, slot)`` right after the lane stores a request's state at
    ``position`` into page ``slot``: between that step and the next, which reads it. A step
    stores through ``store_cache`` (a request at a time) or, when it ran the paged programs,
    ends in ``advance_metas``."""
    from lockstep_serving.vllm import next as V

    original, advance = V.store_cache, V.advance_metas

    def store_cache(geom, pages, slot, cache):
        original(geom, pages, slot, cache)
        if cache.position == position:
            move(pages, slot)

    def advance_metas(geom, pages, seqs, null_page):
        advance(geom, pages, seqs, null_page)
        for _start, n, first, slot in seqs.host_rows():
            if first + n == position:
                move(pages, slot)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(V, "store_cache", store_cache)
        mp.setattr(V, "advance_metas", advance_metas)
        yield


def _free_page(n_pages: int) -> int:
    """The last page that no request of the current step holds, in any cache group: vLLM's
    hybrid cache draws state pages and attention blocks from one pool over one memory, so page
    j of a state layer is block j of the attention layers (the neighbour of a request's state
    page may be its own attention block)."""
    from vllm.forward_context import get_forward_context

    held = set()
    for md in get_forward_context().attn_metadata.values():
        ids = md.state_slots if hasattr(md, "state_slots") else md.block_table
        held.update(int(j) for j in ids.flatten())
    return next(j for j in range(n_pages - 1, 0, -1) if j not in held)


def _move_s(own: bool = True):
    """A ``move`` for ``_after_store``: the first GDN layer's ``s``, every entry one bf16 ulp
    up (``_bf16_ulp_up``), in the request's page or (``own=False``) in a page nobody holds."""

    def move(pages, slot):
        s = next(iter(pages.values()))["s"]
        _bf16_ulp_up(s[slot if own else _free_page(s.shape[0])])

    return move


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny(_ROOT / "models" / "qwen3-next", arch="qwen3-next")


def _other(token: int) -> int:
    """Another token id of the prompts' range (the prompt-token control)."""
    return 3 + (token - 3 + 1) % 997


@contextlib.contextmanager
def _expert_paths():
    """Counts the routed experts' two paths in the (in-process) engine: the grouped plan
    (``programs.expert_plan``) and the per-expert dispatch (``local_dispatch``)."""
    counts = {"grouped": 0, "per_expert": 0}
    plan, dispatch = N.P.expert_plan, N.local_dispatch

    def counted_plan(*a, **k):
        counts["grouped"] += 1
        return plan(*a, **k)

    def counted_dispatch(*a, **k):
        counts["per_expert"] += 1
        return dispatch(*a, **k)

    N.P.expert_plan, N.local_dispatch = counted_plan, counted_dispatch
    try:
        yield counts
    finally:
        N.P.expert_plan, N.local_dispatch = plan, dispatch


@contextlib.contextmanager
def _gdn_paths():
    """Counts the GDN layers' two paths in the (in-process) engine: a step over the state
    pages (``programs.gdn_paged``: every request at once; ``passes`` of them a pass per
    chunk, ``programs.paged_passes``) and a request's state read into its cache
    (``next.load_cache``)."""
    from lockstep_serving.vllm import next as V

    counts = {"paged": 0, "passes": 0, "per_request": 0}
    paged, load = N.P.gdn_paged, V.load_cache

    def counted_paged(*a, **k):
        counts["paged"] += 1
        counts["passes"] += isinstance(a[6], N.P.PagedPasses)
        return paged(*a, **k)

    def counted_load(*a, **k):
        counts["per_request"] += 1
        return load(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(N.P, "gdn_paged", counted_paged)
        mp.setattr(V, "load_cache", counted_load)
        yield counts


@pytest.fixture(scope="module")
def runs(model_dir):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lockstep_serving.vllm.offline import lane_fingerprint, prompt_logprobs

    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    r = {"prompts": _prompts()}
    llm = start_engine(model_dir)
    try:
        r["fingerprint"] = lane_fingerprint(llm)
        with _spans([]) as spans, _expert_paths() as paths, _gdn_paths() as gdn:
            r["batch"] = llm.generate(prompts, _params(), use_tqdm=False)
        r["spans"], r["expert_paths"], r["gdn_paths"] = spans, paths, gdn
        (r["alone"],) = llm.generate([prompts[LONG]], _params(), use_tqdm=False)
        # control: the same request with another seed
        (r["alone_seed_8"],) = llm.generate([prompts[LONG]], _params(seed=8), use_tqdm=False)
        r["greedy"] = llm.generate(prompts, _params(greedy=True), use_tqdm=False)
        tokens, _ = _decisions(r["batch"][ACROSS])
        full = TokensPrompt(prompt_token_ids=r["prompts"][ACROSS] + tokens)
        (pl,) = llm.generate(
            [full], SamplingParams(max_tokens=1, prompt_logprobs=0, seed=7), use_tqdm=False
        )
        r["prompt_logprobs"] = prompt_logprobs(pl)
        # control: the same prefill with the prompt's last token changed
        moved = r["prompts"][ACROSS][:-1] + [_other(r["prompts"][ACROSS][-1])] + tokens
        (pl,) = llm.generate(
            [TokensPrompt(prompt_token_ids=moved)],
            SamplingParams(max_tokens=1, prompt_logprobs=0, seed=7),
            use_tqdm=False,
        )
        r["prompt_logprobs_moved"] = prompt_logprobs(pl)
        # The 61-token prompt alone, its page's s moved after the step that stores the state at
        # the chunk end 64 (control), and a page no request holds moved instead.
        for key, own in (("page_moved", True), ("other_page_moved", False)):
            with _after_store(CHUNK, _move_s(own)):
                (r[key],) = llm.generate([prompts[ACROSS]], _params(greedy=True), use_tqdm=False)
    finally:
        stop_engine(llm)
    llm = start_engine(model_dir, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    try:
        with _spans([]) as spans:
            r["chunked_alone"] = [
                llm.generate([p], _params(greedy=True), use_tqdm=False)[0] for p in prompts
            ]
        r["chunked_spans"] = spans
        r["chunked_batch"] = llm.generate(prompts, _params(greedy=True), use_tqdm=False)
        # control: the long prompt with its last token changed, chunked the same way
        moved = r["prompts"][LONG][:-1] + [_other(r["prompts"][LONG][-1])]
        (r["chunked_moved"],) = llm.generate(
            [TokensPrompt(prompt_token_ids=moved)], _params(greedy=True), use_tqdm=False
        )
    finally:
        stop_engine(llm)
    return r


@pytest.mark.engine
def test_sampled_logprobs_equal_the_composition_run_directly(runs, model_dir):
    """vLLM prefills each prompt and decodes token by token; the reference runs prompt +
    decisions as one prefill through lanes.qwen3_next.forward (its log_softmax included)."""
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = N.Geometry.from_model_dir(model_dir)
    assert [(0, n) for n in LENGTHS] in runs["spans"]  # one prefill per prompt, one step
    for out, prompt in zip(runs["batch"], runs["prompts"], strict=True):
        assert list(out.prompt_token_ids) == prompt
    assert_equals_composition(
        runs["batch"], runs["prompts"], weights, geom, "vLLM vs composition"
    )  # with its control: the composition on a model one embedding ulp off


@pytest.mark.engine
def test_decode_logprobs_equal_prompt_logprobs_across_the_gdn_chunk_boundary(runs):
    n = LENGTHS[ACROSS]
    assert n < 64 < n + DECISIONS
    assert_decode_equals_prefill(
        runs["batch"][ACROSS], runs["prompt_logprobs"], runs["prompt_logprobs_moved"], n,
        DECISIONS, "decode vs one prefill",
    )  # fmt: skip


@pytest.mark.engine
def test_a_request_alone_equals_it_inside_a_batch(runs):
    assert_alone_equals_batched(
        runs["alone"], runs["batch"][LONG], runs["alone_seed_8"], "alone vs batch of 5"
    )


@pytest.mark.engine
def test_a_decode_step_reads_its_state_from_its_page(runs):
    """In the engine, between two decode steps of the 61-token prompt: its state page's ``s``
    one bf16 ulp up (every entry) after the step that stored the state at 64 moves the decision
    of the next step (position 64, which reads it) and none before; the same move on a page no
    request holds moves no byte. (One entry's ulp rounds away: see the round trip test.)"""
    tokens, want = _decisions(runs["greedy"][ACROSS])
    k = CHUNK - (LENGTHS[ACROSS] - 1)  # decision k is the step at position 64
    _, moved = _decisions(runs["page_moved"])
    assert same_bytes(moved[:k], want[:k]), "a step before the move changed"
    assert not same_bytes(moved[k : k + 1], want[k : k + 1]), "the step did not read its page"
    other_tokens, other = _decisions(runs["other_page_moved"])
    assert other_tokens == tokens
    _same_and_comparator(want, other, "a free page's s moved vs the greedy batch")


@pytest.mark.engine
def test_chunked_prefill_equals_one_prefill(runs):
    # The lone 200-token request's prefill chunks, as the lane ran them.
    chunks = {s for step in runs["chunked_spans"] for s in step if s[1] > 1}
    assert {(48, 24), (120, 24), (168, 24), (192, 8)} <= chunks  # across, across, to, from
    assert all(n <= BUDGET for step in runs["chunked_spans"] for _, n in step)
    for i, (whole, alone, batch) in enumerate(
        zip(runs["greedy"], runs["chunked_alone"], runs["chunked_batch"], strict=True)
    ):
        want_tokens, want = _decisions(whole)
        for name, out in (("alone", alone), ("in a batch", batch)):
            tokens, got = _decisions(out)
            assert tokens == want_tokens, f"prompt {i} chunked {name}"
            _same_and_comparator(want, got, f"prompt {i}: one prefill vs chunks of {BUDGET} {name}")
    # control: the long prompt with its last token changed, chunked, parts from one prefill
    assert not same_bytes(_decisions(runs["greedy"][LONG])[1], _decisions(runs["chunked_moved"])[1])


@pytest.mark.engine
def test_the_routed_experts_run_grouped_and_give_the_per_expert_bytes(runs):
    """The served batch ran its routed experts grouped (an expert plan a MoE layer and step,
    each projection one grouped call), never an expert at a time; the composition run
    directly takes the per-expert path, so ``test_sampled_logprobs_equal_the_composition_run_
    directly`` holds the two to the same bytes."""
    paths = runs["expert_paths"]
    assert paths["grouped"] > 0 and paths["per_expert"] == 0, paths


@pytest.mark.engine
def test_decode_steps_run_every_request_over_its_state_page_at_once(runs, model_dir):
    """Every step of the batch ran the paged programs, every request at once: its prefill
    step (prompts of 100 and 200 tokens cross gdn chunks) a pass per chunk, its decode steps
    (one row a request, inside one chunk) in one call; no request's state was read into a
    cache. The sampled tokens' bytes against the composition run directly, a request at a
    time (``test_sampled_logprobs_equal_the_composition_run_directly``), and decode against
    one prefill hold the paged steps to the per-request bytes."""
    paths = runs["gdn_paths"]
    kinds = N.Geometry.from_model_dir(model_dir).layer_types
    gdn_layers = sum(kind == N.LINEAR for kind in kinds)
    assert paths["per_request"] == 0, paths
    assert paths["passes"] == gdn_layers, paths  # the prefill step, in passes
    assert paths["paged"] == gdn_layers * DECISIONS, paths  # and every decode step


@pytest.mark.engine
def test_the_engine_reports_the_contract_of_the_qwen3_next_lane(runs, model_dir):
    contract = geometry_contract(N.Geometry.from_model_dir(model_dir))
    assert contract.lane == "qwen3-next/bf16/cpu"
    assert runs["fingerprint"] == contract.fingerprint


# --- capture ------------------------------------------------------------------------------------
@pytest.mark.engine
def test_lockstep_capture_records_the_lanes_logprobs(model_dir, tmp_path):
    import lockstep_serving.vllm.hooks
    from lockstep_exact.plugins import manager
    from lockstep_exact.requests import CaptureRequest
    from lockstep_exact.trace import Trace

    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.vllm.hooks)
    request = CaptureRequest(
        model_dir=model_dir,
        prompts=tuple(default_prompts(2)),
        decisions=3,
        out_dir=tmp_path / "t",
        seed=3,
    )
    trace = pm.hook.lockstep_capture(request=request)
    assert Trace.load(tmp_path / "t").num_decisions == 2 * 3
    assert trace.contract["lane"] == "qwen3-next/bf16/cpu"
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = N.Geometry.from_model_dir(model_dir)
    want = []
    for i in range(trace.num_sequences):
        prompt, sampled = trace.prompt(i), trace.sampled(i)
        ref = N.forward_logprobs(weights, geom, torch.cat([prompt, sampled]))
        want += [ref[len(prompt) - 1 + j, int(t)] for j, t in enumerate(sampled)]
    _same_and_comparator(torch.stack(want), trace.logprobs, "captured vs composition")
    # control: the composition on the model with one weight one ulp off parts from the capture
    prompt, sampled = trace.prompt(0).tolist(), trace.sampled(0).tolist()
    moved = next_composition(embedding_nudged(weights, prompt[0]), geom, prompt, sampled)
    assert not same_bytes(moved, trace.sequence_logprobs(0))


# --- refusals at start --------------------------------------------------------------------------
def _refused(model_dir, match, **overrides):
    with pytest.raises(Exception, match=match):
        llm = start_engine(model_dir, **overrides)
        stop_engine(llm)


@pytest.mark.engine
def test_prefix_caching_is_refused_by_name(model_dir):
    _refused(
        model_dir,
        r"prefix caching on the qwen3-next lane: vLLM would resume a request from the Gated "
        r"DeltaNet state it checkpoints at its own block boundaries",
        enable_prefix_caching=True,
    )


def _config(**changes):
    """A stand-in of the vllm_config fields ``check_hybrid`` reads: a plain engine's."""
    cache = dict(enable_prefix_caching=False, mamba_cache_dtype="auto")
    cache["mamba_ssm_cache_dtype"] = "auto"
    cache.update({k: v for k, v in changes.items() if k in cache})
    from vllm.config.compilation import CUDAGraphMode

    graphs = CUDAGraphMode[changes.get("graphs", "NONE")]
    return SimpleNamespace(
        cache_config=SimpleNamespace(**cache),
        parallel_config=SimpleNamespace(tensor_parallel_size=changes.get("tp", 1)),
        device_config=SimpleNamespace(device_type=changes.get("device", "cpu")),
        compilation_config=SimpleNamespace(cudagraph_mode=graphs),
        lora_config=changes.get("lora"),
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"tp": 2},
            r"the qwen3-next lane runs on one device so far \(tp 1, ep 1\); asked for tp 2",
        ),
        ({"enable_prefix_caching": True}, r"prefix caching on the qwen3-next lane"),
        (
            {"mamba_cache_dtype": "float16"},
            r"mamba_cache_dtype 'float16': the qwen3-next lane keeps its Gated DeltaNet state in "
            r"the programs' dtypes",
        ),
        (
            {"mamba_ssm_cache_dtype": "bfloat16"},
            r"mamba_ssm_cache_dtype 'bfloat16': the qwen3-next lane keeps its Gated DeltaNet "
            r"state in fp32",
        ),
    ],
)
def test_what_the_hybrid_lane_does_not_cover_is_refused_by_name(model_dir, changes, message):
    from lockstep_serving.vllm.next import check_hybrid

    geom = N.Geometry.from_model_dir(model_dir)
    check_hybrid(_config(), geom)  # a plain engine passes
    with pytest.raises(LaneRefused, match=r"Lockstep exact lane refused to start: .*" + message):
        check_hybrid(_config(**changes), geom)


def test_graphs_on_cuda_are_taken_and_refused_only_without_an_attention_layer(
    model_dir, monkeypatch
):
    """On cuda the lane takes vLLM's CUDA graph modes (its decode steps are graph-safe; the
    state and attention backends declare single-token decodes, so vLLM captures only those:
    tests/test_next_gpu.py compares them with eager on the GPU); a model with no full
    attention layer is refused by name (the captured step tells padding rows by an attention
    layer's slot mapping). The cpu engine's mode is not the lane's concern. (The cuda contract
    needs Triton, which this machine lacks: its check is skipped here.)"""
    from lockstep_serving.vllm import next as nxt
    from lockstep_serving.vllm.next import check_hybrid

    monkeypatch.setattr(nxt, "geometry_contract", lambda *a, **k: None)
    geom = N.Geometry.from_model_dir(model_dir)
    assert N.FULL in geom.layer_types
    for mode in ("FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE", "PIECEWISE"):
        check_hybrid(_config(device="cuda", graphs=mode), geom)
    linear_only = SimpleNamespace(layer_types=(N.LINEAR, N.LINEAR))  # refused before it is read
    with pytest.raises(LaneRefused, match=r"CUDA graphs \(cudagraph_mode FULL_DECODE_ONLY\) on "
                       r"a qwen3-next model without a full attention layer"):  # fmt: skip
        check_hybrid(_config(device="cuda", graphs="FULL_DECODE_ONLY"), linear_only)
    check_hybrid(_config(device="cpu", graphs="FULL_DECODE_ONLY"), geom)


def test_the_state_metadata_keeps_every_steps_pages_in_one_buffer():
    """The state builder hands each step's pages (the block table's first column) in the same
    memory every step, sized for any batch vLLM can build (a CUDA graph reads the addresses it
    was captured with); a larger batch is refused by name."""
    from lockstep_serving.vllm.next_state import LaneStateMetadataBuilder

    config = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=6),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=5),
    )
    builder = LaneStateMetadataBuilder(None, [], config, torch.device("cpu"))

    def step(pages):
        n = len(pages)
        cm = SimpleNamespace(
            num_reqs=n, num_actual_tokens=n, query_start_loc_cpu=torch.arange(n + 1),
            seq_lens=torch.full((n,), 3), _seq_lens_cpu=torch.full((n,), 3),
            block_table_tensor=torch.tensor([[p, 99] for p in pages], dtype=torch.int32),
        )  # fmt: skip
        return builder.build(0, cm).state_slots

    first = step([7, 3, 5])
    assert first.tolist() == [7, 3, 5] and first.dtype == torch.int64
    second = step([2, 9, 4, 8, 6, 1])  # six requests: max_num_batched_tokens' room
    assert second.tolist() == [2, 9, 4, 8, 6, 1]
    assert second.data_ptr() == first.data_ptr()
    with pytest.raises(LaneRefused, match="a batch of 7 requests, more than the state metadata"):
        step([1, 2, 3, 4, 5, 6, 7])


def test_the_state_backend_takes_the_custom_mamba_slot_where_names_cannot_be_added(monkeypatch):
    """vLLM 0.26 has no MambaAttentionBackendEnum.register: the lane's state backend takes the
    CUSTOM member (register_backend(..., is_mamba=True)), and refuses it when another class
    holds it. Run here on 0.32's enum, which has the same CUSTOM member and override map."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

    from lockstep_serving.vllm import next_state

    custom = MambaAttentionBackendEnum.CUSTOM
    assert not custom.is_overridden()
    monkeypatch.setattr(next_state, "NAMES_ADDED", False)
    try:
        assert next_state.register() is custom
        assert custom.get_class() is next_state.LaneStateBackend
        assert next_state.register() is custom  # idempotent
        register_backend(custom, "some.other.Backend", is_mamba=True)
        held = r"CUSTOM mamba backend is already registered to 'some.other.Backend'"
        with pytest.raises(LaneRefused, match=held):
            next_state.register()
    finally:
        custom.clear_override()
    # this vLLM (0.32) adds a member by name
    monkeypatch.undo()
    assert next_state.register() is MambaAttentionBackendEnum["LOCKSTEP_GDN_STATE"]


def test_engine_args_turn_prefix_caching_off_for_qwen3_next_only(model_dir):
    from lockstep_serving.vllm.offline import engine_args

    args = engine_args(model_dir)
    assert args["enable_prefix_caching"] is False
    assert args["hf_overrides"]["architectures"] == ["LockstepQwen3NextForCausalLM"]
    dense = make_tiny(_ROOT / "models" / "qwen3-for-next", arch="qwen3")
    assert "enable_prefix_caching" not in engine_args(dense)


# --- the state pages, without an engine ---------------------------------------------------------
def _fake_pages(geom, n_pages: int = 3):
    from lockstep_serving.vllm.next import state_layout

    layers = [i for i, k in enumerate(geom.layer_types) if k == N.LINEAR]
    return {
        i: {
            name: torch.full((n_pages, *shape), 7, dtype=dt)
            for name, shape, dt in state_layout(geom)
        }
        for i in layers
    }


def test_a_state_page_round_trip_keeps_every_byte_and_the_next_step(model_dir):
    """store_cache then load_cache gives back the composition's cache byte for byte, and
    continuing from it gives the bytes of continuing from the original: at a gdn chunk start
    (no cached rows: the page's ``s`` carries every earlier token) and 6 rows into a chunk.

    Control: a page entry moved before the next step reads it moves that step's bytes. Not one
    ulp of one entry: ``s`` is the state at the chunk start c, and the step at position p reads
    it only as exp(g_c + ... + g_p) * (s^T q_p), the decay of every token since c. On the tiny
    model that factor is 0.02..0.5 per value head at p = c (the s term: up to 0.4 of the GDN
    output), but 1e-8..3e-3 at p = c + 6 (the s term: at most 2e-3 of the output, about the
    half ulp 2^-9 of its bf16 rounding), so at c + 6 a move of ``s`` by a small fraction rounds
    away (one ulp of one entry, or 2^16 of them, did: docs/controls.md). The controls move a
    whole entry by one bf16 ulp, the resolution of the bf16 output it feeds: at c all of ``s``
    (its term moves by 2^-7 of itself: up to about a half ulp of the output, across many of the
    step's 512 GDN outputs); at c + 6 the last cached row's ``u`` (token c + 5, one token's decay
    away: the forward substitution's solution the page keeps, which the next step reads in place
    of solving that row again from its ``v``, so moving the cached ``v`` no longer reaches it).

    The engine side (a decode step reads its own page in vLLM):
    ``test_a_decode_step_reads_its_state_from_its_page``."""
    from lockstep_serving.vllm.next import load_cache, store_cache

    weights = load_file(str(model_dir / "model.safetensors"))
    geom = N.Geometry.from_model_dir(model_dir)
    prompt = _prompts()[LONG]
    for position in (CHUNK, CHUNK + 6):
        w = position - CHUNK  # the chunk's cached rows
        cache = N.NextCache.empty(geom)
        N.forward_logprobs(weights, geom, torch.tensor(prompt[:position]), cache)
        pages = _fake_pages(geom)
        store_cache(geom, pages, 1, cache)
        back = load_cache(geom, pages, 1, position)
        for i, st in cache.gdn.items():
            got = back.gdn[i]
            assert (got.start, got.chunk, got.position) == (CHUNK, geom.chunk, position)
            for name in ("s", "k", "v", "g", "beta", "u", "gcum"):
                want, have = getattr(st, name), getattr(got, name)
                check = _same_and_comparator if want.numel() else assert_same_bytes  # no rows
                check(want, have, f"at {position}: layer {i} {name}")
            assert torch.equal(cache.conv[i], back.conv[i])
        # Attention K/V live in vLLM's pages, not in the state: each next step gets its own copy
        # of the original's (a shared dict would give a later step the K/V an earlier one added
        # at ``position``, and it would attend those instead of its own).
        kv = dict(cache.keys), dict(cache.values)
        nxt = torch.tensor(prompt[position : position + 1])

        def next_step(c, kv=kv, nxt=nxt):
            c.keys, c.values = dict(kv[0]), dict(kv[1])
            return N.forward_logprobs(weights, geom, nxt, c)

        a = next_step(cache)
        b = next_step(back)
        _same_and_comparator(a, b, f"at {position}: next step from the original vs from the pages")
        # control: one page entry one bf16 ulp up before the next step reads it (docstring)
        page = pages[next(iter(cache.gdn))]
        entry = page["s"][1] if w == 0 else page["u"][1, w - 1]
        _bf16_ulp_up(entry)
        assert not same_bytes(a, next_step(load_cache(geom, pages, 1, position))), (
            f"at {position}: the check misses a moved state page entry"
        )


def test_a_page_of_another_position_is_refused(model_dir):
    from lockstep_serving.vllm.next import load_cache, store_cache

    geom = N.Geometry.from_model_dir(model_dir)
    pages = _fake_pages(geom)
    cache = N.NextCache.empty(geom)
    store_cache(geom, pages, 0, cache)
    with pytest.raises(
        LaneRefused,
        match=r"the state page 0 of layer 0 holds position 0 \(chunk 64\) but the request "
        r"continues at position 5 \(chunk 64\): the page does not belong",
    ):
        load_cache(geom, pages, 0, 5)
    fresh = load_cache(geom, pages, 2, 0)  # position 0: the zero state, whatever the page holds
    assert torch.equal(fresh.gdn[0].s, P.gdn_state(2, 4, 128, 128, chunk=CHUNK).s)


def test_a_state_at_another_position_is_not_stored(model_dir):
    from lockstep_serving.vllm.next import store_cache

    geom = N.Geometry.from_model_dir(model_dir)
    cache = N.NextCache.empty(geom)
    cache.position = 3
    with pytest.raises(LaneRefused, match=r"layer 0's state is at position 0 \(chunk 64\), its "):
        store_cache(geom, _fake_pages(geom), 0, cache)


def test_the_state_layer_refuses_a_binding_of_another_layout(model_dir):
    from lockstep_serving.vllm.next import LockstepQwen3NextForCausalLM, state_layout
    from lockstep_serving.vllm.next_state import LaneStateLayer, LaneStateMetadataBuilder

    geom = N.Geometry.from_model_dir(model_dir)
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    layer = LaneStateLayer("model.layers.0.linear_attn", state_layout(geom), config)
    assert layer.get_state_shape()[1] == (4, 128, 128)
    assert layer.get_state_dtype()[1] == torch.float32
    with pytest.raises(ValueError, match="duplicate layer name"):
        LaneStateLayer("model.layers.0.linear_attn", state_layout(geom), config)
    layer.kv_cache = tuple(torch.zeros(2, *s, dtype=d) for _, s, d in state_layout(geom))
    assert set(layer.pages()) == {n for n, _, _ in state_layout(geom)}
    n = len(state_layout(geom))
    layer.kv_cache = (torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16),) * n
    with pytest.raises(LaneRefused, match=r"state 'meta' is bound as torch.bfloat16"):
        layer.pages()
    layer.kv_cache = layer.kv_cache[:2]
    with pytest.raises(LaneRefused, match=rf"was bound 2 state tensors, not the lane's {n}"):
        layer.pages()
    align = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="align"))
    with pytest.raises(LaneRefused, match=r"mamba_cache_mode 'align': the qwen3-next lane keeps"):
        LaneStateMetadataBuilder(None, [], align, torch.device("cpu"))
    with pytest.raises(LaneRefused, match=r"state pages are never copied by vLLM"):
        LockstepQwen3NextForCausalLM.get_mamba_state_copy_func()


def _bare_model(model_dir, by_layer, monkeypatch):
    """The lane model without an engine: a step's metadata handed in by ``by_layer``."""
    import vllm.forward_context as fc
    from torch import nn

    from lockstep_serving.vllm import next as V

    geom = N.Geometry.from_model_dir(model_dir)
    model = V.LockstepQwen3NextForCausalLM.__new__(V.LockstepQwen3NextForCausalLM)
    nn.Module.__init__(model)
    model.geom, model.gdn_layers, model.attn_layers = geom, [0], [1]
    model.device = torch.device("cpu")
    model.layer_names = {1: V.ATTN_PREFIX.format(1)}
    pages = _fake_pages(geom)
    model.state = [SimpleNamespace(pages=lambda: pages[0])]
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata=by_layer))
    return model


def _state_md(qsl, seq_lens):
    from lockstep_serving.vllm.next_state import LaneStateMetadata

    return LaneStateMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=qsl[-1],
        query_start_loc_cpu=torch.tensor(qsl),
        seq_lens_cpu=torch.tensor(seq_lens),
        state_slots=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens),
    )


def test_a_step_the_state_cannot_continue_is_refused(model_dir, monkeypatch):
    from lockstep_serving.vllm.next import ATTN_PREFIX, STATE_PREFIX

    ids = torch.tensor([5, 6, 7])
    smd = _state_md([0, 3], [3])
    model = _bare_model(model_dir, {STATE_PREFIX.format(0): smd}, monkeypatch)
    with pytest.raises(LaneRefused, match=r"request 0: vLLM's positions 1..3 are not the cache's"):
        model.forward(ids, torch.tensor([1, 2, 3]))
    with pytest.raises(LaneRefused, match=r"inputs_embeds are not part of the lane"):
        model.forward(ids, torch.tensor([0, 1, 2]), inputs_embeds=torch.zeros(3, 128))
    other = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 2]))
    by_layer = {STATE_PREFIX.format(0): smd, ATTN_PREFIX.format(1): other}
    model = _bare_model(model_dir, by_layer, monkeypatch)
    with pytest.raises(LaneRefused, match=r"the attention and state metadata of one step place"):
        model.forward(ids, torch.tensor([0, 1, 2]))


@pytest.mark.engine
def test_weights_the_lane_does_not_load_are_refused(model_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    for name, change, message in (
        ("fp16", "half", r"'model.layers.0.linear_attn.A_log' is torch.float16; the exact lane"),
        ("extra", "extra", r"unexpected tensor 'model.layers.0.linear_attn.extra' in the"),
    ):
        out = tmp_path / name
        shutil.copytree(model_dir, out)
        weights = load_file(str(out / "model.safetensors"))
        key = "model.layers.0.linear_attn.A_log"
        if change == "half":
            weights[key] = weights[key].half()
        else:
            weights["model.layers.0.linear_attn.extra"] = weights[key].clone()
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(Exception, match=message):
            llm = start_engine(out)
            stop_engine(llm)


def test_a_steps_page_metas_are_read_once_and_checked_as_each_page_reads_its_own(model_dir):
    """``page_metas`` reads every GDN layer's (position, chunk) of the step's pages in one copy;
    ``load_cache`` given them refuses a page of another position as it does reading the page
    itself, and gives the same cache bytes."""
    from lockstep_serving.vllm.next import load_cache, page_metas, store_cache

    geom = N.Geometry.from_model_dir(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    pages = _fake_pages(geom, 4)
    cache = N.NextCache.empty(geom)
    N.forward_logprobs(weights, geom, torch.tensor(_prompts()[LONG][:7]), cache)
    store_cache(geom, pages, 1, cache)
    store_cache(geom, pages, 3, N.NextCache.empty(geom))
    metas = page_metas(pages, [1, 3])
    layers = list(pages)
    assert metas == {1: {i: (7, CHUNK) for i in layers}, 3: {i: (0, CHUNK) for i in layers}}
    own, given = load_cache(geom, pages, 1, 7), load_cache(geom, pages, 1, 7, metas[1])
    for i in layers:
        for name in ("s", "k", "v", "g", "beta", "u", "gcum"):
            assert_same_bytes(getattr(own.gdn[i], name), getattr(given.gdn[i], name), name)
    with pytest.raises(LaneRefused, match=r"state page 3 of layer \d+ holds position 0"):
        load_cache(geom, pages, 3, 7, metas[3])
    assert page_metas(pages, []) == {} and page_metas({}, [1]) == {}


def _pages_with_one_at_seven(model_dir, n: int, page: int):
    """(geometry, ``n`` state pages of random bytes by GDN layer) with page ``page`` holding the
    long prompt's state after its first 7 tokens."""
    from lockstep_serving.vllm.next import store_cache

    geom = N.Geometry.from_model_dir(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    pages = _fake_pages(geom, n)
    cache = N.NextCache.empty(geom)
    N.forward_logprobs(weights, geom, torch.tensor(_prompts()[LONG][:7]), cache)
    store_cache(geom, pages, page, cache)
    return geom, pages


@pytest.mark.parametrize("on_device", [False, True])
def test_a_steps_positions_and_pages_are_checked_on_the_host_or_asserted_on_the_device(
    model_dir, on_device
):
    """``check_positions`` and ``check_pages`` (the step's checks of vLLM's positions and of
    each continuing request's page): on cpu refused by name, on cuda asserted on the device (no
    host read; here forced on cpu tensors, where the assert raises at once). Pages and
    positions that match pass either way."""
    from lockstep_serving.vllm.next import check_pages, check_positions

    geom, pages = _pages_with_one_at_seven(model_dir, 4, 1)
    slots = torch.tensor([3, 1])  # request 0's page 3 (fresh), request 1's page 1
    steps = [(0, 0, 5, 5, 0), (1, 5, 6, 8, 7)]  # (r, start, end, seq_len, first)
    positions = torch.tensor([0, 1, 2, 3, 4, 7])
    check_positions(positions, steps, on_device)
    check_pages(geom, pages, slots, steps, on_device)
    refused = RuntimeError if on_device else LaneRefused
    with pytest.raises(refused, match=None if on_device else "positions 6..6 are not"):
        check_positions(torch.tensor([0, 1, 2, 3, 4, 6]), steps, on_device)
    with pytest.raises(refused, match=None if on_device else "holds position 7"):
        check_pages(geom, pages, slots, [(0, 0, 5, 5, 0), (1, 5, 6, 9, 8)], on_device)


def test_a_decode_steps_checks_and_page_marks_run_on_the_device_and_skip_padding(model_dir):
    """The graph-safe decode step's ``check_decode_pages`` (each live row its request's last
    token, each continuing request's page at its position; asserted on the device, here on
    cpu tensors where the assert raises at once) and ``advance_metas`` (live pages to
    the next position, padding entries' mark into the null page only). Padding rows (not
    live) pass whatever their positions and pages hold."""
    from lockstep_serving.vllm.next import advance_metas, check_decode_pages

    geom, pages = _pages_with_one_at_seven(model_dir, 5, 2)
    slots = torch.tensor([2, 4, 0, 0])  # request 0 continues at 7, 1 starts, 2 and 3 padding
    positions = torch.tensor([7, 0, 5, 0])
    seq_lens = torch.tensor([8, 1, 0, 0])
    live = torch.tensor([True, True, False, False])
    check_decode_pages(geom, pages, slots, positions, seq_lens, live)
    with pytest.raises(RuntimeError):  # a live row that is not its request's last token
        check_decode_pages(geom, pages, slots, positions, torch.tensor([9, 1, 0, 0]), live)
    with pytest.raises(RuntimeError):  # a page that holds another position
        check_decode_pages(geom, pages, slots, torch.tensor([8, 0, 5, 0]),
                           torch.tensor([9, 1, 0, 0]), live)  # fmt: skip
    before = {i: p["meta"].clone() for i, p in pages.items()}
    seqs = P.paged_decodes(positions, slots, live, chunk=geom.chunk)
    advance_metas(geom, pages, seqs, null_page=0)
    for i, p in pages.items():
        assert p["meta"][2].tolist() == [8, geom.chunk] and p["meta"][4].tolist() == [1, geom.chunk]
        assert p["meta"][0].tolist() == [0, geom.chunk]  # the null page: padding's mark
        assert torch.equal(p["meta"][[1, 3]], before[i][[1, 3]])  # no other page touched
