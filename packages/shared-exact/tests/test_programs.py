"""Every cpu byte program: row bytes independent of batch, position and threads; error bounded.

Each property is asserted on raw bytes; each has a negative control showing the same check
rejects a one-ulp change.
"""

from __future__ import annotations

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.parity import same_bytes, ulp_distance
from lockstep_exact.programs import Program
from lockstep_exact.testing import assert_same_bytes, nudge_ulp

# The contract's program parameters (programs.CATALOG), never restated here.
BK = Program.of("gemm.kblock").param("bk")
BLOCK = Program.of("attention.blocked").param("block")
EXPAND_BK = Program.of("lora.expand").param("bk")
SEGMENT = Program.of("attention.blocked").param("segment")
SHRINK_BK = Program.of("lora.shrink").param("bk")

BF16 = torch.bfloat16
MS = (1, 3, 64, 257)


def rand(*shape, seed=0, scale=1.0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rows_invariant(fn, full: torch.Tensor, *args, what: str):
    """fn(x[rows], *args)[i] equals fn(full)[rows[i]] for sub-batches of every size in MS."""
    ref = fn(full, *args)
    for m in MS:
        start = (full.shape[0] - m) // 2
        sub = fn(full[start : start + m], *args)
        assert_same_bytes(sub, ref[start : start + m], f"{what}: rows of a batch of {m}")
    perm = torch.randperm(full.shape[0], generator=torch.Generator().manual_seed(1))
    assert_same_bytes(fn(full[perm], *args), ref[perm], f"{what}: rows permuted")
    torch.set_num_threads(1)
    one = fn(full, *args)
    torch.set_num_threads(2)
    two = fn(full, *args)
    assert_same_bytes(one, ref, f"{what}: 1 thread")
    assert_same_bytes(two, ref, f"{what}: 2 threads")
    moves_alone(fn, full, full.shape[0] // 2 + 1, what=what)
    return ref


def moves_alone(fn, full: torch.Tensor, row: int, *args, col: int | None = None, what: str):
    """The input control of a row-invariance claim: one element of ``full[row]`` one ulp off
    (by default the row's largest, whose ulp survives a softmax's max subtraction) moves row
    ``row`` of fn's output and no other row (another row's input is not read by this one)."""
    ref = fn(full, *args)
    if col is None:
        col = int(full[row].reshape(-1).float().argmax())
    moved = full.clone()
    moved[row].view(-1)[col] = nudge_ulp(full[row].reshape(-1), col)[col]
    out = fn(moved, *args)
    moved_row = not same_bytes(out[row], ref[row])
    assert moved_row, f"{what}: row {row}'s own input moved nothing"
    others = torch.ones(full.shape[0], dtype=torch.bool)
    others[row] = False
    assert_same_bytes(out[others], ref[others], f"{what}: rows beside a moved row {row}")


# --- the checks themselves can fail ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_byte_comparison_detects_a_one_ulp_change(dtype):
    x = rand(257, 96, dtype=dtype)
    y = nudge_ulp(x, index=5000)
    assert ulp_distance(x, y) == 1
    assert not same_bytes(x, y)
    with pytest.raises(AssertionError, match="1 element"):
        assert_same_bytes(x, y)


def test_byte_comparison_tells_signed_zeros_apart():
    assert not same_bytes(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_rows_invariant_rejects_a_program_that_mixes_rows():
    def mixes(x):  # a batch-dependent "program": adds a batch-wide mean
        return P.round_bf16(x.float() + x.float().mean() * 1e-2)

    with pytest.raises(AssertionError):
        rows_invariant(mixes, rand(257, 96), what="mixing")


# --- rounding and reductions -------------------------------------------------------------------
def test_round_bf16_is_round_to_nearest_even():
    x = torch.randn(100_000) * 1000
    assert_same_bytes(P.round_bf16(x), x.to(BF16), "round_bf16 vs torch")
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=torch.float32)
    assert P.round_bf16(ties).float().tolist() == [1.0, 1.0 + 2**-6]
    # input control: the tie 1 + 2^-8 one fp32 ulp up is past the tie and rounds up
    assert P.round_bf16(nudge_ulp(ties, 0)).float().tolist() == [1.0 + 2**-7, 1.0 + 2**-6]


def test_tree_sum_tree_depends_only_on_length():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)
    # ((1e8 + 1) + (-1e8 + 1)): each pair rounds away its 1.0; a left-to-right sum keeps one.
    assert P.cpu.tree_sum(x).item() == 0.0
    assert ((x[0] + x[1]) + x[2] + x[3]).item() == 1.0


# --- gemm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(96, 100), (1024, 128), (7, 33)])
def test_gemm_row_bytes_do_not_depend_on_batch(n, k):
    w = rand(n, k, seed=2)
    rows_invariant(lambda x: P.gemm(x, w, bk=BK), rand(257, k), what="gemm")


def test_gemm_fp32_output_row_bytes_do_not_depend_on_batch():
    w = rand(1000, 96, seed=3)
    rows_invariant(
        lambda x: P.gemm(x, w, out_dtype=torch.float32, bk=BK), rand(257, 96), what="gemm fp32"
    )


def test_gemm_error_vs_float64_is_bounded():
    x, w = rand(64, 256, seed=4), rand(96, 256, seed=5)
    y = P.gemm(x, w, out_dtype=torch.float32, bk=BK).double()
    exact = x.double() @ w.double().T
    # fp32 accumulation over the block tree: |err| <= (log2(bk) + K/bk) * 2^-24 * sum|x*w|
    bound = (5 + 256 / 32) * 2**-24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y - exact).abs() <= bound).all())


