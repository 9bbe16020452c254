"""The hybrid lane's programs on the cuda backend: cuda bytes == cpu bytes.

programs.cuda.hybrid runs the cpu backend's device-generic code (programs/cpu/gdn.py, hybrid.py)
on CUDA tensors, so for gdn.chunked, gdn.gating, gdn.l2norm, conv1d.causal,
rmsnorm.zero_centered, rmsnorm.gated, gate.sigmoid and moe.shared_gate the claim is stronger
than for the other cuda programs: the GPU's output bytes are the cpu backend's, for every
shape. rope.partial is the cuda rope's (its own bytes): checked against the cuda rope.
gdn.chunked on cuda also keeps its own invariance: one prefill == the same tokens in pieces
(across the chunk boundary and not) == token-by-token decode, the state carried on the GPU.
Every check has a one-ulp negative control. Run on a CUDA machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import Program
from lockstep_exact.testing import assert_same_bytes, nudge_ulp

# The contract's program parameters (programs.CATALOG), never restated here.
CHUNK = Program.of("gdn.chunked").param("chunk")

pytestmark = pytest.mark.gpu

BF16, F32 = torch.bfloat16, torch.float32
TS = (1, 3, 63, 64, 65, 130)
HEADS = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 8))  # (Hk, Hv): Hv/Hk 1 and 2


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"


def rand(*shape, seed=0, scale=1.0, dtype=BF16):
    """cpu inputs (a cpu generator: the same values on every machine of one torch version)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def specials(n: int, dtype=BF16) -> torch.Tensor:
    """Values that exercise the programs' edges: zeros of both signs, infinities, NaN, huge,
    subnormal (bf16) and ordinary numbers, repeated to length n."""
    base = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 1e-39, -1e-39,
         88.7, -104.0, 1.0, -1.0, 0.5, 20.0, -20.0],
        dtype=F32,
    )  # fmt: skip
    return base.repeat(n // len(base) + 1)[:n].to(dtype)


def largest(t: torch.Tensor) -> int:
    """The flat index of t's finite element of largest magnitude."""
    a = t.detach().float().abs().reshape(-1)
    return int(torch.where(torch.isfinite(a), a, torch.zeros_like(a)).argmax())


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, P.GdnState):
        return [out.s, out.k, out.v, out.g, out.beta]
    return [t for o in out for t in _flat(o)]


def _on(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, P.GdnState):
        return P.GdnState(x.chunk, x.start, *(t.to(dev) for t in _flat(x)))
    return x


def nan_canonical(t: torch.Tensor) -> torch.Tensor:
    """fp32/fp64 outputs with every NaN replaced by one pattern. The programs pin the NaN of
    their bf16 outputs (round_bf16 writes 0x7FC0); the payload of a NaN inside an fp32
    intermediate (gdn.gating's g and beta, a state, a tree_sum) is the hardware's: the first
    GPU run saw CPU and GPU propagate NaN payloads differently (the H200, 2026-12-01)."""
    if t.dtype in (F32, torch.float64):
        return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t


def assert_cuda_is_cpu(fn, args, dev, what, *, nudge=None):
    """fn on ``dev`` copies of ``args`` has the bytes of fn on the cpu args (every output,
    states included, each on ``dev``). ``nudge``: the index of the argument to move by one ulp
    for the negative control (its element of largest magnitude): the same check then fails.
    Returns the cpu output."""
    ref = fn(*args)
    got = fn(*(_on(a, dev) for a in args))
    refs, gots = _flat(ref), _flat(got)
    assert len(refs) == len(gots)
    for i, (r, g) in enumerate(zip(refs, gots, strict=True)):
        assert g.device.type == torch.device(dev).type, f"{what}: output {i} on {g.device}"
        assert_same_bytes(
            nan_canonical(g.cpu()), nan_canonical(r), f"{what}: output {i}, {dev} vs cpu"
        )
    if nudge is not None:
        moved = list(args)
        moved[nudge] = nudge_ulp(args[nudge], largest(args[nudge]))
        got2 = fn(*(_on(a, dev) for a in moved))
        assert not all(same_bytes(g.cpu(), r) for g, r in zip(_flat(got2), refs, strict=True)), (
            f"{what}: a one-ulp change of input {nudge} left every output byte unchanged"
        )
    return ref


