"""The hybrid lane's backward (issue 16): ``NextOps(grad=True)`` runs each Qwen3-Next program
forward with its own bytes and differentiates its ideal op (``programs.vjp``).

For every program: the forward under grad has the bytes of the forward without it (a one-ulp
change is caught); the ideal op is the function the program computes (float64, within bf16 /
fp32 error); the VJP the trainer gets agrees with float64 autograd of the ideal op, and the
ideal op passes torch's gradcheck. gdn.chunked is checked across chunk boundaries, from a
starting state (its S and cached tokens differentiated too), for its state' and through a
forward split over two calls. Last, a whole tiny composition under grad: its log-probabilities
keep their bytes and the gradient w.r.t. a GDN projection weight repeats byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import tiny_config
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import geometry_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import vjp as V
from lockstep_exact.testing import assert_same_bytes, nudge_ulp

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
CHUNK = 4
GEOM = N.Geometry.from_hf_config(tiny_config("qwen3-next"), chunk=CHUNK)
G, A = "layers.0.linear_attn", "layers.1.self_attn"


def ops(grad: bool) -> N.NextOps:
    return N.NextOps(geometry_contract(GEOM), grad=grad)


def rand(*shape, seed=0, scale=1.0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def leaves(xs, wanted):
    return [
        x.detach().clone().requires_grad_(w) if isinstance(x, torch.Tensor) else x
        for x, w in zip(xs, wanted, strict=True)
    ]


def check_vjp(call, ideal, xs, *, rtol, what, wanted=None, cot_seed=7):
    """``call`` (a NextOps method on xs) under grad: its forward bytes equal the no-grad call's
    (with a one-ulp input control), and the gradient w.r.t. every wanted input agrees with float64
    autograd of ``ideal`` at the same inputs, within ``rtol`` of the largest gradient entry
    plus ``rtol`` of the entry itself (1e-2 at least for a bf16 input, whose gradient is
    bf16)."""
    wanted = wanted or [x.is_floating_point() for x in xs]
    plain = call(ops(False), *xs)
    xg = leaves(xs, wanted)
    out = call(ops(True), *xg)
    assert out.requires_grad, what
    assert_same_bytes(out.detach(), plain, f"{what}: forward under grad")
    # input control: one input's largest element one ulp off, under grad (the first wanted
    # bf16 input, else the first wanted one: an fp32 input's ulp may round away in a bf16 out)
    moving = [j for j, x in enumerate(xs) if wanted[j]]
    i = next((j for j in moving if xs[j].dtype == BF16), moving[0])
    moved = list(xs)
    moved[i] = nudge_ulp(xs[i], int(xs[i].float().argmax()))
    out2 = call(ops(True), *leaves(moved, wanted))
    assert not same_bytes(out2.detach(), plain), f"{what}: one-ulp input control"
    cot = rand(*out.shape, seed=cot_seed, dtype=F32).to(out.dtype)
    got = torch.autograd.grad(out, [x for x, w in zip(xg, wanted, strict=True) if w], cot)
    x64 = [
        x.detach().to(F64).requires_grad_(w) if isinstance(x, torch.Tensor) else x
        for x, w in zip(xs, wanted, strict=True)
    ]
    ref = torch.autograd.grad(
        ideal(*x64), [x for x, w in zip(x64, wanted, strict=True) if w], cot.to(F64)
    )
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.dtype == [x for x, w in zip(xs, wanted, strict=True) if w][i].dtype
        err = (g.to(F64) - r).abs()
        tol = max(rtol, 1e-2) if g.dtype == BF16 else rtol  # a bf16 input's gradient is bf16
        bound = tol * (r.abs() + r.abs().max())
        assert bool((err <= bound).all()), (
            f"{what}: input {i}: VJP off by {float(err.max()):.3g} (bound {float(bound.max()):.3g})"
        )
    return out


def check_ideal_is_the_program(ideal, program_out, xs, *, rtol, what):
    """The float64 ideal op computes what the program computes (within rounding)."""
    with torch.no_grad():
        want = ideal(*[x.to(F64) if isinstance(x, torch.Tensor) else x for x in xs])
    err = (program_out.to(F64) - want).abs()
    assert float(err.max()) <= rtol * float(want.abs().max()), (
        f"{what}: the ideal op is {float(err.max()):.3g} from the program"
    )


def gradcheck(ideal, xs, wanted=None):
    """torch.autograd.gradcheck of the ideal op in float64 (small inputs)."""
    wanted = wanted or [x.is_floating_point() for x in xs]
    x64 = [x.detach().to(F64).requires_grad_(w) for x, w in zip(xs, wanted, strict=True)]
    assert torch.autograd.gradcheck(ideal, x64, eps=1e-6, atol=1e-5, rtol=1e-4)


# --- the row-wise programs ---------------------------------------------------------------------
def test_rmsnorm_zero_centered_vjp():
    xs = [rand(6, 128, seed=1), rand(128, seed=2, scale=0.1)]
    ideal = V.rmsnorm_zero_centered(GEOM.eps)
    out = check_vjp(
        lambda o, x, w: o.rmsnorm_zc("layers.0.input_layernorm", x, w),
        ideal,
        xs,
        rtol=2e-2,
        what="rmsnorm.zero_centered",
    )
    check_ideal_is_the_program(ideal, out.detach(), xs, rtol=1e-2, what="rmsnorm.zero_centered")
    gradcheck(ideal, [xs[0][:2, :8], xs[1][:8]])


def test_rmsnorm_gated_vjp():
    xs = [rand(5, 4, 16, seed=3), rand(5, 4, 16, seed=4), rand(16, seed=5)]
    ideal = V.rmsnorm_gated(GEOM.eps)
    out = check_vjp(
        lambda o, x, z, w: o.rmsnorm_gated(f"{G}.norm", x, z, w),
        ideal,
        xs,
        rtol=2e-2,
        what="rmsnorm.gated",
    )
    check_ideal_is_the_program(ideal, out.detach(), xs, rtol=1e-2, what="rmsnorm.gated")
    gradcheck(ideal, [x[..., :6] if x.dim() > 1 else x[:6] for x in xs])


def test_sigmoid_gate_and_shared_gate_vjps():
    xs = [rand(5, 64, seed=6), rand(5, 64, seed=7)]
    out = check_vjp(
        lambda o, x, g: o.sigmoid_gate(f"{A}.gate", x, g),
        V.sigmoid_gate,
        xs,
        rtol=2e-2,
        what="gate.sigmoid",
    )
    check_ideal_is_the_program(V.sigmoid_gate, out.detach(), xs, rtol=1e-2, what="gate.sigmoid")
    gradcheck(V.sigmoid_gate, [x[:2, :4] for x in xs])
    ys = [rand(5, 128, seed=8), rand(5, 128, seed=9), rand(5, 1, seed=10)]
    out = check_vjp(
        lambda o, r, s, lg: o.shared_gate("layers.0.mlp.shared_gate", r, s, lg),
        V.shared_gate,
        ys,
        rtol=2e-2,
        what="moe.shared_gate",
    )
    check_ideal_is_the_program(V.shared_gate, out.detach(), ys, rtol=1e-2, what="moe.shared_gate")
    gradcheck(V.shared_gate, [ys[0][:2, :4], ys[1][:2, :4], ys[2][:2]])


def test_rope_partial_vjp():
    pos = torch.arange(3, 9)
    xs = [rand(6, GEOM.heads, GEOM.head_dim, seed=11)]
    ideal = V.rope_partial(pos, GEOM.rope_theta, GEOM.rotary_dim)
    out = check_vjp(
        lambda o, x: o.rope_partial(f"{A}.q_rope", x, pos), ideal, xs, rtol=2e-2, what="rope"
    )
    check_ideal_is_the_program(ideal, out.detach(), xs, rtol=1e-2, what="rope.partial")
    # The part past rotary_dim is copied, so its gradient is the cotangent itself.
    gradcheck(ideal, [xs[0][:, :1]])


def test_l2norm_and_gating_vjps():
    xs = [rand(7, 2, 32, seed=12)]
    ideal = V.l2norm(N.L2NORM_EPS)
    out = check_vjp(lambda o, x: o.l2norm(f"{G}.q_l2norm", x), ideal, xs, rtol=2e-2, what="l2")
    check_ideal_is_the_program(ideal, out.detach(), xs, rtol=1e-6, what="gdn.l2norm")
    gradcheck(ideal, [xs[0][:2, :1, :6]])
    hv = 4
    gx = [
        rand(7, hv, seed=13),
        rand(7, hv, seed=14),
        rand(hv, seed=15, dtype=F32),
        rand(hv, seed=16),
    ]
    for which, ideal, idx in (("g", V.gdn_decay, (0, 2, 3)), ("beta", V.gdn_beta, (1,))):
        pick = 0 if which == "g" else 1

        def call(o, a, b, a_log, dt, pick=pick):
            return o.gating(f"{G}.gating", a, b, a_log, dt)[pick]

        def ideal_of_all(a, b, a_log, dt, ideal=ideal, idx=idx):
            return ideal(*[(a, b, a_log, dt)[i] for i in idx])

        wanted = [i in idx for i in range(4)]
        out = check_vjp(
            call, ideal_of_all, gx, rtol=2e-2, wanted=wanted, what=f"gdn.gating {which}"
        )
        check_ideal_is_the_program(ideal_of_all, out.detach(), gx, rtol=1e-6, what=which)
        gradcheck(ideal, [gx[i] for i in idx])


def test_conv1d_vjp_and_its_window_carries_gradient_across_calls():
    d, w = 12, GEOM.conv_kernel
    xs = [rand(9, d, seed=17), rand(d, w, seed=18, scale=0.5), rand(w - 1, d, seed=19)]
    ideal = V.conv1d_causal(w)

    def call(o, x, wt, win):
        return o.conv1d(f"{G}.conv1d", x, wt, win)[0]

    out = check_vjp(call, ideal, xs, rtol=2e-2, what="conv1d.causal")
    check_ideal_is_the_program(ideal, out.detach(), xs, rtol=1e-2, what="conv1d.causal")
    gradcheck(ideal, [xs[0][:3, :2], xs[1][:2], xs[2][:, :2]])
    # Two calls (5 + 4 rows, the window between them) = one call: bytes and gradient.
    xg = leaves(xs, [True, True, False])
    o = ops(True)
    y1, win = o.conv1d(f"{G}.conv1d", xg[0][:5], xg[1], xg[2])
    y2, _ = o.conv1d(f"{G}.conv1d", xg[0][5:], xg[1], win)
    assert win.requires_grad
    split = torch.cat([y1, y2])
    assert_same_bytes(split.detach(), out.detach(), "conv1d: two calls")
    cot = rand(*split.shape, seed=20, dtype=F32).to(BF16)
    gs = torch.autograd.grad(split, xg[:2], cot)
    xo = leaves(xs, [True, True, False])
    go = torch.autograd.grad(call(ops(True), *xo), xo[:2], cot)
    for a, b in zip(gs, go, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.abs().max()))


# --- gdn.chunked ------------------------------------------------------------------------------
def gdn_inputs(t, seed, h_k=2, h_v=4, d_k=32, d_v=16):
    q = P.l2norm(rand(t, h_k, d_k, seed=seed))
    k = P.l2norm(rand(t, h_k, d_k, seed=seed + 1))
    v = rand(t, h_v, d_v, seed=seed + 2)
    a_log = rand(h_v, seed=seed + 3, dtype=F32) * 0.5 - 1.0
    g, beta = P.gdn_gating(rand(t, h_v, seed=seed + 4), rand(t, h_v, seed=seed + 5), a_log,
                           rand(h_v, seed=seed + 6))  # fmt: skip
    return [q, k, v, g, beta]


def state_after(n, seed):
    """The GdnState after ``n`` tokens (chunk 4): at the start of n's chunk, n % 4 cached."""
    st = P.gdn_state(2, 4, 32, 16, chunk=CHUNK)
    _, st = P.gdn_chunked(*gdn_inputs(n, seed), st, position=0, chunk=CHUNK)
    return st