def test_gemm_bytes_move_with_one_operand_ulp():
    x, w = rand(8, 128), rand(64, 128, seed=6)
    base = P.gemm(x, w, out_dtype=torch.float32, bk=BK)
    assert not same_bytes(P.gemm(x, nudge_ulp(w, 0), out_dtype=torch.float32, bk=BK), base)


def test_gemm_block_size_is_a_bit_relevant_parameter():
    x, w = rand(32, 512, seed=7), rand(64, 512, seed=8)
    assert not same_bytes(
        P.gemm(x, w, bk=32, out_dtype=torch.float32), P.gemm(x, w, bk=64, out_dtype=torch.float32)
    )


def test_gemm_refuses_mismatched_k():
    with pytest.raises(ValueError, match="K mismatch"):
        P.gemm(rand(2, 8), rand(4, 9), bk=BK)


# --- norms, residual, activation ----------------------------------------------------------------
def test_rmsnorm_row_bytes_do_not_depend_on_batch():
    w = (1 + 0.1 * rand(96, seed=9, dtype=torch.float32)).to(BF16)
    rows_invariant(lambda x: P.rmsnorm(x, w, 1e-6), rand(257, 96, scale=3.0), what="rmsnorm")


def test_rmsnorm_error_vs_float64_is_within_two_bf16_ulp():
    x, w = rand(64, 128, scale=2.0), (1 + 0.1 * rand(128, seed=10, dtype=torch.float32)).to(BF16)
    y = P.rmsnorm(x, w, 1e-6)
    xd = x.double()
    exact = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert ulp_distance(y, exact.to(BF16)) <= 2


def test_rmsnorm_refuses_fp32_input():
    with pytest.raises(ValueError, match="bf16"):
        P.rmsnorm(torch.randn(2, 8), torch.ones(8, dtype=BF16), 1e-6)


def test_residual_add_row_bytes_do_not_depend_on_batch():
    b = rand(257, 96, seed=11)
    full = rand(257, 96)
    ref = P.residual_add(full, b)
    assert_same_bytes(P.residual_add(full[10:13], b[10:13]), ref[10:13], "residual rows")
    assert_same_bytes(ref, (full.float() + b.float()).to(BF16), "residual vs RNE of fp32 sum")
    moves_alone(lambda x: P.residual_add(x, b), full, 11, what="residual")


def test_swiglu_row_bytes_do_not_depend_on_batch():
    up = rand(257, 384, seed=12)
    full = rand(257, 384, scale=4.0)
    ref = P.swiglu(full, up)
    for m in MS:
        assert_same_bytes(P.swiglu(full[:m], up[:m]), ref[:m], f"swiglu batch {m}")
    moves_alone(lambda x: P.swiglu(x, up), full, 1, what="swiglu")
    exact = (full.double() * torch.sigmoid(full.double())).to(BF16).double() * up.double()
    assert ulp_distance(ref, exact.to(BF16)) <= 1