# --- the arithmetic under every program: where a difference would start ---------------------
def test_the_cpu_arith_helpers_give_the_cpu_bytes_on_cuda(dev):
    """exp, log (fp32, fp64), the bit-trick bf16 rounding, tree_sum, silu, sigmoid and softplus
    of the cpu backend, run on CUDA tensors, over a million random fp32 bit patterns (NaNs,
    infinities, subnormals included) and the edge values: the cpu bytes."""
    from lockstep_exact.programs.cpu import activation, arith, gdn

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(F32), specials(64, F32), rand(4096, dtype=F32)])
    pos = x.abs()
    x64 = torch.cat([x.double() * 3.0, torch.linspace(-745.0, 709.0, 4097, dtype=torch.float64)])
    cases = {
        "exp fp32": (arith.exp, x),
        "exp fp64": (arith.exp, x64),
        "log fp32": (arith.log, pos),
        "log fp64": (arith.log, x64.abs()),
        "round_bf16 (bit trick)": (arith.round_bf16, x),
        "tree_sum": (lambda t: arith.tree_sum(t.view(-1, 97)), x[: 97 * 10000]),
        "silu": (activation.silu, x),
        "sigmoid": (gdn.sigmoid, x),
        "softplus": (gdn.softplus, x),
    }
    for what, (fn, t) in cases.items():
        assert_cuda_is_cpu(fn, (t,), dev, what)


# --- gdn.chunked ----------------------------------------------------------------------------
def gdn_inputs(t, h_k, h_v, d_k, d_v, seed=0):
    """cpu q, k (l2-normalized fp32), v bf16, g, beta fp32 as the lane makes them."""
    q = P.l2norm(rand(t, h_k, d_k, seed=seed))
    k = P.l2norm(rand(t, h_k, d_k, seed=seed + 1))
    v = rand(t, h_v, d_v, seed=seed + 2)
    a_log = (torch.rand(h_v, generator=torch.Generator().manual_seed(seed + 3)) + 0.01).log()
    g, beta = P.gdn_gating(
        rand(t, h_v, seed=seed + 4), rand(t, h_v, seed=seed + 5), a_log, rand(h_v, seed=seed + 6)
    )
    return q, k, v, g, beta


def gdn_call(q, k, v, g, beta, state, *, position=0):
    return P.gdn_chunked(q, k, v, g, beta, state, position=position, chunk=CHUNK)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hk{h[0]}_hv{h[1]}")
@pytest.mark.parametrize("t", TS)
def test_gdn_chunked_cuda_bytes_are_the_cpu_bytes(dev, t, heads):
    hk, hv = heads
    q, k, v, g, beta = gdn_inputs(t, hk, hv, 16, 16, seed=t)
    state = P.gdn_state(hk, hv, 16, 16, chunk=CHUNK)
    what = f"gdn.chunked t={t} hk={hk} hv={hv} K=V=16"
    assert_cuda_is_cpu(gdn_call, (q, k, v, g, beta, state), dev, what, nudge=2)


@pytest.mark.parametrize("heads", ((1, 2), (2, 4)), ids=lambda h: f"hk{h[0]}_hv{h[1]}")
@pytest.mark.parametrize("t", (1, 65, 130))
def test_gdn_chunked_cuda_bytes_are_the_cpu_bytes_at_k_v_128(dev, t, heads):
    hk, hv = heads
    q, k, v, g, beta = gdn_inputs(t, hk, hv, 128, 128, seed=t + 7)
    state = P.gdn_state(hk, hv, 128, 128, chunk=CHUNK)
    what = f"gdn.chunked t={t} hk={hk} hv={hv} K=V=128"
    assert_cuda_is_cpu(gdn_call, (q, k, v, g, beta, state), dev, what, nudge=2)


def test_gdn_chunked_from_a_mid_chunk_state_cuda_is_cpu(dev):
    """A call continuing a state that holds cached tokens (position 70: chunk start 64)."""
    q, k, v, g, beta = gdn_inputs(100, 2, 4, 16, 16, seed=5)
    _, state = gdn_call(
        q[:70], k[:70], v[:70], g[:70], beta[:70], P.gdn_state(2, 4, 16, 16, chunk=CHUNK)
    )
    assert state.start == 64 and state.k.shape[0] == 6
    args = (q[70:], k[70:], v[70:], g[70:], beta[70:], state)
    fn = lambda *a: gdn_call(*a, position=70)  # noqa: E731
    assert_cuda_is_cpu(fn, args, dev, "gdn.chunked from position 70", nudge=2)