def state_tensors(st):
    return [st.s, st.k, st.v, st.g, st.beta]


def as_state(st, s, k, v, g, beta):
    return P.GdnState(chunk=st.chunk, start=st.start, s=s, k=k, v=v, g=g, beta=beta)


@pytest.mark.parametrize("before,n", [(0, 3), (0, 11), (6, 7), (4, 4)])
def test_gdn_chunked_vjp_across_chunks_and_from_a_starting_state(before, n):
    """Chunk 4: 3 tokens in one chunk; 11 across two boundaries; from position 6 (S at 4 and
    two cached tokens), 7 tokens across 8 and 12; from 4 (no cached token), one whole chunk.
    The starting state's S and cached tokens are differentiated too (where there are any)."""
    st = state_after(before, seed=30)
    xs = gdn_inputs(n, seed=40) + state_tensors(st)
    wanted = [True] * 5 + [before > 0] + [before % CHUNK > 0] * 4

    def call(o, q, k, v, g, beta, *s):
        return o.gdn(f"{G}.core", q, k, v, g, beta, as_state(st, *s), before)[0]

    out = check_vjp(call, V.gdn_chunked, xs, rtol=1e-3, wanted=wanted, what=f"gdn {before}+{n}")
    check_ideal_is_the_program(V.gdn_chunked, out.detach(), xs, rtol=1e-2, what="gdn.chunked")