# --- softmax, log_softmax, exp, log -------------------------------------------------------------
@pytest.mark.parametrize("v", [1000, 1024, 32003])
def test_log_softmax_row_bytes_do_not_depend_on_batch(v):
    full = rand(257 if v < 10000 else 64, v, scale=5.0, dtype=torch.float32)
    rows_invariant(P.log_softmax, full, what="log_softmax")


def test_log_softmax_error_vs_float64_is_bounded():
    x = rand(64, 1024, scale=5.0, dtype=torch.float32)
    y = P.log_softmax(x).double()
    exact = torch.log_softmax(x.double(), -1)
    assert float((y - exact).abs().max()) < 4e-6


def test_softmax_row_bytes_do_not_depend_on_batch():
    rows_invariant(P.softmax, rand(257, 64, scale=3.0, dtype=torch.float32), what="softmax")


def test_exp_and_log_are_within_one_ulp_of_float64():
    x = torch.linspace(-103.0, 88.0, 200_001)
    ref = torch.exp(x.double())
    err = (P.cpu.exp(x).double() - ref).abs()
    spacing = (
        torch.nextafter(ref.float(), torch.tensor(float("inf"))).double() - ref.float().double()
    )
    normal = ref > 1.2e-38
    assert float((err / spacing)[normal].max()) <= 1.0
    y = torch.logspace(-37, 38, 200_001)
    lref = torch.log(y.double())
    lerr = (P.cpu.log(y).double() - lref).abs()
    lsp = (
        torch.nextafter(lref.float().abs(), torch.tensor(float("inf"))).double()
        - lref.float().abs().double()
    )
    assert float((lerr / lsp).max()) <= 1.0


def test_exp_and_log_bytes_do_not_depend_on_length_or_threads():
    x = torch.linspace(-20.0, 20.0, 100_003)
    ref = P.cpu.exp(x)
    assert_same_bytes(P.cpu.exp(x[17:18]), ref[17:18], "exp scalar tail")
    assert_same_bytes(P.cpu.exp(x[:33]), ref[:33], "exp vector body + tail")
    # input control: x[17] one ulp up moves its exp and no other element of the vector
    moved = P.cpu.exp(nudge_ulp(x[:33], 17))
    assert not same_bytes(moved[17], ref[17])
    assert_same_bytes(torch.cat([moved[:17], moved[18:]]), torch.cat([ref[:17], ref[18:33]]))
    torch.set_num_threads(1)
    assert_same_bytes(P.cpu.log(x.abs() + 1), P.cpu.log(x.abs()[::1] + 1), "log 1 thread")


# --- rope ---------------------------------------------------------------------------------------
def test_rope_row_bytes_do_not_depend_on_batch():
    pos = torch.randint(0, 4000, (257,), generator=torch.Generator().manual_seed(13))
    full = rand(257, 4, 64)
    ref = P.rope(full, pos, 1e6)
    for m in MS:
        assert_same_bytes(P.rope(full[:m], pos[:m], 1e6), ref[:m], f"rope batch {m}")
    moves_alone(lambda x: P.rope(x, pos, 1e6), full, 2, what="rope")


def test_a_position_outside_the_promised_bound_is_refused_on_cpu_as_the_cuda_kernel_stops():
    x, pos = rand(5, 2, 64), torch.arange(5)
    free, part = P.rope(x, pos, 1e6), P.rope_partial(x, pos, 1e6, 32)
    with P.position_bound(5):  # positions 0..4 keep the promise: the unbounded bytes
        assert_same_bytes(P.rope(x, pos, 1e6), free)
        assert_same_bytes(P.rope_partial(x, pos, 1e6, 32), part)
    with P.position_bound(4), pytest.raises(ValueError, match=r"rope: position 4 outside"):
        P.rope(x, torch.arange(5), 1e6)
    with P.position_bound(8), pytest.raises(ValueError, match=r"rope.partial: position -1"):
        P.rope_partial(x, torch.tensor([0, 1, 2, 3, -1]), 1e6, 32)