def _run_calls(q, k, v, g, beta, cuts, dev):
    """gdn.chunked over a sequence split into calls at ``cuts``, on ``dev`` with the state
    carried there: (outputs, final state)."""
    q, k, v, g, beta = (x.to(dev) for x in (q, k, v, g, beta))
    state = P.gdn_state(k.shape[1], v.shape[1], k.shape[2], v.shape[2], device=dev, chunk=CHUNK)
    outs, bounds = [], [0, *cuts, q.shape[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out, state = P.gdn_chunked(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, position=lo, chunk=CHUNK
        )
        assert all(x.device.type == torch.device(dev).type for x in _flat(state))
        outs.append(out)
    return torch.cat(outs), state


def test_gdn_chunked_on_cuda_prefill_pieces_and_decode_are_one_byte_program(dev):
    t = 130
    q, k, v, g, beta = gdn_inputs(t, 2, 4, 32, 16, seed=11)
    prefill, state = _run_calls(q, k, v, g, beta, [], dev)
    splits = {
        "aligned to the chunk boundaries": [64, 128],
        "crossing the chunk boundaries": [30, 70, 100],
        "inside one chunk": [5, 7, 40],
        "token by token (decode)": list(range(1, t)),
    }
    for what, cuts in splits.items():
        out, st = _run_calls(q, k, v, g, beta, cuts, dev)
        assert_same_bytes(out.cpu(), prefill.cpu(), f"gdn.chunked on {dev}: {what} vs prefill")
        assert (st.start, st.chunk) == (state.start, state.chunk)
        for a, b in zip(_flat(st), _flat(state), strict=True):
            assert_same_bytes(a.cpu(), b.cpu(), f"gdn.chunked on {dev}: {what}: the state")
    # ... and the cpu backend's bytes.
    cpu_out, cpu_state = _run_calls(q, k, v, g, beta, [], "cpu")
    assert_same_bytes(prefill.cpu(), cpu_out, f"gdn.chunked prefill on {dev} vs cpu")
    assert_same_bytes(state.s.cpu(), cpu_state.s, f"gdn.chunked state on {dev} vs cpu")
    # Negative control: one ulp on token 3's v moves the decode's bytes.
    nudged, _ = _run_calls(q, k, nudge_ulp(v, 3 * 4 * 16), g, beta, list(range(1, t)), dev)
    assert not same_bytes(nudged.cpu(), prefill.cpu())


def test_a_cpu_state_with_cuda_tokens_is_refused_naming_both_devices(dev):
    q, k, v, g, beta = (x.to(dev) for x in gdn_inputs(3, 1, 2, 16, 16))
    with pytest.raises(ValueError, match=r"one device.*'cpu'.*'cuda'"):
        P.gdn_chunked(
            q, k, v, g, beta, P.gdn_state(1, 2, 16, 16, chunk=CHUNK), position=0, chunk=CHUNK
        )
    from lockstep_exact.programs import cuda

    with pytest.raises(ValueError, match="expected a CUDA device"):
        cuda.gdn_gating(*(torch.zeros(2, 2, dtype=BF16) for _ in range(2)), *(
            torch.zeros(2) for _ in range(2)))  # fmt: skip


# --- the elementwise and row programs -------------------------------------------------------
@pytest.mark.parametrize("t", (1, 3, 65, 130))
@pytest.mark.parametrize("hv", (1, 2, 4, 32))
def test_gdn_gating_cuda_is_cpu(dev, t, hv):
    a, b = rand(t, hv, seed=1, scale=4.0), rand(t, hv, seed=2, scale=4.0)
    a_log, dt_bias = rand(hv, seed=3, dtype=F32), rand(hv, seed=4)
    assert_cuda_is_cpu(P.gdn_gating, (a, b, a_log, dt_bias), dev, f"gdn.gating t={t}", nudge=0)


def test_gdn_gating_edges_cuda_is_cpu(dev):
    a, b = specials(64), specials(64).flip(0)
    a, b = a.view(16, 4), b.view(16, 4)
    assert_cuda_is_cpu(
        P.gdn_gating, (a, b, rand(4, seed=5, dtype=F32), rand(4, seed=6)), dev, "gdn.gating edges"
    )


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 128), (130, 4, 128), (65, 1, 33)])
def test_l2norm_cuda_is_cpu(dev, shape):
    x = rand(*shape, seed=7, scale=2.0)
    assert_cuda_is_cpu(P.l2norm, (x,), dev, f"gdn.l2norm {shape}", nudge=0)