def test_gdn_chunked_ideal_passes_gradcheck_from_a_starting_state():
    st = state_after(6, seed=31)
    small = [x[..., :3] if x.dim() == 3 else x for x in gdn_inputs(5, seed=41, d_k=3, d_v=3)]
    sts = [st.s[:, :3, :3], st.k[..., :3], st.v[..., :3], st.g, st.beta]
    xs = [x.to(F64) for x in small + sts]
    gradcheck(V.gdn_chunked, xs)
    gradcheck(V.gdn_state(2 + 4), xs)


def test_gdn_state_vjp_and_a_split_forward_has_the_one_call_gradient():
    """state' S after a call is differentiable (its VJP agrees with float64 autograd of the
    delta rule), so a forward split 6 + 7 over two calls has the one call's bytes and, within
    fp32 error, its gradient."""
    xs = gdn_inputs(13, seed=50)
    st0 = P.gdn_state(2, 4, 32, 16, chunk=CHUNK)
    xg = leaves(xs, [True] * 5)
    o = ops(True)
    _, st = o.gdn(f"{G}.core", *[x[:6] for x in xg], st0, 0)
    assert st.start == 4 and st.s.requires_grad and st.k.requires_grad
    cot = rand(*st.s.shape, seed=51, dtype=F32)
    got = torch.autograd.grad(st.s, xg, cot, allow_unused=True)
    x64 = [x[:6].detach().to(F64).requires_grad_(True) for x in xs]
    zeros = [t.to(F64) for t in state_tensors(st0)]
    ref = torch.autograd.grad(V.gdn_state(4)(*x64, *zeros), x64, cot.to(F64), allow_unused=True)
    assert got[0] is None and ref[0] is None  # S reads no query
    for g, r in zip(got[1:], ref[1:], strict=True):
        r6 = r[:6]
        err = (g[:6].to(F64) - r6).abs()
        tol = 1e-2 if g.dtype == BF16 else 1e-3
        assert float(err.max()) <= tol * float(r6.abs().max()) + 1e-12
    # Two calls against one: the same output bytes, the same gradient within fp32 error.
    xa, xb = leaves(xs, [True] * 5), leaves(xs, [True] * 5)
    y1, st = o.gdn(f"{G}.core", *[x[:6] for x in xa], st0, 0)
    y2, _ = o.gdn(f"{G}.core", *[x[6:] for x in xa], st, 6)
    one, _ = o.gdn(f"{G}.core", *xb, st0, 0)
    split = torch.cat([y1, y2])
    assert_same_bytes(split.detach(), one.detach(), "gdn: two calls")
    # input control: a cache entry the second call reads, the largest value of the first
    # call's cached tokens (positions 4, 5), one bf16 ulp up, moves the second call's bytes.
    # (One fp32 ulp of S rounds away in the bf16 output.)
    v_moved = nudge_ulp(st.v.detach(), int(st.v.detach().float().abs().argmax()))
    cached = as_state(st, st.s.detach(), st.k.detach(), v_moved, st.g.detach(), st.beta.detach())
    y2m, _ = o.gdn(f"{G}.core", *[x[6:].detach() for x in xa], cached, 6)
    assert not same_bytes(y2m.detach(), y2.detach())
    c = rand(*one.shape, seed=52, dtype=F32).to(BF16)
    ga = torch.autograd.grad(split, xa, c)
    gb = torch.autograd.grad(one, xb, c)
    for name, a, b in zip("qkvgb", ga, gb, strict=True):
        err = (a.float() - b.float()).abs().max()
        tol = (1e-2 if a.dtype == BF16 else 1e-4) * float(b.float().abs().max())
        assert float(err) <= tol, f"gdn split: d{name} off by {float(err):.3g}"


