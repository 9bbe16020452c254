"""Every cuda byte program: row bytes independent of batch, position, chunking; error bounded.

Run on a CUDA machine with ``pytest -m gpu``; skipped elsewhere (the repository conftest). Each
invariance is asserted on raw bytes and comes with a negative control showing that the same
check rejects a one-ulp change. The cuda bytes are compared with cuda bytes only.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.parity import same_bytes, ulp_distance
from lockstep_exact.programs import Program
from lockstep_exact.programs import cpu as CPU
from lockstep_exact.testing import (
    assert_same_bytes,
    gdn_paged_case,
    live_pages,
    nudge_ulp,
    pages_to,
)

# The contract's program parameters (programs.CATALOG), never restated here.
BK = Program.of("gemm.kblock").param("bk")
BLOCK = Program.of("attention.blocked").param("block")
EXPAND_BK = Program.of("lora.expand").param("bk")
KPART_BK = Program.of("gemm.kpart").param("bk")
SEGMENT = Program.of("attention.blocked").param("segment")
SHRINK_BK = Program.of("lora.shrink").param("bk")

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64
MS = (1, 2, 3, 16, 64, 127, 128, 129, 257, 1000, 4096)


def cuda_rand(*shape, seed=0, scale=1.0, dtype=BF16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def backend():
    from lockstep_exact.programs import cuda

    return cuda


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.to(F64)
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm())


def assert_detects_one_ulp(ref: torch.Tensor, sub: torch.Tensor, index: int = 0) -> None:
    """Negative control: the byte check that passed rejects the same rows moved by one ulp."""
    assert same_bytes(sub, ref)
    nudged = nudge_ulp(sub, index=index)
    assert ulp_distance(nudged, ref) == 1
    assert not same_bytes(nudged, ref)
    with pytest.raises(AssertionError):
        assert_same_bytes(nudged, ref, "nudged")


def by_row(fn, *tensors):
    """A program of row indices: rows_invariant then slices and shuffles all operands together."""
    return lambda idx: fn(*(t[idx] for t in tensors))


def row_ids(n):
    return torch.arange(n, device="cuda")


def rows_invariant(fn, full: torch.Tensor, *args, what: str, ms=MS):
    """fn(x[rows], *args) equals fn(x)[rows] for slices of every size in ``ms`` and a shuffle."""
    ref = fn(full, *args)
    n = full.shape[0]
    for m in ms:
        if m > n:
            continue
        for start in {0, (n - m) // 2, n - m}:
            sub = fn(full[start : start + m], *args)
            assert_same_bytes(sub, ref[start : start + m], f"{what}: rows {start}..+{m}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).cuda()
    shuffled = fn(full[perm], *args)
    assert_same_bytes(shuffled, ref[perm], f"{what}: rows permuted")
    assert_detects_one_ulp(ref[perm], shuffled, index=min(7, shuffled.numel() - 1))
    return ref


# --- the checks themselves can fail ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_byte_comparison_detects_a_one_ulp_change_on_the_gpu(dtype):
    x = cuda_rand(257, 96, dtype=dtype)
    y = nudge_ulp(x, index=5000)
    assert ulp_distance(x, y) == 1
    assert not same_bytes(x, y)
    with pytest.raises(AssertionError, match="1 element"):
        assert_same_bytes(x, y)


def test_rows_invariant_rejects_a_program_that_mixes_rows():
    def mixes(x):  # a batch-dependent "program": adds a batch-wide mean
        return P.round_bf16(x.float() + x.float().mean() * 1e-2)

    with pytest.raises(AssertionError):
        rows_invariant(mixes, cuda_rand(257, 96), what="mixing")


def test_dispatch_picks_the_cuda_backend():
    assert P.backend_module(P.backend_of(cuda_rand(2, 2))).__name__.endswith(".cuda")
    env = backend().environment()
    assert env["backend"] == "cuda" and env["capability"].startswith("sm_")


# --- rounding ------------------------------------------------------------------------------------
def test_round_bf16_is_round_to_nearest_even():
    x = torch.randn(100_000, device="cuda") * 1000
    assert_same_bytes(P.round_bf16(x).cpu(), CPU.round_bf16(x.cpu()), "round_bf16 vs cpu rule")
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8], device="cuda")
    assert P.round_bf16(ties).float().tolist() == [1.0, 1.0 + 2**-6]
    nan = P.round_bf16(torch.tensor([float("nan")], device="cuda"))
    assert nan.view(torch.int16).item() == 0x7FC0


# --- gemm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bk", [32, 64])
def test_gemm_row_bytes_do_not_depend_on_batch(bk):
    x = cuda_rand(4096, 1024, seed=1)
    w = cuda_rand(768, 1024, seed=2, scale=0.05)
    rows_invariant(lambda a: P.gemm(a, w, bk=bk), x, what=f"gemm bk={bk}")


# (1000, 384, 1000): TMA loads (K % 8 == 0) with a ragged last K block and a partial N tile;
# (300, 1000, 4100) and (1, 96, 33): K rows TMA cannot address, so the persistent tilings
# take the pointer kernel.
@pytest.mark.parametrize(
    "shape", [(300, 1000, 4100), (77, 4096, 4096), (1, 96, 33), (1000, 384, 1000)]
)
@pytest.mark.parametrize("bk", [32, 64])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_gemm_every_tiling_gives_the_same_bytes(shape, bk, out_dtype):
    """The bitwise gate that lets the tiling follow the shape."""
    m, n, k = shape
    x = cuda_rand(m, k, seed=3)
    w = cuda_rand(n, k, seed=4, scale=0.05)
    cuda = backend()
    outs = {name: cuda.gemm(x, w, bk=bk, out_dtype=out_dtype, tiling=name) for name in cuda.TILINGS}
    first, ref = next(iter(outs.items()))
    for name, out in outs.items():
        assert_same_bytes(out, ref, f"tiling {name} vs {first}")
    assert_detects_one_ulp(ref, outs[name], index=min(11, ref.numel() - 1))


def test_gemm_persistent_tilings_load_by_tma_and_a_misaligned_x_gives_the_same_bytes():
    """The persistent tilings take TMA where it can address the operands and the pointer
    kernel where it cannot (an x starting off a 16-byte boundary): the same bytes."""
    cuda = backend()
    gemm_mod = importlib.import_module("lockstep_exact.programs.cuda.gemm")
    w = cuda_rand(512, 2048, seed=6, scale=0.05)
    base = cuda_rand(600 * 2048 + 1, seed=5)
    shifted = base[1:].view(600, 2048)  # starts 2 bytes past an allocation's start
    x = shifted.clone()
    assert gemm_mod.tma_ok(x, w) and not gemm_mod.tma_ok(shifted, w)
    ref = cuda.gemm(x, w, tiling="m128n128", bk=BK)
    for name in [n for n, t in cuda.TILINGS.items() if t.persistent]:
        assert_same_bytes(cuda.gemm(x, w, tiling=name, bk=BK), ref, f"{name} (TMA)")
        assert_same_bytes(
            cuda.gemm(shifted, w, tiling=name, bk=BK), ref, f"{name} (pointer kernel)"
        )
    assert_detects_one_ulp(ref, cuda.gemm(x, w, tiling="p128n256", bk=BK), index=7)


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_gemm_reads_k_slices_in_place_with_the_bytes_of_their_copies(out_dtype):
    """gemm.kpart hands the cuda gemm K-slices of x and w (views with a row stride): TMA
    where the slice's start and stride allow it, the pointer kernel where not (an offset of
    3 columns), each with the bytes of the same slices copied out."""
    cuda = backend()
    gemm_mod = importlib.import_module("lockstep_exact.programs.cuda.gemm")
    x = cuda_rand(1100, 4096, seed=70)
    w = cuda_rand(768, 4096, seed=71, scale=0.05)
    for lo, hi in ((0, 512), (1536, 2048), (3, 515)):
        xs, ws = x[:, lo:hi], w[:, lo:hi]
        assert not xs.is_contiguous() and not ws.is_contiguous()
        assert gemm_mod.tma_ok(xs, ws) == (lo % 8 == 0)
        for m in (1, 64, 300, 1100):
            ref = cuda.gemm(xs[:m].contiguous(), ws.contiguous(), out_dtype=out_dtype, bk=BK)
            for tiling in (None, "m64n64", "p128n256nf", "p128n128w4"):
                out = cuda.gemm(xs[:m], ws, out_dtype=out_dtype, tiling=tiling, bk=BK)
                assert_same_bytes(out, ref, f"K {lo}:{hi}, {m} rows, tiling {tiling}")
    lead = x.view(4, 275, 4096)[:, :, 1024:1536]
    ref = cuda.gemm(lead.contiguous(), w[:, 1024:1536].contiguous(), out_dtype=out_dtype, bk=BK)
    out = cuda.gemm(lead, w[:, 1024:1536], out_dtype=out_dtype, bk=BK)
    assert_same_bytes(out, ref, "a 3-D K-slice")
    assert_detects_one_ulp(ref, out, index=9)


def test_kpart_on_cuda_gives_the_bytes_of_its_partitions_copied_out():
    x = cuda_rand(3, 40, 4096, seed=72)
    w = cuda_rand(1024, 4096, seed=73, scale=0.05)
    size = 4096 // 8
    parts = [
        P.gemm(
            x[..., p * size : (p + 1) * size].contiguous(),
            w[:, p * size : (p + 1) * size].contiguous(),
            out_dtype=F32,
            bk=BK,
        )
        for p in range(8)
    ]
    ref = P.fold_tree(parts)
    out = P.kpart_partial(x, w, parts=8, bk=KPART_BK)
    assert_same_bytes(out, ref, "gemm.kpart, 8 partitions")
    assert_detects_one_ulp(ref, out, index=5)


def test_the_tiling_above_256_rows_follows_the_h200_sweep_and_keeps_the_bytes():
    """Where the persistent tilings are picked (and where a narrow N keeps the older ones),
    and that the pick's bytes are a fixed tiling's at a router, an expert and an odd shape."""
    cuda = backend()
    pick = cuda.pick_tiling
    assert pick(512, 12288, 64) == "p128n128w4"
    assert pick(1024, 4096, 64) == pick(8192, 4096, 64) == "p128n256nf"
    assert pick(1024, 128, 64) == "m256n128"  # a router: 8 tiles of 128 x 256 would idle the GPU
    assert pick(1024, 4096, 32) == "m128n128w4"  # 32-column K steps: unchanged
    for m, n, k in ((2048, 128, 2048), (2048, 768, 2048), (1500, 2048, 768), (777, 1000, 4096)):
        x = cuda_rand(m, k, seed=74)
        w = cuda_rand(n, k, seed=75, scale=0.05)
        for out_dtype in (BF16, F32):
            ref = cuda.gemm(x, w, out_dtype=out_dtype, tiling="m64n64", bk=BK)
            out = cuda.gemm(x, w, out_dtype=out_dtype, bk=BK)
            assert_same_bytes(out, ref, f"{m}x{n}x{k} {out_dtype}: {pick(m, n, 64)} vs m64n64")
    assert_detects_one_ulp(ref, out, index=3)


def test_the_tiling_up_to_256_rows_fills_one_wave_and_keeps_the_bytes():
    """Up to 256 rows the pick is the tile with the most programs inside one wave of the
    H200's 132 multiprocessors (issue 12's sweep, docs/gpu.md), and its bytes are a fixed
    tiling's, TMA-fed or not, at shapes each rung of that choice takes."""
    cuda = backend()
    gemm_mod = importlib.import_module("lockstep_exact.programs.cuda.gemm")
    pick = cuda.pick_tiling
    assert pick(1, 4096, 64) == pick(64, 4096, 64) == "m64n32s10"  # 128 programs
    assert pick(128, 4096, 64) == pick(256, 2048, 64) == "m64n64s8"  # 128
    assert pick(1, 12288, 64) == "m64n128s6" and pick(256, 4096, 64) == "p64n128"  # 96, 128
    assert pick(128, 12288, 64) == "p128n128w4"  # 96 tiles of 128 x 128
    assert pick(256, 12288, 64) == "p64n128"  # past one wave: 384 tiles, persistent
    assert pick(1, 151936, 64) == "m64n128"  # the LM head
    # K = 1040 and 1000 at bk = 16 take 16 columns of K a step (TMA boxes 16 wide, the last
    # block ragged at 1000); (70, 9000, 100) and (200, 4000, 100): K rows TMA cannot address.
    shapes = [(3, 1000, 4096), (100, 4000, 1000), (200, 4096, 768), (96, 12288, 512)]
    shapes += [(130, 20000, 256), (5, 40000, 128), (70, 9000, 100), (200, 4000, 100)]
    shapes += [(200, 4096, 1040), (100, 12288, 1000)]
    for m, n, k in shapes:
        x = cuda_rand(m, k, seed=76)
        w = cuda_rand(n, k, seed=77, scale=0.05)
        for bk, out_dtype in ((32, BF16), (32, F32), (16, BF16)):
            ref = cuda.gemm(x, w, bk=bk, out_dtype=out_dtype, tiling="m64n64")
            out = cuda.gemm(x, w, bk=bk, out_dtype=out_dtype)
            step = gemm_mod.k_step(bk, k)
            what = f"{m}x{n}x{k} bk={bk} {out_dtype}: {pick(m, n, step)} vs m64n64"
            assert_same_bytes(out, ref, what)
    assert pick(200, 4096, 16) == "p64n128" and pick(100, 12288, 16) == "p128n128w4"
    assert_detects_one_ulp(ref, out, index=3)