@pytest.mark.parametrize("kernel", (4, 3))
@pytest.mark.parametrize("d", (1, 7, 97, 255))
@pytest.mark.parametrize("t", TS)
def test_conv1d_causal_cuda_is_cpu(dev, t, d, kernel):
    x, w = rand(t, d, seed=8), rand(d, kernel, seed=9, scale=0.5)
    window = rand(kernel - 1, d, seed=10)
    fn = lambda *a: P.conv1d_causal(*a, kernel=kernel)  # noqa: E731
    assert_cuda_is_cpu(fn, (x, w, window), dev, f"conv1d.causal t={t} d={d}", nudge=0)
    fresh = (x, w, P.conv1d_window(d, kernel=kernel))
    assert_cuda_is_cpu(fn, fresh, dev, f"conv1d.causal t={t} d={d} at position 0")


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (130, 96), (65, 2048), (9, 4, 64)])
def test_rmsnorm_zero_centered_cuda_is_cpu(dev, shape):
    x, w = rand(*shape, seed=11, scale=3.0), rand(shape[-1], seed=12, scale=0.1)
    fn = lambda a, b: P.rmsnorm_zero_centered(a, b, 1e-6)  # noqa: E731
    # (a row of one element normalizes to +-1 whatever its last bit: no control there)
    nudge = 0 if shape[-1] > 1 else None
    assert_cuda_is_cpu(fn, (x, w), dev, f"rmsnorm.zero_centered {shape}", nudge=nudge)


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 2, 128), (130, 4, 128), (65, 32, 128)])
def test_rmsnorm_gated_cuda_is_cpu(dev, shape):
    x, z = rand(*shape, seed=13), rand(*shape, seed=14, scale=2.0)
    w = rand(shape[-1], seed=15, scale=0.1) + 1
    fn = lambda a, b, c: P.rmsnorm_gated(a, b, c, 1e-6)  # noqa: E731
    assert_cuda_is_cpu(fn, (x, z, w), dev, f"rmsnorm.gated {shape}", nudge=1)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (130, 4096)])
def test_sigmoid_gate_cuda_is_cpu(dev, shape):
    x, gate = rand(*shape, seed=16), rand(*shape, seed=17, scale=3.0)
    assert_cuda_is_cpu(P.sigmoid_gate, (x, gate), dev, f"gate.sigmoid {shape}", nudge=0)
    x, gate = specials(64).view(8, 8), specials(64).flip(0).view(8, 8)
    assert_cuda_is_cpu(P.sigmoid_gate, (x, gate), dev, "gate.sigmoid edges")


@pytest.mark.parametrize("t,h", [(1, 1), (3, 17), (130, 2048)])
def test_shared_expert_gate_cuda_is_cpu(dev, t, h):
    args = (rand(t, h, seed=18), rand(t, h, seed=19), rand(t, 1, seed=20, scale=2.0))
    assert_cuda_is_cpu(P.shared_expert_gate, args, dev, f"moe.shared_gate {t}x{h}", nudge=0)


def test_hybrid_golden_cases_have_the_cpu_hashes_on_cuda(dev):
    """The contract lock's golden cases: the device-generic programs' cuda hashes are the cpu
    hashes (so ``contract_lock.py --backend cuda --update`` pins the same values)."""
    from lockstep_exact.golden import case_hashes

    cpu, cuda = case_hashes("cpu"), case_hashes(dev)
    generic = (
        "gdn.chunked", "gdn.gating", "gdn.l2norm", "conv1d.causal", "rmsnorm.zero_centered",
        "rmsnorm.gated", "gate.sigmoid", "moe.shared_gate",
    )  # fmt: skip
    for name in generic:
        assert cuda[name] == cpu[name], name
    assert set(cuda["rope.partial"]) == set(cpu["rope.partial"])