def test_rope_tables_are_within_one_fp32_ulp_of_float64():
    cos, sin = P.cpu.rope_tables(1e6, 128, 4096)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    theta = torch.arange(cos.shape[0], dtype=torch.float64)[:, None] * inv
    assert ulp_distance(cos, torch.cos(theta).float()) <= 1
    assert ulp_distance(sin, torch.sin(theta).float()) <= 1


def test_rope_tables_do_not_depend_on_requested_length():
    a, _ = P.cpu.rope_tables(1e6, 64, 100)
    b, _ = P.cpu.rope_tables(1e6, 64, 5000)
    assert_same_bytes(a[:100], b[:100], "rope table prefix")
    moved, _ = P.cpu.rope_tables(1e6 + 2**-4, 64, 100)  # input control: base one fp32 ulp up
    assert not same_bytes(moved, a)


# --- attention ----------------------------------------------------------------------------------
def _qkv(t, hq=4, hkv=2, d=32, seed=20):
    return rand(t, hq, d, seed=seed), rand(t, hkv, d, seed=seed + 1), rand(t, hkv, d, seed=seed + 2)


@pytest.mark.parametrize("t,segment", [(1, 512), (31, 512), (32, 512), (33, 512), (100, 512),
                                       (100, 32), (70, 64)])  # fmt: skip
def test_attention_prefill_chunked_and_decode_give_the_same_bytes(t, segment):
    q, k, v = _qkv(t)
    pos = torch.arange(t)

    def attn(qq, kk, vv, pp):
        return P.attention(qq, kk, vv, pp, segment=segment, block=BLOCK)

    prefill = attn(q, k, v, pos)
    decode = torch.cat(
        [attn(q[i : i + 1], k[: i + 1], v[: i + 1], pos[i : i + 1]) for i in range(t)]
    )
    assert_same_bytes(decode, prefill, "decode vs prefill")
    cut = t // 3
    chunked = torch.cat(
        [attn(q[:cut], k[:cut], v[:cut], pos[:cut]), attn(q[cut:], k, v, pos[cut:])]
    )
    assert_same_bytes(chunked, prefill, "chunked prefill vs prefill")
    assert not same_bytes(attn(q, k, nudge_ulp(v, 0), pos), prefill)


def test_attention_ignores_cache_contents_past_the_query():
    q, k, v = _qkv(40)
    pos = torch.arange(20)
    ref = P.attention(q[:20], k[:20], v[:20], pos, block=BLOCK, segment=SEGMENT)
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[20:] = float("nan")
    junk_v[20:] = float("inf")
    assert_same_bytes(
        P.attention(q[:20], junk_k, junk_v, pos, block=BLOCK, segment=SEGMENT),
        ref,
        "garbage beyond the query",
    )
    # input control: a cache entry the queries do read (key 19, head 0) one ulp off moves them
    assert not same_bytes(
        P.attention(q[:20], nudge_ulp(junk_k, 19 * 2 * 32), junk_v, pos, block=BLOCK,
                    segment=SEGMENT),
        ref,
    )  # fmt: skip


def test_attention_row_bytes_do_not_depend_on_threads_or_batch():
    q, k, v = _qkv(257, hq=8, hkv=2, d=64)
    pos = torch.arange(257)
    torch.set_num_threads(1)
    one = P.attention(q, k, v, pos, block=BLOCK, segment=SEGMENT)
    torch.set_num_threads(2)
    assert_same_bytes(
        P.attention(q, k, v, pos, block=BLOCK, segment=SEGMENT), one, "attention 1 vs 2 threads"
    )
    assert_same_bytes(
        P.attention(q[200:203], k, v, pos[200:203], block=BLOCK, segment=SEGMENT),
        one[200:203],
        "3 rows",
    )
    # input control: query row 201 one ulp off moves row 201 and no other row
    moves_alone(
        lambda x: P.attention(x, k, v, pos, block=BLOCK, segment=SEGMENT), q, 201, what="attention"
    )


def test_attention_error_vs_float64_is_bounded():
    q, k, v = _qkv(100, hq=4, hkv=4)
    out = P.attention(q, k, v, torch.arange(100), block=BLOCK, segment=SEGMENT).double()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert ulp_distance(out.to(BF16), ref.to(BF16)) <= 2