@pytest.mark.parametrize("bk", [16, 32])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_gemm_wider_k_steps_give_the_same_bytes(bk, out_dtype):
    """The bitwise gate that lets bk = 16 and 32 load 64 columns of K per loop step."""
    cuda = backend()
    for m, n, k in ((1, 96, 128), (77, 4096, 4096), (300, 1000, 4096), (5, 64, 192)):
        x = cuda_rand(m, k, seed=64)
        w = cuda_rand(n, k, seed=65, scale=0.05)
        ref = cuda.gemm(x, w, bk=bk, out_dtype=out_dtype, block_k=bk)
        wide = cuda.gemm(x, w, bk=bk, out_dtype=out_dtype)
        assert_same_bytes(wide, ref, f"bk={bk} {m}x{n}x{k}: default steps vs {bk}")
        for step in (2 * bk, 4 * bk):
            if step <= 64 and k % step == 0:
                out = cuda.gemm(x, w, bk=bk, out_dtype=out_dtype, block_k=step)
                assert_same_bytes(out, ref, f"bk={bk} {m}x{n}x{k}: steps of {step} vs {bk}")
    assert_detects_one_ulp(ref, wide, index=min(11, ref.numel() - 1))


def test_gemm_refuses_a_k_step_that_does_not_divide_k():
    x = cuda_rand(3, 96)
    w = cuda_rand(8, 96)
    with pytest.raises(ValueError, match="that divides K \\(96\\), got 64"):
        backend().gemm(x, w, bk=32, block_k=64)


def test_gemm_bytes_are_those_of_the_row_alone_inside_a_3d_batch():
    x = cuda_rand(4, 33, 512, seed=5)
    w = cuda_rand(640, 512, seed=6, scale=0.05)
    full = P.gemm(x, w, bk=BK)
    for b in range(4):
        assert_same_bytes(P.gemm(x[b, 5:6], w, bk=BK), full[b, 5:6], f"batch {b} row 5")


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_gemm_error_is_bounded(out_dtype):
    x = cuda_rand(513, 4100, seed=7)
    w = cuda_rand(1000, 4100, seed=8, scale=0.05)
    ref = x.to(F64) @ w.to(F64).T
    err = rel_err(P.gemm(x, w, out_dtype=out_dtype, bk=BK), ref)
    assert err < (4e-3 if out_dtype == BF16 else 1e-5), err


# --- rmsnorm, residual, swiglu, rope ------------------------------------------------------------
@pytest.mark.parametrize("hidden", [128, 1000, 4096])
def test_rmsnorm_row_bytes_do_not_depend_on_batch(hidden):
    x = cuda_rand(4096, hidden, seed=9, scale=3.0)
    w = cuda_rand(hidden, seed=10).abs() + 0.5
    out = rows_invariant(lambda a: P.rmsnorm(a, w, 1e-6), x, what="rmsnorm")
    xf = x.to(F64)
    ref = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.to(F64)
    assert rel_err(out, ref) < 8e-3


def test_residual_add_and_swiglu_are_elementwise_and_accurate():
    a = cuda_rand(4096, 768, seed=11)
    b = cuda_rand(4096, 768, seed=12)
    add = rows_invariant(by_row(P.residual_add, a, b), row_ids(4096), what="residual")
    assert_same_bytes(add, (a.float() + b.float()).to(BF16), "residual vs RNE(a+b)")
    out = rows_invariant(by_row(P.swiglu, a, b), row_ids(4096), what="swiglu")
    g64 = a.to(F64)
    assert rel_err(out, g64 * torch.sigmoid(g64) * b.to(F64)) < 8e-3


def test_rope_row_bytes_depend_only_on_the_position():
    x = cuda_rand(4096, 8, 128, seed=13)
    pos = torch.arange(4096, device="cuda")
    full = P.rope(x, pos, 1e6)
    for lo, hi in ((0, 1), (17, 18), (1000, 1257), (4000, 4096)):
        assert_same_bytes(P.rope(x[lo:hi], pos[lo:hi], 1e6), full[lo:hi], f"rope {lo}:{hi}")
    perm = torch.randperm(4096, device="cuda")
    shuffled = P.rope(x[perm], pos[perm], 1e6)
    assert_same_bytes(shuffled, full[perm], "rope permuted")
    assert_detects_one_ulp(full[perm], shuffled)
    cos, sin = CPU.rope_tables(1e6, 128, 4096)
    xf = x.to(F64).cpu()
    c = cos[:4096, None, :].to(F64)
    s = sin[:4096, None, :].to(F64)
    ref = torch.cat([xf[..., :64] * c - xf[..., 64:] * s, xf[..., 64:] * c + xf[..., :64] * s], -1)
    assert rel_err(full.cpu(), ref) < 8e-3