# --- rope.partial: the cuda rope on the rotary dims -----------------------------------------
@pytest.mark.parametrize("t,h,d,rotary", [(1, 1, 16, 4), (3, 2, 32, 8), (130, 4, 256, 64)])
def test_rope_partial_on_cuda_is_the_cuda_rope_on_its_rotary_dims(dev, t, h, d, rotary):
    x = rand(t, h, d, seed=21).to(dev)
    pos = torch.randint(0, 5000, (t,), generator=torch.Generator().manual_seed(22)).to(dev)
    out = P.rope_partial(x, pos, 1e6, rotary)
    assert out.device.type == "cuda" and out.dtype == BF16 and out.shape == x.shape
    rot = P.rope(x[..., :rotary].contiguous(), pos, 1e6)
    assert_same_bytes(out[..., :rotary].cpu(), rot.cpu(), "rope.partial: the rotated dims")
    assert_same_bytes(out[..., rotary:].cpu(), x[..., rotary:].cpu(), "rope.partial: the rest")
    with P.position_bound(8192):
        assert_same_bytes(P.rope_partial(x, pos, 1e6, rotary).cpu(), out.cpu(), "under a bound")
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(1)).to(dev)
    shuffled = P.rope_partial(x[perm], pos[perm], 1e6, rotary)
    assert_same_bytes(shuffled.cpu(), out[perm].cpu(), "rope.partial: rows permuted")
    # Negative control: one ulp of every rotated input of the first row moves the output (one
    # element alone can be absorbed by the bf16 rounding of x*cos - y*sin: the first GPU run).
    moved = x.clone()
    for j in range(rotary):
        moved = nudge_ulp(moved, j)
    assert not same_bytes(P.rope_partial(moved, pos, 1e6, rotary)[..., :rotary].cpu(), rot.cpu())


# --- the lane composition on cuda: caches on the GPU ------------------------------------------
ODD = {
    "hidden": 96, "layers": 4, "heads": 4, "kv_heads": 1, "head_dim": 16, "experts": 4,
    "topk": 3, "moe_intermediate": 40, "vocab": 1024, "tie_embeddings": True,
}  # fmt: skip


@pytest.fixture(scope="module", params=["default", "odd"])
def lane_on(request, dev, tmp_path_factory):
    """(geometry with chunk 16, HF weights on ``dev``) of a tiny qwen3-next."""
    import dataclasses

    from safetensors.torch import load_file

    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.model import ModelDir

    kw = ODD if request.param == "odd" else {}
    d = make_tiny(tmp_path_factory.mktemp(f"next-{request.param}") / "m", arch="qwen3-next", **kw)
    geom = dataclasses.replace(ModelDir(d, hybrid=True).geometry, chunk=16)
    weights = {k: v.to(dev) for k, v in load_file(str(d / "model.safetensors")).items()}
    return geom, weights


def test_the_next_lane_on_cuda_prefill_equals_split_calls_and_decode(dev, lane_on):
    from lockstep_exact.lanes import qwen3_next as N

    geom, w = lane_on
    toks = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(1)).to(dev)
    full = N.forward_logprobs(w, geom, toks)
    assert full.device.type == torch.device(dev).type

    def run_calls(weights, cuts):
        cache, ops, rows, lo = N.NextCache.empty(geom, dev), N.default_ops(geom, dev), [], 0
        for hi in cuts:
            rows.append(N.forward_logprobs(weights, geom, toks[lo:hi], cache, ops=ops))
            lo = hi
        states = [t for st in cache.gdn.values() for t in _flat(st)] + list(cache.conv.values())
        assert {t.device.type for t in states} == {torch.device(dev).type}
        return torch.cat(rows).cpu()

    ref = full.cpu()
    assert_same_bytes(run_calls(w, [5, 21, 37, 40]), ref, "calls crossing the chunk starts")
    assert_same_bytes(run_calls(w, [16, 32, 40]), ref, "calls on the chunk starts")
    assert_same_bytes(run_calls(w, [13, *range(14, 41)]), ref, "prefill 13, then decode")
    # control: one GDN projection weight one ulp off moves the decode's bytes
    name = f"model.layers.{geom.layer_types.index(N.LINEAR)}.linear_attn.in_proj_qkvz.weight"
    w2 = {**w, name: nudge_ulp(w[name], 7)}
    assert not same_bytes(run_calls(w2, [13, *range(14, 41)]), ref)


def test_the_next_lane_on_cuda_a_sequence_alone_equals_it_in_a_batch(dev, lane_on):
    from lockstep_exact.lanes import qwen3_next as N

    geom, w = lane_on
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1024, (n,), generator=gen).to(dev) for n in (40, 23, 9)]
    alone = torch.cat([N.forward_logprobs(w, geom, t) for t in seqs]).cpu()
    caches = [N.NextCache.empty(geom, dev) for _ in seqs]
    ops, slots = N.default_ops(geom, dev), N.DictSlots(w, geom)
    out = N.forward(ops, geom, slots, list(zip(seqs, caches, strict=True)))
    assert_same_bytes(out.cpu(), alone, "three prefills in one cuda step")
    assert ops.invoked_contract().backend == "cuda" or dev == "cpu"