def test_attention_block_is_a_bit_relevant_parameter():
    q, k, v = _qkv(512, hq=8, hkv=2, d=64)
    pos = torch.arange(512)
    assert not same_bytes(
        P.attention(q, k, v, pos, block=16, segment=SEGMENT),
        P.attention(q, k, v, pos, block=32, segment=SEGMENT),
    )


def test_attention_segment_moves_only_the_rows_that_cross_it():
    q, k, v = _qkv(512, hq=8, hkv=2, d=64, seed=24)
    pos = torch.arange(512)
    short = P.attention(q, k, v, pos, block=16, segment=16)
    long = P.attention(q, k, v, pos, block=16, segment=512)
    assert_same_bytes(short[:16], long[:16], "rows inside the first segment")
    assert not same_bytes(short[16:], long[16:]), "the merges past the segment moved no byte"


@pytest.mark.parametrize("block,segment", [(32, 48), (32, 16), (32, 0)])
def test_attention_refuses_a_segment_that_is_not_a_multiple_of_the_block(block, segment):
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match=rf"segment \({segment}\) must be a positive multiple"):
        P.attention(q, k, v, torch.arange(8), block=block, segment=segment)


def _varlen(reqs, seed=60):
    """Requests of (rows, keys), rows the last of their keys: concatenated, and their own."""
    qs, ks, vs, ps = [], [], [], []
    for i, (n, s) in enumerate(reqs):
        q, _, _ = _qkv(n, seed=seed + 3 * i)
        _, k, v = _qkv(s, seed=seed + 3 * i + 1)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        ps.append(torch.arange(s - n, s))
    starts = [
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in zip(*reqs, strict=True)
    ]
    return qs, ks, vs, ps, starts


def test_attention_of_many_sequences_gives_each_row_its_requests_bytes():
    reqs = [(1, 1), (5, 9), (0, 3), (40, 40), (7, 100)]
    qs, ks, vs, ps, (q_starts, k_starts) = _varlen(reqs)
    q, k, v, pos = torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(ps)
    kw = {"block": BLOCK, "segment": 32}
    got = P.attention_varlen(q, k, v, pos, q_starts, k_starts, max_rows=40, **kw)
    want = torch.cat([P.attention(*a, **kw) for a in zip(qs, ks, vs, ps, strict=True) if len(a[0])])
    assert_same_bytes(got, want, "one call vs per request")
    moved = k.clone()
    moved[k_starts[3] + 2] = nudge_ulp(k[k_starts[3] + 2], 0)  # request 3's key 2
    other = P.attention_varlen(q, moved, v, pos, q_starts, k_starts, max_rows=40, **kw)
    lo, hi = int(q_starts[3]), int(q_starts[4])
    assert not same_bytes(other[lo:hi], got[lo:hi])
    assert same_bytes(other[:lo], got[:lo]) and same_bytes(other[hi:], got[hi:])


@pytest.mark.parametrize(
    "q_starts,k_starts,max_rows,message",
    [
        ([1, 6, 13], [0, 9, 109], 7, "q_starts must run from 0 to 13"),
        ([0, 6, 12], [0, 9, 109], 7, "q_starts must run from 0 to 13"),
        ([0, 6, 13], [0, 9, 109], 6, "request 1 has 7 rows"),
        ([0, 6, 13], [0, 9, 110], 7, r"request 1's keys \[9, 110\)"),
        ([0, 6, 13], [0, 5, 109], 7, "a query position has no key"),
    ],
)
def test_attention_of_many_sequences_refuses_offsets_that_do_not_fit(
    q_starts, k_starts, max_rows, message
):
    qs, ks, vs, ps, _ = _varlen([(6, 9), (7, 100)])
    with pytest.raises(ValueError, match=message):
        P.attention_varlen(
            torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(ps), torch.tensor(q_starts),
            torch.tensor(k_starts), max_rows=max_rows, block=BLOCK, segment=SEGMENT,
        )  # fmt: skip