# --- softmax, log_softmax, router ---------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1000, 32768, 151936])
@pytest.mark.parametrize("log", [True, False])
def test_softmax_row_bytes_do_not_depend_on_batch(vocab, log):
    fn = P.log_softmax if log else P.softmax
    n = 4096 if vocab <= 32768 else 300
    x = cuda_rand(n, vocab, seed=14, scale=4.0, dtype=F32)
    out = rows_invariant(fn, x, what=fn.__name__, ms=tuple(m for m in MS if m <= n))
    x64 = x[:64].to(F64)
    ref = torch.log_softmax(x64, -1) if log else torch.softmax(x64, -1)
    assert rel_err(out[:64], ref) < (1e-6 if log else 1e-5)


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows where an order could show: zeros of both signs, NaN, +inf, all but one -inf."""
    x[3] = 0.0
    x[4, ::2] = -0.0
    x[5, 7] = float("nan")
    x[6, 100] = float("inf")
    x[7] = float("-inf")
    x[7, 5] = 1.0
    return x


@pytest.mark.parametrize("vocab", [50000, 151936])
@pytest.mark.parametrize("log", [True, False])
def test_softmax_split_gives_the_same_bytes(vocab, log):
    """The bitwise gate that lets few long rows spread over many programs per row."""
    cuda = backend()
    fn = cuda.log_softmax if log else cuda.softmax
    x = special_rows(cuda_rand(67, vocab, seed=60, scale=4.0, dtype=F32))
    one = fn(x, split=False)
    split = fn(x, split=True)
    assert_same_bytes(split, one, f"{fn.__name__}: split vs one program per row")
    assert_same_bytes(fn(x[9:10]), one[9:10], f"{fn.__name__}: one row (split by default)")
    assert_detects_one_ulp(one, split, index=vocab + 11)


def test_softmax_split_refuses_a_row_length_off_the_16_grid():
    x = cuda_rand(2, 32769, dtype=F32)
    with pytest.raises(ValueError, match="multiple of 16, got 32769"):
        backend().log_softmax(x, split=True)


def misaligned_copy(x: torch.Tensor) -> torch.Tensor:
    """The same values in a contiguous view whose storage starts off a 16-byte boundary."""
    flat = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    view = flat[1 : 1 + x.numel()].view(x.shape)
    view.copy_(x)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize(
    "what,width",
    [("rmsnorm", 128), ("rmsnorm", 4096), ("log_softmax", 1024), ("log_softmax", 151936),
     ("softmax", 4096), ("softmax", 151936)],
)  # fmt: skip
def test_a_misaligned_input_gives_the_bytes_of_an_aligned_one(what, width):
    """Triton compiles 16-byte aligned and misaligned pointers apart (load widths); the bytes
    must not follow."""
    if what == "rmsnorm":
        x = cuda_rand(300, width, seed=61, scale=3.0)
        w = cuda_rand(width, seed=62).abs() + 0.5

        def fn(a):
            return P.rmsnorm(a, w, 1e-6)
    else:
        x = cuda_rand(300, width, seed=63, scale=4.0, dtype=F32)
        fn = getattr(P, what)
    ref = fn(x)
    out = fn(misaligned_copy(x))
    assert_same_bytes(out, ref, f"{what} width {width}: misaligned input")
    assert_detects_one_ulp(ref, out, index=width + 3)


def test_router_topk_breaks_ties_to_the_lowest_expert_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0]], device="cuda")
    ids, w = P.router_topk(logits, 2)
    assert ids.tolist() == [[1, 2]]
    assert w.float().tolist() == [[0.5, 0.5]]


def test_router_topk_rows_do_not_depend_on_batch():
    logits = cuda_rand(4096, 128, seed=15, scale=2.0, dtype=F32)
    ids, w = P.router_topk(logits, 8)
    for lo, hi in ((0, 1), (100, 229), (0, 4096)):
        i2, w2 = P.router_topk(logits[lo:hi], 8)
        assert torch.equal(i2, ids[lo:hi])
        assert_same_bytes(w2, w[lo:hi], f"router rows {lo}:{hi}")
    assert_detects_one_ulp(w, w.clone())
    p = torch.softmax(logits.to(F64), -1)
    top = torch.topk(p, 8, dim=-1).indices.sort(-1).values
    assert (top == ids).all(-1).float().mean() > 0.99


@pytest.mark.parametrize(
    ("t", "e", "k", "dtype"),
    [(5, 128, 8, BF16), (3, 60, 4, F32), (7, 16, 16, BF16), (300, 512, 10, F32)],
)
def test_the_router_kernel_has_the_definitions_bytes(t, e, k, dtype):
    """router.softmax_topk on cuda (one kernel) against the cpu program on the same logits:
    ids and weight bytes equal, rows with ties, a NaN, one live expert and an infinity
    included. Row 0's k + 1 largest logits are tied (ties go to the lowest id), so the control,
    its expert k moved one ulp up, must take expert k into the top k; with k = E (every expert
    chosen) the control moves the largest logit and its weights must move."""
    x = cuda_rand(t, e, seed=e + k, scale=3.0, dtype=F32)
    x[0, : min(k + 1, e)] = x[0].max() + 1.0
    x[1, 3] = float("nan")
    x[2] = -1e30
    x[2, 7] = 0.0
    x[-1, 2] = float("inf")
    x = x.to(dtype)
    for normalize in (True, False):
        ids, w = P.router_topk(x, k, normalize=normalize)
        want_ids, want_w = CPU.router_topk(x.cpu(), k, normalize=normalize)
        assert torch.equal(ids.cpu(), want_ids)
        assert_same_bytes(w.cpu(), want_w, f"router weights, normalize={normalize}")
    moved = x.clone()
    moved.view(torch.int16 if dtype == BF16 else torch.int32)[0, min(k, e - 1)] += 1  # one ulp
    ids, w = P.router_topk(x, k)
    ids_moved, w_moved = P.router_topk(moved, k)
    if k < e:
        assert k not in ids[0].tolist() and k in ids_moved[0].tolist()
    else:
        assert torch.equal(ids_moved[0], ids[0]) and not same_bytes(w_moved[0], w[0])


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_the_fold_kernel_has_the_definitions_bytes(k):
    """moe.fold on cuda (one kernel) against the cpu program, both accumulators, NaN and
    infinite expert outputs included (rows 2 on: rows 0 and 1 stay finite, so the control's
    row can move); control: row 1's largest weight moved one bf16 ulp (a small one can be
    absorbed by the bf16 adds of 16 terms)."""
    y = cuda_rand(33, k, 300, seed=k, scale=2.0)
    y[2:].view(-1)[::13] = float("nan")
    y[2:].view(-1)[5::17] = float("inf")
    w = cuda_rand(33, k, seed=k + 1).abs()
    for acc in ("bf16", "fp32"):
        got = P.moe_fold(y, w, acc=acc)
        want = (
            CPU.moe_fold(y.cpu(), w.cpu()) if acc == "bf16" else CPU.moe_fold_fp32(y.cpu(), w.cpu())
        )
        assert_same_bytes(got.cpu(), want, f"fold acc={acc} k={k}")
    moved = w.clone()
    moved.view(torch.int16)[1, int(w[1].float().argmax())] += 1
    assert not same_bytes(P.moe_fold(y, moved)[1], P.moe_fold(y, w)[1])


@pytest.mark.parametrize(
    ("t", "k", "e"),
    [(1, 8, 128), (64, 8, 128), (37, 4, 60), (1000, 8, 512), (4096, 8, 128), (2, 64, 256)],
)
def test_the_plan_kernel_is_the_torch_plan(t, k, e):
    """The two-launch expert plan against the torch form on the same device, every field: one
    block of pairs to 512 blocks (4096 x 8), and more tile programs than blocks (2 x 64)."""
    from lockstep_exact.programs import grouping

    ids = _routing(t, k, e, seed=t + e)
    got, want = P.expert_plan(ids, e), grouping.expert_plan(ids, e)
    for field in ("order", "src", "bounds", "tiles"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # control: row 0's first expert swapped for one it does not use moves that expert's count,
    # so the bounds (and with more than one row, the order) must move
    free = sorted(set(range(e)) - set(ids[0].tolist()))
    if free:
        moved = ids.clone()
        moved[0, 0] = free[-1]
        moved[0] = moved[0].sort().values
        assert not torch.equal(P.expert_plan(moved, e).bounds, got.bounds)


# --- moe fold, lora ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("acc", ["bf16", "fp32"])
def test_moe_fold_rows_do_not_depend_on_batch(k, acc):
    y = cuda_rand(4096, k, 512, seed=16)
    w = cuda_rand(4096, k, seed=17).abs()

    def fold(ys, ws):
        return P.moe_fold(ys, ws, acc=acc)

    out = rows_invariant(by_row(fold, y, w), row_ids(4096), what="moe")
    ref = (w.to(F64)[..., None] * y.to(F64)).sum(1)
    assert rel_err(out, ref) < (2e-2 if acc == "bf16" else 4e-3)


def test_lora_zero_adapter_returns_the_base_bytes():
    x = cuda_rand(1000, 1024, seed=18)
    base = cuda_rand(1000, 768, seed=19)
    base[0, :4] = torch.tensor([0.0, -0.0, 1.0, -1.0], dtype=BF16, device="cuda")
    a = cuda_rand(16, 1024, seed=20, scale=0.05)
    b0 = torch.zeros(768, 16, dtype=BF16, device="cuda")
    t = P.lora_shrink(x, a, bk=SHRINK_BK)
    assert_same_bytes(P.lora_expand(base, t, b0, 2.0, bk=EXPAND_BK), base, "zero B")
    t0 = P.lora_shrink(x, torch.zeros_like(a), bk=SHRINK_BK)
    b = cuda_rand(768, 16, seed=21, scale=0.05)
    assert_same_bytes(P.lora_expand(base, t0, b, 2.0, bk=EXPAND_BK), base, "zero A")


def test_lora_rows_do_not_depend_on_batch():
    x = cuda_rand(4096, 1024, seed=22)
    base = cuda_rand(4096, 768, seed=23)
    a = cuda_rand(16, 1024, seed=24, scale=0.05)
    b = cuda_rand(768, 16, seed=25, scale=0.05)

    def lora(xs, bases):
        return P.lora_expand(bases, P.lora_shrink(xs, a, bk=SHRINK_BK), b, 0.5, bk=EXPAND_BK)

    out = rows_invariant(by_row(lora, x, base), row_ids(4096), what="lora")
    x64 = x.to(F64)
    ref = base.to(F64) + (x64 @ a.to(F64).T) @ b.to(F64).T * 0.5
    assert rel_err(out, ref) < 8e-3


# --- attention -----------------------------------------------------------------------------------
def attn_inputs(n, h_q=8, h_kv=2, d=128, seed=30):
    q = cuda_rand(n, h_q, d, seed=seed)
    k = cuda_rand(n, h_kv, d, seed=seed + 1)
    v = cuda_rand(n, h_kv, d, seed=seed + 2)
    return q, k, v


def attention_f64(q, k, v):
    n, h_q, d = q.shape
    g = h_q // k.shape[1]
    qf = q.to(F64).transpose(0, 1)
    kf = k.to(F64).repeat_interleave(g, 1).transpose(0, 1)
    vf = v.to(F64).repeat_interleave(g, 1).transpose(0, 1)
    s = qf @ kf.transpose(1, 2) / d**0.5
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(0, 1)


@pytest.mark.parametrize("block,segment", [(32, 512), (32, 2048), (32, 96), (64, 512), (64, 2048)])
def test_attention_prefill_chunked_and_decode_give_the_same_row_bytes(block, segment):
    n = 4096
    q, k, v = attn_inputs(n)
    pos = torch.arange(n, device="cuda")
    cuda = backend()
    kw = {"block": block, "segment": segment}
    full = P.attention(q, k, v, pos, **kw)
    assert_same_bytes(cuda.attention(q, k, v, pos, split=True, **kw), full, "split prefill")
    # chunked prefill: chunk sizes that straddle blocks and segments
    start = 0
    for size in (1, 31, 100, 1, 892, 1024, 1047, 1000):
        end = start + size
        out = P.attention(q[start:end], k[:end], v[:end], pos[start:end], **kw)
        assert_same_bytes(out, full[start:end], f"chunk {start}:{end}")
        start = end
    assert start == n
    # decode: one token over the cache; the cache may be longer than the token's position
    garbage_k = k.clone()
    garbage_v = v.clone()
    for t in (0, 1, 31, 32, 63, 64, 511, 512, 1023, 1024, 2047, 2048, 2049, 3000, 4095):
        for split in (None, True, False):
            out = cuda.attention(
                q[t : t + 1], k[: t + 1], v[: t + 1], pos[t : t + 1], split=split, **kw
            )
            assert_same_bytes(out, full[t : t + 1], f"decode t={t} split={split}")
        garbage_k[t + 1 :] = float("nan")
        garbage_v[t + 1 :] = float("inf")
        out = P.attention(q[t : t + 1], garbage_k, garbage_v, pos[t : t + 1], **kw)
        assert_same_bytes(out, full[t : t + 1], f"decode t={t} over a longer cache")
        garbage_k.copy_(k)
        garbage_v.copy_(v)
    assert_detects_one_ulp(full[4095:], out, index=3)


_HOPPER_CASES = {  # (queries, first position, kind, q heads, kv heads, head size, block)
    "chunk of 4 heads a group, heads of 128": (700, 333, "run", 32, 8, 128, 32),
    "the same at block 64": (700, 333, "run", 32, 8, 128, 64),
    "one kv head of 7, heads of 64, block 64": (1300, 0, "run", 7, 1, 64, 64),
    "a query head a kv head, every second position": (650, 1, "every second", 6, 6, 128, 32),
    "two tiles' positions unsorted, scattered": (40, 0, "scattered", 16, 2, 64, 32),
    "odd length past three segments": (1601, 0, "run", 12, 4, 128, 64),
}


@pytest.mark.parametrize("case", list(_HOPPER_CASES))
def test_the_hopper_prefill_gives_the_triton_kernel_bytes(case, monkeypatch):
    """attention_hopper's kernel (Gluon, warp-specialized) against attention's Triton kernel:
    the same bytes, with int64 strided positions and a cache holding NaN and inf past the
    last query (the Hopper kernel reads those keys by TMA; neither may reach a product)."""
    A = importlib.import_module("lockstep_exact.programs.cuda.attention")  # the module
    H = importlib.import_module("lockstep_exact.programs.cuda.attention_hopper")

    n, first, kind, h_q, h_kv, d, block = _HOPPER_CASES[case]
    if kind == "every second":
        pos = torch.arange(first, first + 2 * n, 2, device="cuda")
    elif kind == "scattered":
        g = torch.Generator(device="cuda").manual_seed(n)
        pos = torch.randperm(3000, device="cuda", generator=g)[:n]
    else:
        pos = torch.arange(first, first + n, device="cuda")
    s_len = int(pos.max()) + 1
    q = cuda_rand(n, h_q, d, seed=50)
    k = cuda_rand(s_len + 77, h_kv, d, seed=51)
    v = cuda_rand(s_len + 77, h_kv, d, seed=52)
    k[s_len:] = float("nan")
    v[s_len:] = float("inf")
    strided = torch.stack([pos, pos], 1)[:, 1]
    if not H.usable(q, k, v, block):
        pytest.skip("needs an sm_90 GPU and triton's Gluon (the Hopper prefill)")
    kw = {"block": block, "segment": SEGMENT, "split": False}
    hopper = A.attention(q, k, v, strided, **kw)
    assert torch.isfinite(hopper.float()).all()
    monkeypatch.setattr(A, "_HOPPER_PREFILL", False)
    triton_bytes = A.attention(q, k, v, pos.to(torch.int32), **kw)
    assert_same_bytes(hopper, triton_bytes, case)
    assert_detects_one_ulp(triton_bytes, hopper, index=int(hopper[-1].float().abs().argmax()))
    monkeypatch.setattr(A, "_HOPPER_PREFILL", True)
    v[0] += 1.0  # the values of the key every row sees: the kernel reads this call's V
    assert not same_bytes(A.attention(q, k, v, strided, **kw), hopper), "a new V moved nothing"


def test_attention_rows_do_not_depend_on_which_queries_share_the_call():
    n = 1500
    q, k, v = attn_inputs(n, h_q=16, h_kv=4, seed=40)
    pos = torch.arange(n, device="cuda")
    full = P.attention(q, k, v, pos, block=BLOCK, segment=SEGMENT)
    perm = torch.randperm(n, device="cuda")
    shuffled = P.attention(q[perm], k, v, pos[perm], block=BLOCK, segment=SEGMENT)
    assert_same_bytes(shuffled, full[perm], "queries permuted")
    pick = torch.tensor([1499, 3, 700, 1024, 0], device="cuda")
    assert_same_bytes(
        P.attention(q[pick], k, v, pos[pick], block=BLOCK, segment=SEGMENT),
        full[pick],
        "scattered queries",
    )
    assert_detects_one_ulp(full[perm], shuffled, index=9)


@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (4, 4), (16, 1)])
def test_attention_error_is_bounded(h_q, h_kv):
    n = 1200
    q, k, v = attn_inputs(n, h_q=h_q, h_kv=h_kv, seed=50)
    out = P.attention(q, k, v, torch.arange(n, device="cuda"), block=64, segment=SEGMENT)
    assert rel_err(out, attention_f64(q, k, v)) < 1e-2


def _mix(name):
    """[(rows, keys)] per request: each request's rows are the last ``rows`` of its keys."""
    g = torch.Generator().manual_seed(len(name))
    if name == "64 prompts of 1 to 300 tokens":
        return [(n, n) for n in torch.randint(1, 301, (64,), generator=g).tolist()]
    if name == "64 chunks and decodes over caches up to 4096":
        keys = torch.randint(1, 4097, (64,), generator=g).tolist()
        return [(min(s, r), s) for s, r in zip(keys, [1, 7, 64, 65, 130, 500] * 11, strict=False)]
    return {
        "edges of a tile": [(1, 1), (5, 5), (63, 63), (64, 64), (65, 65), (130, 130), (0, 0)],
        "one long prefill": [(4096, 4096)],
        "long and short, a request with no rows": [(2000, 2600), (0, 9), (1, 4096), (17, 40)],
    }[name]


