"""The Qwen3 lane's reference forward: row bytes independent of sequence length; right model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import assert_same_bytes, nudge_ulp, same_bytes
from lockstep_exact.tiny import make_tiny


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def tiny(request, tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    return d, qwen3.Geometry.from_model_dir(d), load_file(str(d / "model.safetensors"))


def tokens(n, seed=0):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


def test_reference_rows_do_not_depend_on_what_follows(tiny):
    _, geom, w = tiny
    toks = tokens(70)
    full = qwen3.forward_logprobs(w, geom, toks)
    assert full.dtype == torch.float32
    assert_same_bytes(qwen3.forward_logprobs(w, geom, toks[:33]), full[:33], "prefix of 33")
    # control: one weight moved by one ulp moves the bytes
    w2 = dict(w)
    w2["model.norm.weight"] = nudge_ulp(w["model.norm.weight"], 5)
    assert not same_bytes(qwen3.forward_logprobs(w2, geom, toks[:33]), full[:33])


def test_reference_is_the_hf_model_within_bf16_error(tiny):
    transformers = pytest.importorskip("transformers")
    d, geom, w = tiny
    toks = tokens(40, seed=1)
    kw = {"experts_implementation": "eager"} if geom.is_moe else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw)
    with torch.no_grad():
        ref = torch.log_softmax(model(toks[None]).logits[0].double(), -1)
    err = (qwen3.forward_logprobs(w, geom, toks).double() - ref).abs()
    # HF's own bf16 forward differs from its fp32 forward by ~0.016 mean, ~0.11 max here.
    assert float(err.mean()) < 0.03
    # A router near a tie may pick another expert under bf16 rounding (a discontinuity), so
    # MoE allows a few rows beyond the dense bound.
    rows_off = int((err.amax(-1) > 0.25).sum())
    assert rows_off <= (4 if geom.is_moe else 0), f"{rows_off} of 40 rows beyond 0.25"


def test_static_dispatch_gives_the_bytes_of_the_per_expert_dispatch():
    """The graph-safe MoE dispatch (every expert on every row, then a gather) equals running
    each expert on the rows that chose it, byte for byte; a one-ulp change of one expert
    weight shows the check can fail."""
    from lockstep_exact import programs as P

    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, rows, k = 6, 64, 48, 37, 2
    w = [
        (torch.randn(inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
        for _ in range(2 * experts)
    ]
    down = [
        (torch.randn(hidden, inter, generator=g) * 0.1).to(torch.bfloat16) for _ in range(experts)
    ]
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    ids = torch.sort(
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)]), 1
    )
    ids = ids.values

    def expert(e, x, nudge=False):
        d = nudge_ulp(down[e], 0) if nudge else down[e]
        act = P.swiglu(P.gemm(x, w[2 * e]), P.gemm(x, w[2 * e + 1]))
        return P.gemm(act, d)

    want = qwen3.local_dispatch(h, ids, expert)
    got = qwen3.static_dispatch(h, ids, expert, experts)
    assert_same_bytes(got, want)
    nudged = qwen3.static_dispatch(h, ids, lambda e, x: expert(e, x, nudge=e == 2), experts)
    assert not same_bytes(nudged, want)


@pytest.mark.parametrize("owned", [None, {0, 3, 5}])
def test_local_dispatch_hands_each_expert_the_rows_that_chose_it_in_row_order(owned):
    """The routed dispatch reads the routing once: each chosen expert, ascending, gets the
    rows that chose it in ascending (row, slot) order, exactly as a per-expert search of the
    ids finds them, and its results land at their (row, slot). Experts outside ``owned``
    run nothing and leave zeros."""
    g = torch.Generator().manual_seed(4)
    experts, hidden, rows, k = 7, 16, 29, 3
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])
    ids[ids == 6] = 5  # expert 6 is chosen by no row; 5 twice by some
    weights = [torch.randn(hidden, hidden, generator=g).to(torch.bfloat16) for _ in range(experts)]
    seen = []

    def expert(e, x):
        seen.append((e, x))
        return x @ weights[e]

    got = qwen3.local_dispatch(h, ids, expert, owned=owned)
    want = torch.zeros(rows, k, hidden, dtype=torch.bfloat16)
    order = []
    for e in range(experts):
        r, s = (ids == e).nonzero(as_tuple=True)
        if not len(r) or (owned is not None and e not in owned):
            continue
        order.append(e)
        want[r, s] = h[r] @ weights[e]
        assert torch.equal(dict(seen)[e], h[r]), f"expert {e} got other rows or another order"
    assert [e for e, _ in seen] == order
    assert_same_bytes(got, want)
    assert not same_bytes(nudge_ulp(got, 7), want)  # the byte check can fail
    empty = qwen3.local_dispatch(h[:0], ids[:0], expert)
    assert empty.shape == (0, k, hidden)