# --- the composition --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    from safetensors.torch import load_file

    from lockstep_exact.app.tiny import make_tiny

    d = make_tiny(tmp_path_factory.mktemp("next-vjp") / "m", arch="qwen3-next")
    return load_file(str(d / "model.safetensors"))


def composition_grad(weights, toks, name):
    w = dict(weights)
    w[name] = w[name].detach().clone().requires_grad_(True)
    lp = N.forward_logprobs(w, GEOM, toks, ops=ops(True))
    loss = -lp[torch.arange(len(toks) - 1), toks[1:]].sum() / (len(toks) - 1)
    (grad,) = torch.autograd.grad(loss, [w[name]])
    return lp.detach(), grad


def test_the_composition_trains_its_logprobs_keep_their_bytes_and_the_gradient_repeats(
    tiny_weights,
):
    toks = torch.randint(0, GEOM.vocab, (11,), generator=torch.Generator().manual_seed(3))
    layer = GEOM.layer_types.index(N.LINEAR)
    name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
    plain = N.forward_logprobs(tiny_weights, GEOM, toks)
    lp, g1 = composition_grad(tiny_weights, toks, name)
    assert_same_bytes(lp, plain, "the composition's log-probabilities under grad")
    _, g2 = composition_grad(tiny_weights, toks, name)
    assert g1.dtype == BF16 and bool(g1.abs().max() > 0)
    assert_same_bytes(g2, g1, "the in_proj_qkvz gradient, run twice")
    # input control: in_proj_qkvz one bf16 ulp off at element 7 (as test_lane_next.py moves
    # it) moves both the log-probabilities under grad and the gradient
    moved = dict(tiny_weights)
    moved[name] = nudge_ulp(tiny_weights[name], 7)
    lp_m, g_m = composition_grad(moved, toks, name)
    assert not same_bytes(lp_m, plain)
    assert not same_bytes(g_m, g1)