VARLEN_MIXES = (
    "64 prompts of 1 to 300 tokens",
    "64 chunks and decodes over caches up to 4096",
    "edges of a tile",
    "one long prefill",
    "long and short, a request with no rows",
)


def _varlen_batch(reqs, h_q, h_kv, d, seed, gap=5):
    """The requests' rows concatenated and each request's own (q, k, v, positions). A
    request's span of the concatenated keys ends with ``gap`` NaN/inf keys past its last
    query, which no row may read (its own call gets only its clean keys)."""
    qs, ks, vs, ps, own = [], [], [], [], []
    q_starts, k_starts = [0], [0]
    junk = torch.full((gap, h_kv, d), float("nan"), dtype=BF16, device="cuda")
    for i, (n, s) in enumerate(reqs):
        q = cuda_rand(n, h_q, d, seed=seed + 3 * i)
        k = cuda_rand(s, h_kv, d, seed=seed + 3 * i + 1)
        v = cuda_rand(s, h_kv, d, seed=seed + 3 * i + 2)
        pos = torch.arange(s - n, s, device="cuda")
        own.append((q, k, v, pos))
        qs.append(q)
        ps.append(pos)
        ks += [k, junk]
        vs += [v, junk.clone().fill_(float("inf"))]
        q_starts.append(q_starts[-1] + n)
        k_starts.append(k_starts[-1] + s + gap)
    q_starts = torch.tensor(q_starts, dtype=torch.int32, device="cuda")
    k_starts = torch.tensor(k_starts, device="cuda")
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(ps), q_starts, k_starts, own


@pytest.mark.parametrize("mix", VARLEN_MIXES)
@pytest.mark.parametrize(
    "h_q,h_kv,d,block,segment",
    [(8, 2, 128, BLOCK, SEGMENT), (16, 8, 128, 64, 2048), (4, 2, 64, 32, 96), (16, 1, 64, 64, 512)],
)
def test_attention_of_many_sequences_in_one_launch_gives_each_row_its_bytes(
    mix, h_q, h_kv, d, block, segment
):
    """attention_varlen (one launch over every request) against attention on each request
    alone (which may run the Hopper or the split form): the same bytes, for batches of 64
    prompts, of chunks and decodes over caches up to 4096 keys, tile edges, one 4096-token
    prefill (several segments), a request with no rows; each request's keys followed by
    NaN/inf keys no row may read. One ulp of one request's key moves that request's rows
    and no other's."""
    reqs = _mix(mix)
    q, k, v, pos, q_starts, k_starts, own = _varlen_batch(reqs, h_q, h_kv, d, seed=70)
    kw = {"block": block, "segment": segment}
    max_rows = max(n for n, _ in reqs)
    got = P.attention_varlen(q, k, v, pos, q_starts, k_starts, max_rows=max_rows, **kw)
    bounds = q_starts.tolist()
    for r, (qr, kr, vr, pr) in enumerate(own):
        if len(qr):
            want = P.attention(qr, kr, vr, pr, **kw)
            assert_same_bytes(got[bounds[r] : bounds[r + 1]], want, f"{mix}: request {r}")
    # the control: one ulp of the largest element of one key, the first query's own key in
    # the request whose rows start earliest (its rows see few keys, so the ulp shows)
    r = min((s - n, -n, i) for i, (n, s) in enumerate(reqs) if n)[2]
    at = int(k_starts[r]) + reqs[r][1] - reqs[r][0]
    moved = k.clone()
    moved[at] = nudge_ulp(k[at], int(k[at].float().abs().argmax()))
    other = P.attention_varlen(q, moved, v, pos, q_starts, k_starts, max_rows=max_rows, **kw)
    lo, hi = bounds[r], bounds[r + 1]
    assert not same_bytes(other[lo:hi], got[lo:hi]), "the request's rows did not move"
    assert same_bytes(other[:lo], got[:lo]) and same_bytes(other[hi:], got[hi:])


