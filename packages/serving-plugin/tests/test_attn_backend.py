"""The lane's own attention backend: no vLLM kernel limit reaches the lane, and its KV cache
layout is read the same way in every stride order vLLM can resolve, byte for byte."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from serving_support import (
    assert_same_bytes_and_comparator,
    nudge_every_page,
    start_engine,
    stop_engine,
)

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import Program
from lockstep_exact.testing import nudge_ulp
from lockstep_serving.vllm import attn_backend as ab
from lockstep_serving.vllm.model import CachePlaces, paged_attention, starts
from lockstep_serving.vllm.patches import LaneRefused

# The contract's program parameters (programs.CATALOG), never restated here.
BLOCK = Program.of("attention.blocked").param("block")
SEGMENT = Program.of("attention.blocked").param("segment")
CORE = partial(P.attention, block=BLOCK, segment=SEGMENT)  # the composition's op site


class ManyCore:
    """The op site with its many-sequence form too (as ``lanes.ops.AttentionSite`` has it),
    counting the calls of each form."""

    def __init__(self):
        self.calls = {"one": 0, "many": 0}

    def __call__(self, q, k, v, positions):
        self.calls["one"] += 1
        return CORE(q, k, v, positions)

    def varlen(self, q, k, v, positions, q_starts, k_starts, *, max_rows):
        self.calls["many"] += 1
        return P.attention_varlen(
            q, k, v, positions, q_starts, k_starts, max_rows=max_rows, block=BLOCK, segment=SEGMENT
        )


HKV, HEADS, D, BS, NUM_BLOCKS = 2, 4, 16, 4, 8
NO_CONNECTOR = SimpleNamespace(kv_transfer_config=None)  # all the builder reads of the config
# Two requests, each over blocks that are neither adjacent nor in order.
BLOCK_TABLE = torch.tensor([[5, 2, 6, 0], [7, 0, 3, 1]], dtype=torch.int32)


def _metadata(qsl, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(qsl, dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    start = seq_lens - (qsl[1:] - qsl[:-1])
    positions = torch.cat(
        [torch.arange(s, e) for s, e in zip(start.tolist(), seq_lens.tolist(), strict=True)]
    )
    reqs = qsl.tolist()
    rows_req = torch.cat([torch.full((reqs[r + 1] - reqs[r],), r) for r in range(len(seq_lens))])
    blocks = BLOCK_TABLE[rows_req, positions // BS].to(torch.int64)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=BLOCK_TABLE,
        slot_mapping=blocks * BS + positions % BS,
    )
    md = ab.LaneAttentionMetadataBuilder(None, [], NO_CONNECTOR, torch.device("cpu")).build(
        0, common
    )
    req_rows = [(r, reqs[r], reqs[r + 1], int(seq_lens[r])) for r in range(len(seq_lens))]
    return md, positions, req_rows


def _caches(layout):
    """Two layers' caches laid out by vLLM's own allocator in ``layout``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, 2, layout)
    tensor = KVCacheTensor(
        size=2 * NUM_BLOCKS * spec.page_size_bytes,
        layers=layers,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(NUM_BLOCKS, [tensor], [KVCacheGroupSpec(layers, spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    return [caches[name] for name in layers]


def _attend(q, k, v, positions, md, cache, reqs, core=CORE):
    places = CachePlaces(md, md.slot_mapping, reqs, positions, cache.shape[2], cache.device)
    # the one launch's offsets, of the kind the warm-up makes (one dtype: one compiled kernel)
    for got, counts in ((places.q_starts, [e - s for _, s, e, _ in reqs]),
                        (places.k_starts, [n for *_, n in reqs])):  # fmt: skip
        want = starts(counts, cache.device)
        assert got.dtype == want.dtype and torch.equal(got, want)
    one_call = isinstance(core, ManyCore)  # the many-sequence form, as cuda runs it
    return paged_attention(q, k, v, positions, md, cache, places, core=core, one_call=one_call)


def _rows(seed, n, heads):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, D, generator=g).to(torch.bfloat16)


# Step 1: request 0 prefills 6 tokens, request 1 prefills 3. Step 2: request 0 decodes one
# token, request 1 prefills its next 5 (a chunk): both read rows written a step before.
STEPS = [([0, 6, 9], [6, 3]), ([0, 1, 6], [7, 8])]


def _nudge_cache_entry(layer_cache, block: int, slot: int) -> None:
    """K of kv head 0 at ``slot`` of ``block``, element 0, one bf16 ulp away, in place."""
    key_cache, _ = ab.kv_halves(layer_cache, torch.empty(0, HKV, D, dtype=torch.bfloat16))
    entry = key_cache[block, 0, slot, 0:1]
    entry.copy_(nudge_ulp(entry))


def _run(layer_cache, corrupt: bool = False, core=CORE):
    """``corrupt``: between the steps, one cache entry that request 0 wrote in step 1 (its
    position 0: block BLOCK_TABLE[0, 0], slot 0) is moved by one ulp (the input control)."""
    outs, ks, vs = [], [[], []], [[], []]
    for step, (qsl, seq_lens) in enumerate(STEPS):
        if corrupt and step == 1:
            _nudge_cache_entry(layer_cache, int(BLOCK_TABLE[0, 0]), 0)
        md, positions, reqs = _metadata(qsl, seq_lens)
        n = qsl[-1]
        q, k, v = (
            _rows(10 * step, n, HEADS),
            _rows(10 * step + 1, n, HKV),
            _rows(10 * step + 2, n, HKV),
        )
        outs.append(_attend(q, k, v, positions, md, layer_cache, reqs, core))
        for r, start, end, _ in reqs:
            ks[r].append(k[start:end])
            vs[r].append(v[start:end])
        last = (q, positions, reqs)
    # The reference: the last step's queries over each request's K/V rows, no cache involved.
    q, positions, reqs = last
    ref = torch.cat(
        [
            P.attention(
                q[s:e],
                torch.cat(ks[r]),
                torch.cat(vs[r]),
                positions[s:e],
                block=BLOCK,
                segment=SEGMENT,
            )
            for r, s, e, _ in reqs
        ]
    )
    return outs, ref


@pytest.mark.parametrize("form", ["per request", "one call"])
def test_paged_attention_reads_the_same_bytes_in_every_kv_cache_layout(form):
    """Each request through the op site alone (cpu's choice), or all of them in one call of
    its many-sequence form (cuda's): the reference's bytes in every layout."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    core = CORE if form == "per request" else ManyCore()
    results = {}
    for layout in KVCacheLayout:
        _, cache = _caches(layout)  # layer 1: its view starts after layer 0's in every layout
        outs, ref = _run(cache, core=core)
        assert_same_bytes_and_comparator(ref, outs[-1], f"{layout.name}: paged vs reference")
        results[layout.name] = torch.cat(outs)
        # control: the same steps on a fresh cache with one entry one ulp off between them
        _, fresh = _caches(layout)
        moved, same_ref = _run(fresh, corrupt=True, core=core)
        assert same_bytes(same_ref, ref), layout.name  # the reference reads no cache
        assert not same_bytes(ref, moved[-1]), f"{layout.name}: a cache entry's ulp is missed"
    first = results.pop("LBHNC")
    for name, got in results.items():
        assert_same_bytes_and_comparator(first, got, f"LBHNC vs {name}")
    if form == "one call":  # one call a step (two runs a layout), the per-request form never
        assert core.calls == {"one": 0, "many": 2 * len(STEPS) * len(KVCacheLayout)}


@pytest.mark.parametrize("form", ["per request", "one call"])
def test_a_step_of_whole_prompts_attends_its_own_rows_with_the_gathers_bytes(form):
    """A step whose requests have no cached prefix (each request's rows are all its keys)
    attends the step's own K/V rows instead of gathering them back from the cache: the bytes
    of the gather. Control on an input: one K element of request 1 one ulp off moves request
    1's rows and not request 0's."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    core = CORE if form == "per request" else ManyCore()
    md, positions, reqs = _metadata(*STEPS[0])
    q, k, v = _rows(0, 9, HEADS), _rows(1, 9, HKV), _rows(2, 9, HKV)

    def attend(k, gather: bool):
        _, cache = _caches(KVCacheLayout.LBNHC)
        places = CachePlaces(md, md.slot_mapping, reqs, positions, cache.shape[2], cache.device)
        assert places.fresh
        places.fresh = not gather
        one_call = isinstance(core, ManyCore)
        return paged_attention(q, k, v, positions, md, cache, places, core=core, one_call=one_call)

    own = attend(k, gather=False)
    assert_same_bytes_and_comparator(attend(k, gather=True), own, "own rows vs gathered")
    moved = k.clone()
    moved[7] = nudge_ulp(k[7])
    shifted = attend(moved, gather=False)
    assert not same_bytes(shifted[6:], own[6:])
    assert same_bytes(shifted[:6], own[:6])
    _, cache = _caches(KVCacheLayout.LBNHC)
    md2, positions2, reqs2 = _metadata(*STEPS[1])
    places = CachePlaces(md2, md2.slot_mapping, reqs2, positions2, cache.shape[2], cache.device)
    assert not places.fresh  # a decode and a second chunk read keys of an earlier step


def test_the_cache_cell_holds_k_then_v_of_each_token():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    _, cache = _caches(KVCacheLayout.LBNHC)
    md, positions, reqs = _metadata(*STEPS[0])
    q, k, v = _rows(0, 9, HEADS), _rows(1, 9, HKV), _rows(2, 9, HKV)
    _attend(q, k, v, positions, md, cache, reqs)
    slots = md.slot_mapping.to(torch.int64)
    cells = cache[slots // BS, :, slots % BS]  # [tokens, kv_heads, 2 * D]
    assert torch.equal(cells[..., :D], k) and torch.equal(cells[..., D:], v)


def test_paged_attention_refuses_metadata_of_another_backend():
    md, positions, reqs = _metadata(*STEPS[0])
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    other = CPUAttentionMetadata(
        num_actual_tokens=9,
        max_query_len=6,
        query_start_loc=md.query_start_loc,
        max_seq_len=6,
        seq_lens=md.seq_lens,
        block_table=md.block_table,
        slot_mapping=md.slot_mapping,
        scheduler_metadata=None,
    )
    cache = torch.zeros(NUM_BLOCKS, HKV, BS, 2 * D, dtype=torch.bfloat16)
    q, k = _rows(0, 9, HEADS), _rows(1, 9, HKV)
    with pytest.raises(LaneRefused, match="attention metadata of type CPUAttentionMetadata"):
        _attend(q, k, k, positions, other, cache, reqs)


@pytest.mark.parametrize(
    "shape, dtype, message",
    [
        (
            (NUM_BLOCKS, HKV, 2 * BS, D),
            torch.bfloat16,
            r"has shape \(8, 2, 8, 16\), not the lane's layout \[num_blocks, 2 kv_heads, "
            r"block_size, 2\*16\]",
        ),
        (
            (NUM_BLOCKS, 1, BS, 2 * D),
            torch.bfloat16,
            r"has shape \(8, 1, 4, 32\), not the lane's layout",
        ),
        (
            (NUM_BLOCKS, HKV, BS, 2 * D),
            torch.float32,
            "KV cache is torch.float32 but the lane's K/V rows are torch.bfloat16",
        ),
    ],
)
def test_paged_attention_refuses_a_cache_not_in_the_lanes_layout(shape, dtype, message):
    md, positions, reqs = _metadata(*STEPS[0])
    cache = torch.zeros(shape, dtype=dtype)
    q, k = _rows(0, 9, HEADS), _rows(1, 9, HKV)
    with pytest.raises(LaneRefused, match=message):
        _attend(q, k, k, positions, md, cache, reqs)


def test_the_cache_places_are_checked_once_a_step_and_kept_to_their_step():
    """One host read checks every request's last query position; places worked out for one
    step's metadata are refused for another's (a layer never reads another step's pages)."""
    md, positions, reqs = _metadata(*STEPS[0])
    cache = torch.zeros(NUM_BLOCKS, HKV, BS, 2 * D, dtype=torch.bfloat16)
    moved = positions.clone()
    moved[5] += 1  # request 0's last query is at position 6 of a 6-token sequence
    with pytest.raises(LaneRefused, match=r"request 0: last query position 6 is not seq_len-1"):
        CachePlaces(md, md.slot_mapping, reqs, moved, BS, cache.device)
    places = CachePlaces(md, md.slot_mapping, reqs, positions, BS, cache.device)
    other, _, _ = _metadata(*STEPS[0])
    q, k = _rows(0, 9, HEADS), _rows(1, 9, HKV)
    with pytest.raises(LaneRefused, match="another step's attention metadata"):
        paged_attention(q, k, k, positions, other, cache, places, core=CORE)


def test_the_last_positions_check_on_the_device_form_catches_what_the_host_form_refuses():
    """cuda checks the last query positions on the device (no host read, no wait); its
    comparison, run here on cpu tensors (``torch._assert_async`` raises on cpu), passes the
    step the host form passes and stops the one the host form refuses."""
    from lockstep_serving.vllm.model import check_last_positions

    _md, positions, reqs = _metadata(*STEPS[0])
    spans, local = [], 0
    for _r, start, end, _seq_len in reqs:
        spans.append(local + (end - start) - 1)
        local += end - start
    last = torch.tensor(spans, dtype=torch.int64)
    want = torch.tensor([seq_len - 1 for *_, seq_len in reqs], dtype=torch.int64)
    check_last_positions(positions, last, want, reqs)  # host form
    check_last_positions(positions, last, want, reqs, on_device=True)  # device form
    moved = positions.clone()
    moved[5] += 1  # request 0's last query at position 6 of a 6-token sequence
    with pytest.raises(LaneRefused, match="request 0: last query position 6 is not seq_len-1"):
        check_last_positions(moved, last, want, reqs)
    with pytest.raises(RuntimeError):
        check_last_positions(moved, last, want, reqs, on_device=True)


def test_the_builder_copies_the_batch_and_refuses_non_causal_metadata():
    md, _, _ = _metadata(*STEPS[1])
    assert md.query_start_loc.tolist() == [0, 1, 6] and md.seq_lens_cpu.tolist() == [7, 8]
    assert md.block_table is BLOCK_TABLE and md.num_actual_tokens == 6 and md.num_reqs == 2
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, 2], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([2], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=2,
        max_query_len=2,
        max_seq_len=2,
        block_table_tensor=BLOCK_TABLE[:1],
        slot_mapping=torch.tensor([20, 21]),
        causal=False,
    )
    builder = ab.LaneAttentionMetadataBuilder(None, [], NO_CONNECTOR, torch.device("cpu"))
    with pytest.raises(LaneRefused, match="causal=False: the lane attends causally only"):
        builder.build(0, common)


def test_the_builder_refuses_a_kv_connector():
    config = SimpleNamespace(kv_transfer_config=object())
    with pytest.raises(LaneRefused, match=r"a KV connector \(kv_transfer_config\) moves cache"):
        ab.LaneAttentionMetadataBuilder(None, [], config, torch.device("cpu"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sliding_window": 128}, "sliding_window=128 is not part of the lane's attention"),
        ({"alibi_slopes": [0.5] * 4}, "alibi_slopes=.* is not part of the lane's attention"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0 is not part of the lane's attention"),
        (
            {"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"},
            "kv_sharing_target_layer_name=.* is not part of the lane's attention",
        ),
        ({"sinks": torch.zeros(4)}, "attention option sinks=.* is not part of the lane's"),
        ({"attn_type": "encoder_only"}, "attention type .* causal decoder attention only"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8': the cache must hold the bf16"),
    ],
)
def test_the_lane_impl_refuses_options_its_attention_does_not_have(options, message):
    with pytest.raises(LaneRefused, match=message):
        ab.LaneAttentionImpl(HEADS, D, D**-0.5, HKV, **options)


def test_the_lane_impl_refuses_to_run_attention_itself():
    impl = ab.LaneAttentionImpl(HEADS, D, D**-0.5, HKV)
    assert (impl.num_heads, impl.head_size, impl.num_kv_heads) == (HEADS, D, HKV)
    with pytest.raises(LaneRefused, match="the lane attends inside its model"):
        impl.forward(None, None, None, None, None, None, None)


def test_the_backend_declares_no_kernel_limit():
    from vllm.v1.attention.backend import MultipleOf

    b = ab.LaneAttentionBackend
    assert all(b.supports_head_size(d) for d in (2, 8, 16, 24, 40, 96, 512))
    assert all(b.supports_block_size(s) for s in (1, 5, 16, 48, 128))
    assert b.get_supported_kernel_block_sizes() == [MultipleOf(1)]
    assert b.supported_kv_cache_layouts() is None
    assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.float32)
    assert not b.supports_kv_connector()


def test_the_backend_is_registered_by_name_and_stock_models_keep_vllms_selection():
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    ab.register()
    ab.register()  # idempotent
    assert AttentionBackendEnum[ab.BACKEND_NAME].get_class() is ab.LaneAttentionBackend
    stock = current_platform.get_attn_backend_cls(
        None, AttentionSelectorConfig(16, torch.bfloat16, "auto", None)
    )
    assert stock == AttentionBackendEnum.CPU_ATTN.get_path()


def _decisions(out):
    from lockstep_serving.vllm.offline import sampled_logprobs

    return list(out.outputs[0].token_ids), sampled_logprobs(out.outputs[0])


@pytest.mark.slow
@pytest.mark.engine
def test_head_dim_16_at_block_size_5_gives_the_same_bytes_on_cache_hits_and_chunks(tmp_path):
    """head_dim 16 (refused by vLLM's CPU kernels with AVX2 only) in 5-token pages: a prefix
    cache hit and a prefill in 16-token chunks read back the bytes a whole prefill wrote."""
    from vllm import SamplingParams

    model = make_tiny(tmp_path / "hd16", arch="qwen3", hidden=96, heads=6, kv_heads=2, head_dim=16)
    prompts = default_prompts(8)
    target = max(prompts, key=len)
    seeded = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=6, logprobs=0, seed=7)
    # vLLM 0.32 on CPU crashes on a seeded request whose prefill is chunked: chunks go greedy.
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    llm = start_engine(model, block_size=5)
    try:
        backends = llm.apply_model(
            lambda m: [(type(a.impl).__name__, a.attn_backend.get_name()) for a in m.attn]
        )
        shapes = llm.apply_model(lambda m: [tuple(a.kv_cache.shape[1:]) for a in m.attn])
        llm.reset_prefix_cache()
        (miss,) = llm.generate([target], seeded, use_tqdm=False)
        (hit,) = llm.generate([target], seeded, use_tqdm=False)
        whole = llm.generate(prompts, greedy, use_tqdm=False)
        llm.apply_model(nudge_every_page)
        (hit_moved,) = llm.generate([target], seeded, use_tqdm=False)
    finally:
        stop_engine(llm)
    llm = start_engine(model, block_size=5, max_num_batched_tokens=16, max_num_seqs=8)
    try:
        chunked = llm.generate(prompts, greedy, use_tqdm=False)
        llm.apply_model(nudge_every_page)
        (chunked_moved,) = llm.generate([target], greedy, use_tqdm=False)
    finally:
        stop_engine(llm)
    assert backends == [[("LaneAttentionImpl", "LOCKSTEP_LANE")] * 2]
    assert shapes == [[(2, 5, 32)] * 2]  # per block: [kv_heads, block_size, K|V]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens >= 5
    assert _decisions(miss)[0] == _decisions(hit)[0]
    assert_same_bytes_and_comparator(_decisions(miss)[1], _decisions(hit)[1], "miss vs hit")
    # control: a hit on pages whose first K entry is one ulp off parts from the miss
    assert hit_moved.num_cached_tokens >= 5
    assert not same_bytes(_decisions(miss)[1], _decisions(hit_moved)[1])
    assert len(whole[prompts.index(target)].prompt_token_ids) > 3 * 16  # 4 chunks at least
    for i, (a, b) in enumerate(zip(whole, chunked, strict=True)):
        assert _decisions(a)[0] == _decisions(b)[0]
        assert_same_bytes_and_comparator(_decisions(a)[1], _decisions(b)[1], f"prompt {i}: chunks")
    # control: the chunked engine, on its cached pages with one K entry one ulp off, parts from
    # the whole prefill's bytes of the longest prompt
    assert chunked_moved.num_cached_tokens >= 5
    want = _decisions(whole[prompts.index(target)])[1]
    assert not same_bytes(want, _decisions(chunked_moved)[1])


def test_the_backend_declares_the_lanes_cache_shape_and_refuses_another_cache_dtype():
    # vLLM 0.26 views each layer's cache through get_kv_cache_shape (0.32 never asks).
    shape = ab.LaneAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BS, HKV, D)
    assert shape == (NUM_BLOCKS, HKV, BS, 2 * D)
    assert ab.LaneAttentionBackend.get_kv_cache_shape(3, 16, 8, 128, "bfloat16") == (3, 8, 16, 256)
    with pytest.raises(LaneRefused) as err:
        ab.LaneAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BS, HKV, D, "fp8_e4m3")
    assert str(err.value) == (
        "Lockstep exact lane refused to start: kv_cache_dtype 'fp8_e4m3': the cache must hold "
        "the bf16 K/V bytes"
    )


def test_on_a_vllm_with_only_the_custom_slot_a_slot_held_by_another_class_is_refused(
    monkeypatch,
):
    """vLLM 0.26 cannot add a backend name: the lane takes AttentionBackendEnum.CUSTOM, and
    refuses when another out-of-tree backend already holds it (0.32's enum has the same slot,
    so the 0.26 path runs here with NAMES_ADDED off)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    monkeypatch.setattr(ab, "NAMES_ADDED", False)
    try:
        register_backend(custom, "somebody.else.Backend")
        with pytest.raises(LaneRefused) as err:
            ab.register()
        assert str(err.value) == (
            "Lockstep exact lane refused to start: vLLM's CUSTOM attention backend is already "
            "registered to 'somebody.else.Backend'; on this vLLM the lane's backend needs that "
            "slot (one out-of-tree backend per process)"
        )
        custom.clear_override()
        ab.register()  # a free slot is taken, and taking it again is a no-op
        ab.register()
        assert custom.get_path() == ab.BACKEND_PATH
    finally:
        custom.clear_override()


def test_key_places_are_each_requests_positions_and_batch_row_end_to_end():
    from lockstep_serving.vllm.model import key_places

    at, rows = key_places([3, 0, 5], [2, 4, 1])
    assert at.tolist() == [0, 1, 0, 1, 2, 3, 0]
    assert rows.tolist() == [3, 3, 0, 0, 0, 0, 5]
    assert at.dtype == rows.dtype == torch.int64
    lens = torch.tensor([7, 1, 33, 16])
    ks = starts(lens.tolist(), "cpu")
    want = torch.arange(int(ks[-1])) - ks[:-1].repeat_interleave(lens)
    assert torch.equal(key_places([0, 1, 2, 3], lens.tolist())[0], want)
    empty_at, empty_rows = key_places([], [])
    assert empty_at.numel() == empty_rows.numel() == 0