# --- MoE ----------------------------------------------------------------------------------------
def test_router_topk_row_bytes_do_not_depend_on_batch():
    logits = rand(257, 8, scale=2.0)
    ids, w = P.router_topk(logits, 2)
    for m in MS:
        ids_m, w_m = P.router_topk(logits[:m], 2)
        assert torch.equal(ids_m, ids[:m])
        assert_same_bytes(w_m, w[:m], f"router weights batch {m}")
    assert bool((ids[:, 0] < ids[:, 1]).all())
    # input control: row 5's chosen logit one ulp off moves row 5's weights, no other row's
    chosen = int(ids[5, 0])
    moves_alone(lambda x: P.router_topk(x, 2)[1], logits, 5, col=chosen, what="router weights")


def test_router_topk_ties_go_to_the_lowest_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]], dtype=BF16)
    ids, w = P.router_topk(logits, 2)
    assert ids.tolist() == [[1, 2]]
    assert w.float().tolist() == [[0.5, 0.5]]


def test_moe_fold_row_bytes_do_not_depend_on_batch():
    out, w = rand(257, 4, 96, seed=30), rand(257, 4, seed=31).abs()
    ref = P.moe_fold(out, w)
    for m in MS:
        assert_same_bytes(P.moe_fold(out[:m], w[:m]), ref[:m], f"moe fold batch {m}")
    assert not same_bytes(P.moe_fold(out, nudge_ulp(w, 0)), ref)


def test_moe_fold_rounds_to_bf16_after_every_add():
    out = torch.tensor([[[1.0], [2**-8], [2**-8], [0.0]]], dtype=BF16)  # k=4
    w = torch.ones(1, 4, dtype=BF16)
    # ((1 + 2^-8) -> 1 in bf16) + (2^-8 + 0) = 1 + 2^-8 -> 1: bf16 per add; fp32 keeps 2^-7.
    assert P.moe_fold(out, w).float().item() == 1.0
    assert P.moe_fold(out, w, acc="fp32").float().item() == 1.0 + 2**-7


# --- LoRA ---------------------------------------------------------------------------------------
def test_lora_row_bytes_do_not_depend_on_batch():
    a, b = rand(8, 96, seed=40, scale=0.1), rand(64, 8, seed=41, scale=0.1)
    w = rand(64, 96, seed=42)

    def lora(x):
        return P.lora_expand(
            P.gemm(x, w, bk=BK), P.lora_shrink(x, a, bk=SHRINK_BK), b, 2.0, bk=EXPAND_BK
        )

    rows_invariant(lora, rand(257, 96), what="lora")


def test_zero_lora_adapter_returns_the_base_bytes_exactly():
    x, w, a = rand(33, 96), rand(64, 96, seed=43), rand(8, 96, seed=44)
    base = P.gemm(x, w, bk=BK)
    base[0, 0] = -0.0
    out = P.lora_expand(
        base, P.lora_shrink(x, a, bk=SHRINK_BK), torch.zeros(64, 8, dtype=BF16), 2.0, bk=EXPAND_BK
    )
    assert_same_bytes(out, base, "zero adapter")
    bumped = torch.zeros(64, 8, dtype=BF16)
    bumped[3, 0] = 2**-9
    assert not same_bytes(
        P.lora_expand(base, P.lora_shrink(x, a, bk=SHRINK_BK), bumped, 2.0, bk=EXPAND_BK), base
    )


# --- dispatch -----------------------------------------------------------------------------------
def test_every_catalog_program_names_a_version():
    for name, (version, params) in P.CATALOG.items():
        prog = P.Program.of(name)
        assert prog.ident.startswith(f"{name}@{version}{{")
        assert dict(prog.params) == params


def test_unknown_program_or_parameter_is_refused():
    with pytest.raises(KeyError, match="unknown byte program"):
        P.Program.of("gemm.splitk")
    with pytest.raises(KeyError, match="no parameter"):
        P.Program.of("gemm.kblock", split_k=4)


def test_a_device_without_a_backend_fails_closed():
    with pytest.raises(P.BackendUnavailable):
        P.gemm(
            torch.zeros(2, 2, dtype=BF16, device="meta"),
            torch.zeros(2, 2, dtype=BF16, device="meta"),
            bk=BK,
        )
