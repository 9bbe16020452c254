"""The Qwen3 lane's reference forward: row bytes independent of sequence length; right model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import assert_same_bytes, nudge_ulp


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


class _GroupedSlots(qwen3.DictSlots):
    """The reference slots with the experts stacked (the serving engines' grouped form)."""

    def __init__(self, weights, geom):
        weights = dict(weights)
        self.stacked = qwen3.stack_experts(weights, geom)
        super().__init__(weights, geom)

    def experts(self, layer):
        return self.stacked[layer]


def test_grouped_experts_give_the_bytes_of_the_per_expert_dispatch(tiny):
    """The MoE layer with its experts grouped (pairs sorted by expert on the device, one
    grouped gemm a projection) gives the per-expert dispatch's bytes, and runs the same
    programs at the same sites; every layer-0 expert's down_proj weights moved by one ulp move
    the outputs (the check can fail)."""
    from lockstep_exact.lanes.ops import Ops

    _, geom, w = tiny
    if not geom.is_moe:
        pytest.skip("dense: no experts")
    toks = tokens(37, seed=5)
    pos = torch.arange(toks.shape[0])
    plain, grouped = qwen3.default_ops(geom), qwen3.default_ops(geom)
    want = qwen3.forward(plain, geom, qwen3.DictSlots(w, geom), toks, pos)
    got = qwen3.forward(grouped, geom, _GroupedSlots(w, geom), toks, pos)
    assert_same_bytes(got, want, "grouped vs per-expert MoE")
    assert grouped.invoked == plain.invoked
    w2 = dict(w)
    for e in range(geom.experts):
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        w2[name] = (w[name].view(torch.int16) + 1).view(torch.bfloat16)
    moved = qwen3.forward(Ops(plain.contract), geom, _GroupedSlots(w2, geom), toks, pos)
    assert not same_bytes(moved, want)


def test_an_expert_plan_sorts_pairs_by_expert_in_row_order_and_tiles_them():
    """Pairs sorted by expert, stably (ascending row then slot within an expert, the order
    local_dispatch gives); tiles of at most TILE_M pairs of one expert cover every pair once,
    in order; the tile count is fixed by the shapes, empty tiles marked -1."""
    from lockstep_exact.programs.grouping import TILE_M, expert_plan, unsort

    g = torch.Generator().manual_seed(9)
    experts, rows, k = 5, 60, 3
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])
    ids[:40, 0] = 1  # one expert with more pairs than a tile
    plan = expert_plan(ids, experts)
    flat = ids.reshape(-1)
    want = [i for e in range(experts) for i in range(rows * k) if int(flat[i]) == e]
    assert plan.order.tolist() == want
    assert plan.src.tolist() == [i // k for i in want]
    assert plan.tiles.shape[0] == -(-rows * k // TILE_M) + experts
    covered = []
    for e, first, n in plan.tiles.tolist():
        if e < 0:
            assert n == 0
            continue
        assert 1 <= n <= TILE_M and all(int(flat[want[first + i]]) == e for i in range(n))
        covered += range(first, first + n)
    assert covered == list(range(rows * k))
    # Sorted position i holds pair want[i]; unsort puts it back at (row, slot) of that pair.
    back = unsort(torch.tensor(want, dtype=torch.float32)[:, None].expand(-1, 2), plan)
    assert back.shape == (rows, k, 2)
    assert torch.equal(back[..., 0], torch.arange(rows * k, dtype=torch.float32).view(rows, k))


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
    # input control: one element of h in a row some run expert chose, one ulp off (the row's
    # largest), moves that row's outputs and no other row's
    ran = torch.tensor([any(int(e) in order for e in row) for row in ids])
    r = int(ran.nonzero()[0])
    col = int(h[r].float().argmax())
    h2 = h.clone()
    h2[r] = nudge_ulp(h[r], col)
    moved = qwen3.local_dispatch(h2, ids, expert, owned=owned)
    assert not same_bytes(moved[r], got[r])
    assert_same_bytes(torch.cat([moved[:r], moved[r + 1 :]]), torch.cat([got[:r], got[r + 1 :]]))
    empty = qwen3.local_dispatch(h[:0], ids[:0], expert)
    assert empty.shape == (0, k, hidden)