# --- paged decode (issue 11: the graph-safe step) ------------------------------------------------
def _paged_batch(lens, page, seed, h_kv=2, d=128, spare=3):
    """Requests of ``lens`` keys scattered over shuffled pages of one cache whose other slots
    hold NaN/inf; returns (contiguous k/v per request, key_cache, value_cache, block_table)."""
    pages = [-(-n // page) for n in lens]
    width = max(pages) + 2
    num_blocks = sum(pages) + spare
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).cuda()
    kv = torch.full((num_blocks, h_kv, page, 2 * d), float("nan"), dtype=BF16, device="cuda")
    kv[..., d:] = float("inf")
    key_cache, value_cache = kv[..., :d], kv[..., d:]  # vLLM-style halves of one cache
    table = torch.zeros(len(lens) + 2, width, dtype=torch.int32, device="cuda")
    ks, vs, at = [], [], 0
    for i, n in enumerate(lens):
        k = cuda_rand(n, h_kv, d, seed=seed + 7 * i)
        v = cuda_rand(n, h_kv, d, seed=seed + 7 * i + 1)
        ids = perm[at : at + pages[i]]
        at += pages[i]
        table[i, : pages[i]] = ids.int()
        t = torch.arange(n, device="cuda")
        key_cache[ids[t // page], :, t % page] = k
        value_cache[ids[t // page], :, t % page] = v
        ks.append(k)
        vs.append(v)
    return ks, vs, key_cache, value_cache, table


DECODE_LENS = (1, 31, 32, 33, 100, 2047, 2048, 2049, 3000, 4100)


@pytest.mark.parametrize(
    "page,block,g,tile,d",
    [
        (16, 32, 4, "one_warp", 128),
        (16, 32, 4, "warpgroup", 128),
        (32, 32, 4, None, 128),
        (64, 32, 4, "warpgroup", 128),
        (48, 32, 4, "warpgroup", 128),  # pages that do not divide the segment: an entry held
        (8, 32, 4, "warpgroup", 128),  # more pages a segment than the tile holds: looked up
        (16, 64, 4, "one_warp", 128),
        (16, 64, 4, "warpgroup", 128),
        (32, 32, 16, "one_warp", 128),
        (32, 32, 16, "warpgroup", 128),
        (16, 32, 64, None, 128),
        (32, 32, 4, "warpgroup", 64),
        (32, 32, 8, "warpgroup", 256),
    ],
)
def test_paged_decode_gives_each_request_the_contiguous_bytes(page, block, g, tile, d, monkeypatch):
    """A batch of one-token decodes over a paged cache (pages shuffled, NaN/inf elsewhere,
    two padding requests of seq_len 0): each row is the bytes of attention.blocked on the
    request's contiguous keys, decoded alone; one ulp in one query row is caught. Up to 16
    query heads per kv head a program is one warp when the grid fills the GPU, else (and
    beyond 16 heads) a 64-row warpgroup: ``tile`` forces one of them (None: by shape). The
    warpgroup takes a block's pages from the segment's table entries, loaded once, where
    they fit its registers (pages of 16 and more at segment 512), else looks them up. Heads
    of 128, and of 64 and 256 in the warpgroup."""
    mod = importlib.import_module("lockstep_exact.programs.cuda.attention")
    if tile is not None:
        forced = mod._ONE_WARP_TILE if tile == "one_warp" else mod._TILE
        monkeypatch.setattr(mod, "_paged_tile", lambda *_: forced)
    h_kv = 2
    ks, vs, key_cache, value_cache, table = _paged_batch(DECODE_LENS, page, seed=page + block, d=d)
    n = len(DECODE_LENS)
    q = cuda_rand(n + 2, h_kv * g, d, seed=99)
    seq = torch.tensor(list(DECODE_LENS) + [0, 0], dtype=torch.int32, device="cuda")
    pos = torch.tensor([m - 1 for m in DECODE_LENS] + [0, 0], device="cuda")
    got = P.attention_decode_paged(
        q, key_cache, value_cache, table, seq, pos, max_seq_len=4200, block=block, segment=SEGMENT
    )
    for i, m in enumerate(DECODE_LENS):
        want = P.attention(q[i : i + 1], ks[i], vs[i], pos[i : i + 1], block=block, segment=SEGMENT)
        assert_same_bytes(got[i : i + 1], want, f"request {i} ({m} keys)")
    moved = q.clone()
    # one ulp of request 3's largest query element: one ulp of a small one (index 5 of a
    # head of 64) moved no output byte on the H200
    moved[3] = nudge_ulp(q[3], int(q[3].float().abs().argmax()))
    other = P.attention_decode_paged(
        moved,
        key_cache,
        value_cache,
        table,
        seq,
        pos,
        max_seq_len=4200,
        block=block,
        segment=SEGMENT,
    )
    assert not same_bytes(other[3], got[3]) and same_bytes(other[:3], got[:3])


def test_paged_decode_reads_any_index_dtype_and_strides_and_skips_bad_positions():
    """seq_lens and positions as int64 or int32, strided, read in the kernel: the same bytes;
    a request whose position is not below its seq_len (or is negative) attends nothing and
    moves no other row's bytes; a float index is refused."""
    h_kv, g, d, page = 2, 4, 128, 16
    lens = (7, 600, 1500)
    ks, vs, key_cache, value_cache, table = _paged_batch(lens, page, seed=21)
    q = cuda_rand(4, h_kv * g, d, seed=22)
    seq = torch.tensor([*lens, 9], dtype=torch.int32, device="cuda")
    pos = torch.tensor([m - 1 for m in lens] + [9], device="cuda")  # row 3: position == seq_len
    want = P.attention_decode_paged(
        q, key_cache, value_cache, table, seq, pos, max_seq_len=2048, block=BLOCK, segment=SEGMENT
    )
    for i, m in enumerate(lens):
        alone = P.attention(
            q[i : i + 1], ks[i], vs[i], pos[i : i + 1], block=BLOCK, segment=SEGMENT
        )
        assert_same_bytes(want[i : i + 1], alone, f"request {i} ({m} keys)")
    wide = torch.stack([seq.long(), seq.long()], 1)[:, 0]  # int64, stride 2
    spaced = torch.stack([pos.int(), pos.int()], 1)[:, 1]  # int32, stride 2
    assert wide.stride(0) == 2 and spaced.stride(0) == 2
    got = P.attention_decode_paged(
        q,
        key_cache,
        value_cache,
        table,
        wide,
        spaced,
        max_seq_len=2048,
        block=BLOCK,
        segment=SEGMENT,
    )
    assert_same_bytes(got[:3], want[:3], "int64 / strided indices")
    neg = pos.clone()
    neg[3] = -5
    got = P.attention_decode_paged(
        q, key_cache, value_cache, table, seq, neg, max_seq_len=2048, block=BLOCK, segment=SEGMENT
    )
    assert_same_bytes(got[:3], want[:3], "a negative position beside them")
    assert_detects_one_ulp(want[:3], got[:3], index=5)
    with pytest.raises(
        ValueError, match="must be int32 or int64, got torch.int32 and torch.float32"
    ):
        P.attention_decode_paged(
            q,
            key_cache,
            value_cache,
            table,
            seq,
            pos.float(),
            max_seq_len=2048,
            block=BLOCK,
            segment=SEGMENT,
        )


def test_attention_reads_positions_of_any_index_dtype_in_place():
    """The kernel reads int32 or int64 positions, strided, and checks them itself: the same
    bytes as the int32 contiguous positions; float positions are refused."""
    n = 700
    q, k, v = attn_inputs(n, h_q=8, h_kv=2, seed=31)
    pos32 = torch.arange(n, device="cuda", dtype=torch.int32)
    want = P.attention(q, k, v, pos32, block=BLOCK, segment=SEGMENT)
    strided = torch.stack([pos32.long(), pos32.long()], 1)[:, 1]
    assert strided.stride(0) == 2
    for positions in (pos32.long(), strided, pos32.cpu()):
        got = P.attention(q, k, v, positions, block=BLOCK, segment=SEGMENT)
        assert_same_bytes(got, want, f"{positions.dtype}")
    assert_detects_one_ulp(want, got, index=11)
    one = backend().attention(q[5:6], k, v, strided[5:6], split=True, block=BLOCK, segment=SEGMENT)
    assert_same_bytes(one, want[5:6], "split")
    assert_detects_one_ulp(want[5:6], one)
    with pytest.raises(ValueError, match="integer positions required, got torch.float32"):
        P.attention(q, k, v, pos32.float(), block=BLOCK, segment=SEGMENT)


_STOP_CALLS = {
    "attention, negative": (
        "cuda.attention(q, k, k, pos, block=BLOCK, segment=SEGMENT, split=False)",
        -1,
    ),
    "attention, past the keys": (
        "cuda.attention(q, k, k, pos, block=BLOCK, segment=SEGMENT, split=False)",
        64,
    ),
    "attention split, past the keys": (
        "cuda.attention(q, k, k, pos, block=BLOCK, segment=SEGMENT, split=True)",
        64,
    ),
    "rope, past the bound": ("rope_bounded(q, pos)", 4096),
    "rope, negative": ("rope_bounded(q, pos)", -3),
}


@pytest.mark.parametrize("case", list(_STOP_CALLS))
def test_a_position_outside_its_range_stops_the_kernel(case):
    """Positions checked on the device (no host read): attention's against the keys, rope's
    against programs.position_bound. A bad one stops the kernel, so the call fails with a
    CUDA error instead of reading outside k/v or the table. Run in a child process, since a
    stopped kernel leaves the CUDA context unusable; the same call on good positions runs."""
    import subprocess
    import sys
    import textwrap

    call, value = _STOP_CALLS[case]
    script = textwrap.dedent(f"""
        import torch
        from lockstep_exact import programs as P
        from lockstep_exact.programs import cuda
        BLOCK = P.Program.of("attention.blocked").param("block")
        SEGMENT = P.Program.of("attention.blocked").param("segment")
        def rope_bounded(x, pos):
            with P.position_bound(4096):
                return cuda.rope(x, pos, 1e6)
        q = torch.randn(3, 8, 128, device="cuda").bfloat16()
        k = torch.randn(64, 2, 128, device="cuda").bfloat16()
        pos = torch.tensor([0, 5, 63], device="cuda")
        {call}
        torch.cuda.synchronize()
        print("good call ran", flush=True)
        pos[2] = {value}
        {call}
        torch.cuda.synchronize()
        print("bad call returned", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert "good call ran" in run.stdout, run.stderr[-2000:]
    assert run.returncode != 0 and "bad call returned" not in run.stdout
    assert "CUDA error" in run.stderr or "illegal instruction" in run.stderr, run.stderr[-2000:]


def test_paged_decode_refuses_more_query_heads_per_kv_head_than_a_program_holds():
    _, _, key_cache, value_cache, table = _paged_batch((40,), 16, seed=5, h_kv=1)
    q = cuda_rand(1, 65, 128, seed=6)
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="65 query heads per kv head unsupported"):
        P.attention_decode_paged(q, key_cache, value_cache, table, one * 40, one * 39,
                                 max_seq_len=64, block=BLOCK, segment=SEGMENT)  # fmt: skip


def test_the_paged_decode_step_replays_from_a_cuda_graph_with_the_eager_bytes():
    """write_pages + attention_decode_paged captured once in a CUDA graph (no host read in
    either), then replayed on new rows, new lengths and new pages: the eager bytes."""
    h_kv, g, d, page = 2, 4, 128, 16
    lens = (5, 40, 2100)
    ks, vs, key_cache, value_cache, table = _paged_batch(lens, page, seed=4, spare=300)
    n = len(lens)
    q = cuda_rand(n, h_kv * g, d, seed=1)
    k_new, v_new = cuda_rand(n, h_kv, d, seed=2), cuda_rand(n, h_kv, d, seed=3)
    seq = torch.tensor([m + 1 for m in lens], dtype=torch.int32, device="cuda")
    pos = (seq - 1).long()
    slots = torch.stack([table[i, m // page].long() * page + m % page for i, m in enumerate(lens)])
    out = torch.empty(n, h_kv * g, d, dtype=BF16, device="cuda")

    def step():
        P.write_pages(key_cache, value_cache, k_new, v_new, slots)
        out.copy_(P.attention_decode_paged(
            q, key_cache, value_cache, table, seq, pos, max_seq_len=4096,
            block=BLOCK, segment=SEGMENT,
        ))  # fmt: skip

    step()  # compiles the kernels before the capture
    eager_first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # the next step: the same requests one token further, new query rows
    q.copy_(cuda_rand(n, h_kv * g, d, seed=11))
    k_new.copy_(cuda_rand(n, h_kv, d, seed=12))
    v_new.copy_(cuda_rand(n, h_kv, d, seed=13))
    seq += 1
    pos += 1
    slots.copy_(torch.stack([table[i, (m + 1) // page].long() * page + (m + 1) % page
                             for i, m in enumerate(lens)]))  # fmt: skip
    graph.replay()
    replayed = out.clone()
    step()
    assert_same_bytes(replayed, out, "graph replay vs eager")
    assert not same_bytes(replayed, eager_first)
    assert not same_bytes(nudge_ulp(replayed, 7), out)


def test_write_pages_copies_rows_into_their_slots_and_skips_padding():
    h_kv, d, page = 2, 128, 16
    kv = torch.zeros(6, h_kv, page, 2 * d, dtype=BF16, device="cuda")
    key_cache, value_cache = kv[..., :d], kv[..., d:]
    k, v = cuda_rand(4, h_kv, d, seed=1), cuda_rand(4, h_kv, d, seed=2)
    before = kv.clone()
    P.write_pages(key_cache, value_cache, k, v, torch.tensor([17, -1, 95, 6 * page], device="cuda"))
    assert_same_bytes(key_cache[1, :, 1], k[0])
    assert_same_bytes(value_cache[5, :, 15], v[2])
    changed = (kv.view(torch.int16) != before.view(torch.int16)).any(-1)
    assert changed.nonzero().tolist() == [[1, 0, 1], [1, 1, 1], [5, 0, 15], [5, 1, 15]]


def test_rope_under_a_position_bound_reads_no_position_on_the_host():
    """Under programs.position_bound the cuda rope runs inside a CUDA graph capture (no host
    read) with the bytes of the unbounded call; outside one, a capture is refused by name."""
    x = cuda_rand(5, 4, 128, seed=3)
    pos = torch.tensor([0, 7, 1000, 4095, 3], device="cuda")
    want = P.rope(x, pos, 1e6)
    spaced = torch.stack([pos.int(), pos.int()], 1)[:, 0]  # int32, stride 2: read in place
    with P.position_bound(4096):
        spaced_out = P.rope(x, spaced, 1e6)
    assert_same_bytes(spaced_out, want, "int32 strided positions")
    assert_detects_one_ulp(want, spaced_out, index=3)
    out = torch.empty_like(x)
    with P.position_bound(4096):
        out.copy_(P.rope(x, pos, 1e6))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(P.rope(x, pos, 1e6))
    out.zero_()
    graph.replay()
    assert_same_bytes(out, want)
    refused = pytest.raises(ValueError, match="a CUDA graph capture needs programs.position_bound")
    with refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        P.rope(x, pos, 1e6)


# --- grouped experts and one-launch K partitions -------------------------------------------------
def _kpart_by_partitions(x, w, parts, out_dtype):
    """gemm.kpart as its definition reads: each partition a plain gemm of contiguous copies,
    the fp32 sums folded over the pair tree, one rounding (no one-launch kernel involved)."""
    cuda = backend()
    size = x.shape[-1] // parts
    sums = [
        cuda.gemm(
            x[:, p * size : (p + 1) * size].contiguous(),
            w[:, p * size : (p + 1) * size].contiguous(),
            out_dtype=F32,
            tiling="m64n64",
            bk=BK,
        )
        for p in range(parts)
    ]
    total = P.fold_tree(sums)
    return total if out_dtype == F32 else cuda.round_bf16(total)


def _routing(t, k, experts, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    return torch.sort(ids, dim=1).values.cuda()


def _by_expert(x, w, plan, fn):
    """Each expert's sorted rows through ``fn(rows, w[e])``, placed back in sorted order."""
    bounds = plan.bounds.tolist()
    outs = [fn(x[bounds[e] : bounds[e + 1]], w[e]) for e in range(plan.experts)]
    return torch.cat([o for o in outs if o.shape[0]])


@pytest.mark.parametrize(
    "t,k,experts,hidden,inter",
    [(1, 8, 128, 2048, 768), (3, 2, 5, 200, 130), (64, 8, 128, 2048, 768),
     (257, 4, 16, 1000, 96), (700, 8, 64, 512, 256)],
)  # fmt: skip
def test_grouped_experts_give_each_pair_the_bytes_of_its_experts_plain_gemm(
    t, k, experts, hidden, inter
):
    """gemm_grouped (one launch for all experts) against each expert's rows through the
    plain gemm (gate, bf16 and fp32 out) and gemm.kpart by partitions (down): byte-equal.
    Control on an input: one element of one routed hidden row moved by one ulp moves that
    pair's fp32 output."""
    cuda = backend()
    from lockstep_exact.lanes.qwen3 import k_parts

    ids = _routing(t, k, experts, seed=t)
    plan = P.expert_plan(ids, experts)
    h = cuda_rand(t, hidden, seed=80)
    gate_w = cuda_rand(experts, inter, hidden, seed=81, scale=0.05)
    down_w = cuda_rand(experts, hidden, inter, seed=82, scale=0.05)
    xs = h[plan.src]
    for out_dtype in (BF16, F32):
        got = P.gemm_grouped(xs, gate_w, plan, out_dtype=out_dtype, bk=BK, parts=1)
        want = _by_expert(
            xs, gate_w, plan, lambda r, w, o=out_dtype: cuda.gemm(r, w, out_dtype=o, bk=BK)
        )
        assert_same_bytes(got, want, f"grouped gate {out_dtype}")
    act = cuda_rand(t * k, inter, seed=83)
    parts = k_parts(inter)
    for out_dtype in (BF16, F32):
        got = P.gemm_grouped(act, down_w, plan, parts=parts, out_dtype=out_dtype, bk=BK)
        want = _by_expert(
            act, down_w, plan, lambda r, w, o=out_dtype: _kpart_by_partitions(r, w, parts, o)
        )
        assert_same_bytes(got, want, f"grouped down, {parts} partitions, {out_dtype}")
    assert_detects_one_ulp(want, got, index=3)
    base = P.gemm_grouped(xs, gate_w, plan, out_dtype=F32, bk=BK, parts=1)
    moved = xs.clone()
    moved[0] = nudge_ulp(xs[0], index=1)
    shifted = P.gemm_grouped(moved, gate_w, plan, out_dtype=F32, bk=BK, parts=1)
    assert not same_bytes(shifted[0], base[0])
    assert_same_bytes(shifted[1:], base[1:], "the other pairs")


def test_grouped_experts_replay_from_a_cuda_graph_with_the_eager_bytes():
    """The plan and the grouped expert MLP captured once, replayed on a new routing and new
    rows (no host read): the eager bytes; a routing that moved gives other bytes."""
    from lockstep_exact.programs.grouping import unsort

    t, k, experts, hidden, inter = 16, 8, 128, 2048, 768
    ids = _routing(t, k, experts, seed=1)
    h = cuda_rand(t, hidden, seed=90)
    gate_w = cuda_rand(experts, inter, hidden, seed=91, scale=0.05)
    up_w = cuda_rand(experts, inter, hidden, seed=92, scale=0.05)
    down_w = cuda_rand(experts, hidden, inter, seed=93, scale=0.05)
    out = torch.empty(t, k, hidden, dtype=BF16, device="cuda")

    def step():
        plan = P.expert_plan(ids, experts)
        xs = h[plan.src]
        act = P.swiglu(
            P.gemm_grouped(xs, gate_w, plan, bk=BK, parts=1),
            P.gemm_grouped(xs, up_w, plan, bk=BK, parts=1),
        )
        out.copy_(unsort(P.gemm_grouped(act, down_w, plan, parts=8, bk=BK), plan))

    step()
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ids.copy_(_routing(t, k, experts, seed=2))
    h.copy_(cuda_rand(t, hidden, seed=94))
    graph.replay()
    replayed = out.clone()
    step()
    assert_same_bytes(replayed, out, "graph replay vs eager")
    assert not same_bytes(replayed, first)
    assert_detects_one_ulp(out, replayed, index=11)


def _kpart_against_its_partitions(m, n, k, parts, seed):
    """The backend's kpart_partial (whichever form the rows give) and the dispatch point's,
    both against one plain gemm per partition and the torch pair tree."""
    cuda = backend()
    x = cuda_rand(m, k, seed=seed)
    w = cuda_rand(n, k, seed=seed + 1, scale=0.05)
    got = cuda.kpart_partial(x, w, parts=parts, bk=KPART_BK)
    want = _kpart_by_partitions(x, w, parts, F32)
    assert_same_bytes(got, want, f"{m}x{n}x{k} in {parts}")
    assert_same_bytes(P.kpart_partial(x, w, parts=parts, bk=KPART_BK), want, "through the dispatch")
    return cuda, x, w, got, want


@pytest.mark.parametrize(
    "m,n,k,parts",
    [(1, 4096, 12288, 8), (7, 2048, 768, 8), (64, 1000, 800, 8), (200, 4096, 4096, 4),
     (256, 2048, 1536, 2), (129, 130, 8 * 100, 8)],
)  # fmt: skip
def test_kpart_in_one_launch_gives_the_bytes_of_its_partitions(m, n, k, parts):
    """gemm.kpart's partitions and fold in one kernel (up to 256 rows) against one plain
    gemm per partition and the pair tree (ragged partitions included: K = 800 in 8)."""
    cuda, x, w, got, want = _kpart_against_its_partitions(m, n, k, parts, seed=95)
    assert_detects_one_ulp(want, got, index=2)
    # Control on an input: one element of row 0 moved by one ulp moves that row only.
    moved = x.clone()
    moved[0] = nudge_ulp(x[0], index=1)
    shifted = cuda.kpart_partial(moved, w, parts=parts, bk=KPART_BK)
    assert not same_bytes(shifted[0], got[0])
    assert_same_bytes(shifted[1:], got[1:], "the other rows")


@pytest.mark.parametrize(
    "m,n,k,parts",
    [(257, 4096, 4096, 8), (1000, 1000, 8 * 100, 8), (4099, 2048, 12288, 8), (300, 130, 768, 2),
     (2048, 512, 1024, 16)],
)  # fmt: skip
def test_kpart_folded_above_the_one_launch_rows_gives_the_bytes_of_its_partitions(m, n, k, parts):
    """gemm.kpart above the one-launch rows: each partition through the plain gemm into one
    stacked buffer (K-slices read in place), the pair tree in one fold launch, against one
    plain gemm per partition of contiguous copies and ``programs.fold_tree``'s torch adds."""
    from lockstep_exact.programs.cuda import grouped

    assert m > grouped.ONE_KERNEL_ROWS
    cuda, x, w, got, _ = _kpart_against_its_partitions(m, n, k, parts, seed=97)
    bf = P.gemm_kpart(x, w, parts=parts, bk=KPART_BK)
    assert_same_bytes(bf, _kpart_by_partitions(x, w, parts, BF16), "rounded to bf16")
    # Control on an input: the last partition's weight column of output 5 moved by one ulp
    # moves column 5 of some row and no other column.
    moved = w.clone()
    moved[5] = nudge_ulp(w[5], index=k - 1)
    shifted = cuda.kpart_partial(x, moved, parts=parts, bk=KPART_BK)
    assert not same_bytes(shifted[:, 5], got[:, 5])
    keep = [c for c in range(n) if c != 5]
    assert_same_bytes(shifted[:, keep], got[:, keep], "the other columns")


def test_the_fold_of_stacked_partials_is_the_pair_tree():
    """One fold launch over [P, ...] fp32 partials (P = 1 to 16, specials: infinities of both
    signs, NaN, signed zeros, subnormals) equals ``programs.fold_tree`` of the same tensors."""
    from lockstep_exact.programs.cuda.grouped import fold_stacked

    for parts in (1, 2, 4, 8, 16):
        s = cuda_rand(parts, 333, 7, seed=99 + parts, dtype=F32) * 1e30
        s[:, 0, 0] = torch.tensor([float("inf"), -float("inf")] * 8, device="cuda")[:parts]
        s[0, 1, 1] = float("nan")
        s[:, 2, 2] = -0.0
        s[:, 3, 3] = 1e-40 * (torch.arange(parts, device="cuda") - parts / 2)
        got = fold_stacked(s)
        want = P.fold_tree(list(s))
        assert_same_bytes(got, want, f"fold of {parts}")
        # Control on an input: at an element where every other partial is +0, the last
        # partial moved by one ulp moves the root (the adds of zeros are exact).
        s[:, 5, 5] = 0.0
        s[parts - 1, 5, 5] = 1.5
        base = fold_stacked(s)
        moved = s.clone()
        moved[parts - 1, 5, 5] = nudge_ulp(s[parts - 1, 5, 5].reshape(1))[0]
        again = fold_stacked(moved)
        assert not same_bytes(again[5, 5], base[5, 5])
        assert_same_bytes(again[6:], base[6:], "the other elements")


def test_round_and_residual_add_in_one_launch_give_the_cpu_programs_bytes():
    """The one-launch round_bf16 and residual.add against the cpu programs (the definitions),
    over specials: ties at every bf16 exponent, subnormals, the largest finite values, both
    infinities, NaNs of both signs; a row's bytes never depend on the launch's size."""
    cuda = backend()
    g = torch.Generator().manual_seed(100)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(F32)
    ties = (torch.arange(-126, 128, dtype=torch.int32) + 127) << 23 | 0x8000
    inf, nan = float("inf"), float("nan")
    specials = torch.tensor([inf, -inf, nan, -nan, 3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0])
    x = torch.cat([x, ties.view(F32), -ties.view(F32), specials])
    got = cuda.round_bf16(x.cuda()).cpu()
    assert_same_bytes(got, CPU.round_bf16(x), "round_bf16")
    assert_same_bytes(cuda.round_bf16(x[:1001].cuda()).cpu(), got[:1001], "a prefix alone")
    a = CPU.round_bf16(x[: 1 << 17])
    b = CPU.round_bf16(x[1 << 17 : 1 << 18])
    # Control on an input: where b is +0 (a + 0 is exact), a moved by one ulp moves that
    # element of the sum and no other.
    i = int(torch.nonzero(torch.isfinite(a.float()) & (a.float() != 0))[0])
    b[i] = 0.0
    add = cuda.residual_add(a.cuda(), b.cuda()).cpu()
    assert_same_bytes(add, CPU.residual_add(a, b), "residual_add")
    moved = a.clone()
    moved[i] = nudge_ulp(a[i].reshape(1))[0]
    again = cuda.residual_add(moved.cuda(), b.cuda()).cpu()
    assert not same_bytes(again[i], add[i])
    keep = torch.arange(len(add)) != i
    assert_same_bytes(again[keep], add[keep], "the other elements")


# --- sample.gumbel_topp in one kernel ---------------------------------------------------------
@pytest.mark.parametrize("vocab", [1000, 32000, 151936])
def test_sample_in_one_kernel_draws_the_definitions_tokens(vocab):
    """Greedy and top_p 1 rows drawn by the one-kernel form: the tokens of the definition's
    torch operations on the same device (stream rounds 1-4, seeds across int64, positions up
    to 2**32 - 1, a -inf entry). Control on an input: every seed moved by one moves tokens."""
    from lockstep_exact.programs.cpu import sampling as definition
    from lockstep_exact.programs.cuda import sampling as kernel

    t = 64
    lp = torch.log_softmax(cuda_rand(t, vocab, seed=vocab, dtype=F32) * 3, dim=-1)
    lp[1, 5] = float("-inf")
    temps = [0.0 if i % 5 == 0 else 0.5 + (i % 7) * 0.25 for i in range(t)]
    seeds = [(i * 7919 - 2**40) * (-1) ** i for i in range(t)] + [2**63 - 1]
    seeds = seeds[1:]
    pos = torch.tensor([i * 67108859 % 2**32 for i in range(t)])
    for rounds in (1, 3, 4):
        args = dict(temperature=temps, top_p=1.0, seeds=seeds, positions=pos, rounds=rounds)
        assert kernel._one_kernel_rows(temps, 1.0, seeds, pos, t, rounds) is not None
        got = kernel.sample(lp, **args)
        want = definition.sample(lp, **args)
        assert torch.equal(got, want), f"rounds {rounds}: {(got != want).sum()} rows differ"
    moved = kernel.sample(lp, **{**args, "seeds": [s + 1 for s in seeds[:-1]] + [0]})
    assert not torch.equal(moved, want)


def test_sample_takes_the_definition_for_a_nucleus_and_refuses_a_nan_row_in_its_words():
    from lockstep_exact.programs.cpu import sampling as definition
    from lockstep_exact.programs.cuda import sampling as kernel

    lp = torch.log_softmax(cuda_rand(4, 500, seed=3, dtype=F32), dim=-1)
    args = dict(temperature=1.0, top_p=[1.0, 0.9, 1.0, 1.0], seeds=[1, 2, 3, 4], positions=[5] * 4)
    assert kernel._one_kernel_rows(1.0, args["top_p"], [1, 2, 3, 4], [5] * 4, 4, 3) is None
    assert torch.equal(kernel.sample(lp, **args), definition.sample(lp, **args))
    lp[2, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN log-probability"):
        kernel.sample(lp, **{**args, "top_p": 1.0})


def test_sample_without_the_check_marks_an_undrawable_row_and_waits_for_nothing():
    """check=False (vLLM's async scheduling): the rows drawn are the checked call's, a row the
    rule cannot draw from is -1 instead of an exception. Control on an input: a NaN put in a
    logit row moves that row, and only it, to -1; all -inf likewise."""
    from lockstep_exact.programs.cuda import sampling as kernel

    lp = torch.log_softmax(cuda_rand(6, 700, seed=11, dtype=F32) * 2, dim=-1)
    args = dict(temperature=[0.0, 1.0, 0.7, 1.0, 0.0, 1.3], top_p=1.0, seeds=[9, 8, 7, 6, 5, 4],
                positions=[3, 1, 4, 1, 5, 9])  # fmt: skip
    want = kernel.sample(lp, **args)
    assert torch.equal(kernel.sample(lp, **args, check=False), want)
    bad = lp.clone()
    bad[2, 100] = float("nan")
    bad[4] = float("-inf")
    got = kernel.sample(bad, **args, check=False)
    assert got[2] == -1 and got[4] == -1
    keep = torch.tensor([0, 1, 3, 5], device=got.device)
    assert torch.equal(got[keep], want[keep])
    with pytest.raises(ValueError, match="NaN log-probability"):
        kernel.sample(bad, **args)


def test_the_kernel_record_names_the_form_each_call_ran():
    """``programs.kernels``: a one-row gemm runs the pointer kernel, a 1024-row one of 4096
    columns the TMA-fed persistent kernel (a narrow output keeps the tilings with more
    programs: pick_tiling), and each call's record says so (the forms' bytes are gated above);
    the sampler's one-kernel form and the prefill attention's form are named too."""
    from lockstep_exact.programs import kernels as K
    from lockstep_exact.programs.cuda.gemm import TILINGS, pick_tiling

    w = cuda_rand(4096, 1024, seed=1)
    assert TILINGS[pick_tiling(1024, 4096, 64)].persistent  # the shape below, K steps of 64
    with K.noting() as one:
        P.gemm(cuda_rand(1, 1024, seed=2), w, bk=BK)
    with K.noting() as many:
        P.gemm(cuda_rand(1024, 1024, seed=3), w, bk=BK)
    assert one == {"cuda.gemm", "cuda.gemm:pointer"}
    assert many == {"cuda.gemm", "cuda.gemm:tma"}
    lp = torch.log_softmax(cuda_rand(4, 1000, seed=4, dtype=F32), -1)
    with K.noting() as drawn:
        P.sample(lp, temperature=1.0, top_p=1.0, seeds=[1, 2, 3, 4], positions=[5, 6, 7, 8])
    assert drawn == {"cuda.sample", "cuda.sample:one-kernel"}
    q = cuda_rand(2048, 8, 128, seed=5)
    k = cuda_rand(2048, 2, 128, seed=6)
    with K.noting() as attended:
        P.attention(q, k, k, torch.arange(2048, device="cuda"), block=BLOCK, segment=SEGMENT)
    forms = {n for n in attended if ":" in n}
    assert len(forms) == 1 and forms <= {f"cuda.attention:{f}" for f in K.FORMS["attention"]}
    for name in one | many | drawn | attended:
        assert ":" not in name or K.gate_of(name) is not None


# --- the hybrid lane's paged programs: every sequence of a step in one launch ---------------------
# (position, rows, page) per sequence: decodes at every kind of chunk row (first, middle, the
# one that completes the chunk), a fresh prompt, a fresh one-token prompt, a continuation that
# fills its chunk; pages out of order, some unused.
PAGED_MIXES = {
    "decodes": [(5, 1, 3), (63, 1, 0), (64, 1, 7), (127, 1, 2), (1, 1, 5), (200, 1, 9)],
    "mixed": [(0, 17, 4), (30, 1, 1), (0, 1, 6), (70, 58, 0), (191, 1, 8)],
}


def _paged(heads, dims, chunk, mix, seed):
    inputs, book, (starts, positions, slots) = gdn_paged_case(
        heads, dims, chunk, mix, pages=10, seed=seed
    )
    seqs = P.paged_seqs(starts, positions, slots, chunk=chunk, device="cuda")
    return inputs, book, pages_to(book, "cuda"), seqs, (starts, positions, slots)


@pytest.mark.parametrize("mix", sorted(PAGED_MIXES))
@pytest.mark.parametrize("heads,dims,chunk", [((16, 32), (128, 128), 64), ((2, 4), (5, 7), 8)])
def test_gdn_paged_gives_each_sequence_the_bytes_and_state_of_its_own_call(mix, heads, dims, chunk):
    """gdn_paged in one launch against the definition (each sequence's own gdn_chunked call
    on its page's state, on cpu: the hybrid programs' cuda bytes are the cpu bytes): the
    outputs and every live byte of the advanced pages. One bf16 ulp on one row's v (every
    element) moves that row's sequence's rows and no other's."""
    seqs_ = [s for s in PAGED_MIXES[mix] if s[0] % chunk + s[1] <= chunk]
    (q, k, v, g, beta, *_), book, on_gpu, seqs, (starts, positions, slots) = _paged(
        heads, dims, chunk, seqs_, seed=81
    )
    cpu_seqs = P.paged_seqs(starts, positions, slots, chunk=chunk)
    want = P.gdn_paged(q, k, v, g, beta, book, cpu_seqs, chunk=chunk)
    dev = [t.cuda() for t in (q, k, v, g, beta)]
    got = P.gdn_paged(*dev, on_gpu, seqs, chunk=chunk)
    assert_same_bytes(got.cpu(), want, f"{mix}: outputs")
    after = [p + (starts[r + 1] - starts[r]) for r, p in enumerate(positions)]
    a, b = live_pages(book, slots, after, chunk), live_pages(on_gpu, slots, after, chunk)
    for name in a:
        assert_same_bytes(b[name], a[name], f"{mix}: page {name}")
    # the control: one bf16 ulp up on every element of v's first row of the longest sequence
    r = max(range(len(slots)), key=lambda i: starts[i + 1] - starts[i])
    moved = dev[2].clone()
    moved[starts[r]] = (moved[starts[r]].view(torch.int16) + 1).view(BF16)
    fresh = pages_to(_paged(heads, dims, chunk, seqs_, seed=81)[1], "cuda")
    other = P.gdn_paged(*dev[:2], moved, *dev[3:], fresh, seqs, chunk=chunk)
    lo, hi = starts[r], starts[r + 1]
    assert not same_bytes(other[lo:hi], got[lo:hi]), "the sequence's rows did not move"
    assert same_bytes(other[:lo], got[:lo]) and same_bytes(other[hi:], got[hi:])


@pytest.mark.parametrize("heads,dims,chunk", [((16, 32), (128, 128), 64), ((2, 4), (5, 7), 8)])
def test_a_padded_decode_step_gives_the_live_rows_and_pages_and_padding_writes_nothing(
    heads, dims, chunk
):
    """The two paged launches over a decode step padded as a CUDA graph pads it
    (``paged_decodes``: the table made on the device; padding entries naming an unused page
    and a live one): the live rows and pages are the definition's over the live step, the
    unused page keeps every byte; one live page's state moved moves that row only."""
    from lockstep_exact.testing import padded_decode_case

    decodes = [(5, 3), (chunk - 1, 0), (chunk, 7), (2 * chunk - 1, 2), (1, 5)]
    padded, book, (positions, slots, live), (starts, pos, sl) = padded_decode_case(
        heads, dims, chunk, decodes, [9, 0, 9], seed=83
    )
    q, k, v, g, beta, x, w = padded
    n = len(decodes)
    want_book = pages_to(book, "cpu")
    table = P.paged_seqs(starts, pos, sl, chunk=chunk)
    want_x = P.conv1d_paged(x[:n], w, want_book, table)
    want = P.gdn_paged(q[:n], k[:n], v[:n], g[:n], beta[:n], want_book, table, chunk=chunk)
    on_gpu = pages_to(book, "cuda")
    seqs = P.paged_decodes(positions.cuda(), slots.cuda(), live.cuda(), chunk=chunk)
    got_x = P.conv1d_paged(x.cuda(), w.cuda(), on_gpu, seqs)
    dev = [t.cuda() for t in (q, k, v, g, beta)]
    got = P.gdn_paged(*dev, on_gpu, seqs, chunk=chunk)
    assert_same_bytes(got[:n].cpu(), want, "live rows")
    assert_same_bytes(got_x[:n].cpu(), want_x, "live conv rows")
    after = [p + 1 for p in pos]
    a, b = live_pages(want_book, sl, after, chunk), live_pages(on_gpu, sl, after, chunk)
    for name in a:
        assert_same_bytes(b[name], a[name], f"page {name}")
    for f in book.__dataclass_fields__:
        assert_same_bytes(getattr(on_gpu, f)[9].cpu(), getattr(book, f)[9], f"unused page {f}")
    # control: decode 2's state (page 7, after its first chunk) moved moves its row only
    moved = pages_to(book, "cuda")
    s = moved.s[7]
    s[0] = nudge_ulp(s[0], int(s[0].abs().argmax()), 1 << 20)
    other = P.gdn_paged(*dev, moved, seqs, chunk=chunk)
    assert not same_bytes(other[2:3], got[2:3]), "decode 2's row did not follow its page"
    assert same_bytes(other[:2], got[:2]) and same_bytes(other[3:n], got[3:n])


@pytest.mark.parametrize("heads,dims,chunk", [((16, 32), (128, 128), 64), ((2, 4), (5, 7), 8)])
def test_a_prefill_as_chunk_passes_gives_each_sequences_own_call_bytes(heads, dims, chunk):
    """A step whose sequences cross chunk ends (``paged_passes``: one launch of each paged
    program a pass) against each sequence's own gdn_chunked and conv1d_causal call over all
    its rows, on cpu (``testing.own_calls``): every output byte and what the pages hold
    after. The control: one bf16 ulp on a row of sequence 0's third chunk (every element of
    v) moves its rows from there and no row before them or of another sequence."""
    from lockstep_exact.testing import own_calls

    c = chunk
    mix = [(0, 3 * c + 5, 4), (c // 2, 2 * c, 1), (1, 1, 3), (c + 6, c - 6, 0),
           (2 * c - 3, c + 10, 6)]  # fmt: skip
    inputs, book, (starts, positions, slots) = gdn_paged_case(
        heads, dims, c, mix, pages=10, seed=84
    )
    want, want_x, want_book = own_calls(inputs, book, starts, positions, slots, chunk=c)
    seqs = P.paged_passes(starts, positions, torch.tensor(slots, device="cuda"), chunk=c)
    assert isinstance(seqs, P.PagedPasses) and len(seqs.passes) == 4
    on_gpu = pages_to(book, "cuda")
    q, k, v, g, beta, x, w = (t.cuda() for t in inputs)
    got_x = P.conv1d_paged(x, w, on_gpu, seqs)
    got = P.gdn_paged(q, k, v, g, beta, on_gpu, seqs, chunk=c)
    assert_same_bytes(got.cpu(), want, "outputs")
    assert_same_bytes(got_x.cpu(), want_x, "conv outputs")
    after = [p + starts[r + 1] - starts[r] for r, p in enumerate(positions)]
    a, b = live_pages(want_book, slots, after, c), live_pages(on_gpu, slots, after, c)
    for name in a:
        assert_same_bytes(b[name], a[name], f"page {name}")
    row = 2 * c + 1
    moved = v.clone()
    moved[row] = (moved[row].view(torch.int16) + 1).view(BF16)
    other = P.gdn_paged(q, k, moved, g, beta, pages_to(book, "cuda"), seqs, chunk=c)
    end = starts[1]
    assert not same_bytes(other[row:end], got[row:end]), "the sequence's rows did not move"
    assert same_bytes(other[:row], got[:row]) and same_bytes(other[end:], got[end:])


@pytest.mark.parametrize("mix", sorted(PAGED_MIXES))
@pytest.mark.parametrize("heads,dims,kernel", [((16, 32), (128, 128), 4), ((2, 4), (5, 7), 3)])
def test_conv1d_paged_gives_each_sequence_the_bytes_and_window_of_its_own_call(
    mix, heads, dims, kernel
):
    """conv1d_paged in one launch against each sequence's own conv1d_causal call on its
    page's window (zeros at position 0): outputs and advanced windows, rows shorter and longer
    than the window. One bf16 ulp on one window row (every element) of one sequence moves that
    sequence's rows only."""
    (*_, x, w), book, (starts, positions, slots) = gdn_paged_case(
        heads, dims, 64, PAGED_MIXES[mix], pages=10, kernel=kernel, seed=82
    )
    on_gpu = pages_to(book, "cuda")
    cpu_seqs = P.paged_seqs(starts, positions, slots, chunk=64)
    want = P.conv1d_paged(x, w, book, cpu_seqs, kernel=kernel)
    seqs = P.paged_seqs(starts, positions, slots, chunk=64, device="cuda")
    got = P.conv1d_paged(x.cuda(), w.cuda(), on_gpu, seqs, kernel=kernel)
    assert_same_bytes(got.cpu(), want, f"{mix}: outputs")
    for slot in slots:
        assert_same_bytes(on_gpu.conv[slot].cpu(), book.conv[slot], f"{mix}: window {slot}")
    # the control: one bf16 ulp up on the last window row of the first continuing sequence
    r = next(i for i, p in enumerate(positions) if p > 0)
    again = pages_to(gdn_paged_case(heads, dims, 64, PAGED_MIXES[mix], pages=10, kernel=kernel,
                                    seed=82)[1], "cuda")  # fmt: skip
    row = again.conv[slots[r], kernel - 2]
    again.conv[slots[r], kernel - 2] = (row.view(torch.int16) + 1).view(BF16)
    other = P.conv1d_paged(x.cuda(), w.cuda(), again, seqs, kernel=kernel)
    lo, hi = starts[r], starts[r + 1]
    assert not same_bytes(other[lo:hi], got[lo:hi]), "the sequence's rows did not move"
    assert same_bytes(other[:lo], got[:lo]) and same_bytes(other[hi:], got[hi:])
