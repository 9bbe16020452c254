"""Run the cuda backend's gdn.chunked kernel in Triton's interpreter on cpu tensors and compare
its bytes with the cpu program's (``test_interpret.py`` runs this in a Python that has Triton).

The interpreter executes each Triton operation with numpy on the host: fp32 ``+ - *`` are IEEE
there, so equal bytes mean the kernel performs the cpu program's operations in its order
(trees, chains, the exp construction). It says nothing of the GPU's own arithmetic (contraction,
denormals): the GPU suite compares the kernel's cuda bytes with the cpu bytes on the device.

Prints one JSON object: case name -> {"equal": bool, ...}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.errors import InterpreterError  # noqa: E402

from lockstep_exact.programs import fold_tree  # noqa: E402
from lockstep_exact.programs.cpu import activation as cpu_act  # noqa: E402
from lockstep_exact.programs.cpu import arith as cpu_arith  # noqa: E402
from lockstep_exact.programs.cpu import gdn as cpu_gdn  # noqa: E402
from lockstep_exact.programs.cpu import hybrid as cpu_hybrid  # noqa: E402
from lockstep_exact.programs.cpu import moe as cpu_moe  # noqa: E402
from lockstep_exact.programs.cpu import norm as cpu_norm  # noqa: E402
from lockstep_exact.programs.cpu import sampling as cpu_sampling  # noqa: E402
from lockstep_exact.programs.cuda import arith as cuda_arith  # noqa: E402
from lockstep_exact.programs.cuda import elementwise as cuda_elementwise  # noqa: E402
from lockstep_exact.programs.cuda import exactmath  # noqa: E402
from lockstep_exact.programs.cuda import gdn as kernel  # noqa: E402
from lockstep_exact.programs.cuda import grouped as cuda_grouped  # noqa: E402
from lockstep_exact.programs.cuda import hybrid as cuda_hybrid  # noqa: E402
from lockstep_exact.programs.cuda import moe as cuda_moe  # noqa: E402
from lockstep_exact.programs.cuda import plan as cuda_plan  # noqa: E402
from lockstep_exact.programs.cuda import sampling as cuda_sampling  # noqa: E402
from lockstep_exact.programs.grouping import expert_plan  # noqa: E402
from lockstep_exact.testing import nudge_ulp  # noqa: E402

cuda_attn = importlib.import_module("lockstep_exact.programs.cuda.attention")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes as integers of the element's width (ids are compared as they are)."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def chunk_inputs(h, d_k, d_v, c, m, first, w, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    s0 = torch.randn(h, d_k, d_v, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(m, h, d_k, generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(m - first, h, d_k, generator=gen), dim=-1)
    v = torch.randn(m, h, d_v, generator=gen).bfloat16().float()
    g = -torch.rand(m, h, generator=gen) * gate
    beta = torch.rand(m, h, generator=gen)
    solved = None
    if w:  # rows 0..w-1 solved by an earlier call (no outputs: first = m = w)
        _, _, u0, g0 = cpu_gdn._chunk(s0, q[:0], k[:w], v[:w], g[:w], beta[:w], w, c)
        solved = (u0, g0)
    return [s0, q * 0.25, k, v, g, beta], solved


# (heads, K, V, chunk, rows m, first output row, solved rows w, gate scale): odd K and V, V over
# two column blocks, partial and complete chunks, solved rows, gates strong enough that the
# decays reach zero and subnormals.
CHUNKS = {
    "complete chunk, odd K, V over two blocks": (3, 12, 40, 16, 16, 0, 0, 0.1),
    "partial chunk from solved rows": (3, 12, 40, 16, 11, 3, 2, 0.1),
    "complete chunk after 9 solved rows": (2, 20, 33, 16, 16, 9, 9, 3.0),
    "chunk 64, K = V = 16": (1, 16, 16, 64, 64, 0, 0, 0.5),
    "one decode row after 36 solved": (2, 16, 8, 64, 37, 36, 36, 8.0),
    "one row, K 5, V 7, chunk 8": (2, 5, 7, 8, 1, 0, 0, 1.0),
    "the chunk's last row": (2, 16, 16, 64, 64, 63, 63, 2.0),
    "strong gates: decays at zero": (1, 32, 64, 32, 32, 5, 0, 40.0),
}


def check_chunks(out: dict) -> None:
    for name, (h, d_k, d_v, c, m, first, w, gate) in CHUNKS.items():
        xs, solved = chunk_inputs(h, d_k, d_v, c, m, first, w, gate, seed=len(out))
        want = cpu_gdn._chunk(*xs, first, c, solved)
        got = kernel.run(*xs, first, c, solved)
        out[f"chunk: {name}"] = {"equal": all(same(a, b) for a, b in zip(want, got, strict=True))}
    # The control: one beta of a row the outputs read, one ulp up. The kernel's bytes follow the
    # input (they equal the cpu program's on the moved input) and differ from the unmoved ones.
    h, d_k, d_v, c, m, first, w, gate = CHUNKS["complete chunk, odd K, V over two blocks"]
    xs, solved = chunk_inputs(h, d_k, d_v, c, m, first, w, gate, seed=0)
    base = kernel.run(*xs, first, c, solved)[0]
    moved = list(xs)
    moved[5] = xs[5].clone()
    moved[5][4, 1] = nudge_ulp(xs[5][4, 1:2], 0)[0]
    got = kernel.run(*moved, first, c, solved)[0]
    out["control: beta one ulp up"] = {
        "equal": same(got, cpu_gdn._chunk(*moved, first, c, solved)[0]),
        "moved": not same(got, base),
    }


def check_calls(out: dict) -> None:
    """gdn.chunked end to end: the cpu calls with the kernel as the chunk pass, one pass over
    150 tokens and the same tokens in pieces then token by token, outputs and states."""
    gen = torch.Generator().manual_seed(7)
    h_k, h_v, d_k, d_v, c, n = 2, 4, 12, 20, 16, 40
    q = torch.nn.functional.normalize(torch.randn(n, h_k, d_k, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, h_k, d_k, generator=gen), dim=-1)
    v = torch.randn(n, h_v, d_v, generator=gen).bfloat16()
    g = -torch.rand(n, h_v, generator=gen) * 0.3
    beta = torch.rand(n, h_v, generator=gen)

    def calls(chunk_pass, cuts):
        state = cpu_gdn.gdn_state(h_k, h_v, d_k, d_v, chunk=c)
        outs = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            o, state = cpu_gdn.run_chunks(
                chunk_pass, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state,
                position=lo, chunk=c,
            )  # fmt: skip
            outs.append(o)
        return torch.cat(outs), state

    for name, cuts in {
        "one pass": [0, n],
        "pieces across chunk boundaries": [0, 5, 16, 17, 33, n],
        "prefill then token by token": [0, 13, *range(14, n + 1)],
    }.items():
        want, ws = calls(cpu_gdn._chunk_heads, cuts)
        got, gs = calls(kernel.run, cuts)
        states = all(
            same(getattr(ws, f), getattr(gs, f)) for f in ("s", "k", "v", "g", "beta", "u", "gcum")
        )
        out[f"gdn.chunked: {name}"] = {"equal": same(want, got) and states}


# (heads, dims, chunk, conv kernel, (position, rows, page) per sequence): decodes at the first,
# a middle and the last row of a chunk, fresh prompts (one row and several), a continuation
# that fills its chunk; pages out of order.
PAGED = {
    "decodes, GQA 2": ((2, 4), (12, 20), 16, 4, [(5, 1, 3), (15, 1, 0), (16, 1, 6), (1, 1, 2)]),
    "prompts and a chunk filled": (
        (1, 2),
        (5, 7),
        8,
        3,
        [(0, 5, 4), (3, 5, 1), (0, 1, 0), (9, 2, 7)],
    ),
    "K 16 V 33, one sequence": ((2, 2), (16, 33), 16, 4, [(40, 8, 5)]),
}


def check_paged(out: dict) -> None:
    """The paged programs' one launch (gdn_paged: the chunk kernel over every sequence from
    its page; conv1d_paged) against the definition, a call per sequence: outputs and every
    live byte of the advanced pages."""
    from lockstep_exact.testing import gdn_paged_case, live_pages, pages_to

    for name, (heads, dims, c, kern, seqs) in PAGED.items():
        (q, k, v, g, beta, x, w), book, (starts, positions, slots) = gdn_paged_case(
            heads, dims, c, seqs, pages=8, kernel=kern, seed=len(out)
        )
        table = cpu_gdn.paged_seqs(starts, positions, slots, chunk=c)
        mine = pages_to(book, "cpu")
        want = cpu_gdn.gdn_paged(q, k, v, g, beta, book, table, chunk=c)
        want_x = cpu_gdn.conv1d_paged(x, w, book, table, kernel=kern)
        got = cuda_hybrid.paged(q, k, v, g, beta, mine, table, chunk=c)
        got_x = cuda_hybrid.conv1d_pages(x, w, mine, table, kernel=kern)
        after = [p + starts[r + 1] - starts[r] for r, p in enumerate(positions)]
        a, b = live_pages(book, slots, after, c), live_pages(mine, slots, after, c)
        equal = same(want, got) and same(want_x, got_x) and all(same(a[n], b[n]) for n in a)
        out[f"paged: {name}"] = {"equal": equal}
    # A prefill as chunk passes (paged_passes: sequences across one, two and three chunk
    # ends, from 0 and from inside a chunk, beside a decode): the launches a pass at a time,
    # as programs' dispatch runs them (_by_passes), give each sequence's own gdn_chunked and
    # conv1d_causal call over all its rows.
    from lockstep_exact.programs import _by_passes
    from lockstep_exact.testing import own_calls

    heads, dims, c, kern = (2, 4), (16, 33), 16, 4
    mix = [(0, 53, 4), (8, 32, 1), (1, 1, 3), (22, 10, 0)]
    inputs, book, (starts, positions, slots) = gdn_paged_case(
        heads, dims, c, mix, pages=8, kernel=kern, seed=7
    )
    q, k, v, g, beta, x, w = inputs
    want, want_x, want_book = own_calls(inputs, book, starts, positions, slots, chunk=c)
    passes = cpu_gdn.paged_passes(starts, positions, slots, chunk=c)
    mine = pages_to(book, "cpu")
    got_x = _by_passes(
        lambda rows, table: cuda_hybrid.conv1d_pages(rows, w, mine, table, kernel=kern),
        (x,),
        passes,
    )
    got = _by_passes(
        lambda *xs: cuda_hybrid.paged(*xs[:5], mine, xs[5], chunk=c), (q, k, v, g, beta), passes
    )
    after = [p + starts[r + 1] - starts[r] for r, p in enumerate(positions)]
    a, b = live_pages(want_book, slots, after, c), live_pages(mine, slots, after, c)
    equal = same(want, got) and same(want_x, got_x) and all(same(a[n], b[n]) for n in a)
    out[f"paged: a prefill as {len(passes.passes)} chunk passes"] = {"equal": equal}
    # A decode step padded to a captured batch size (paged_decodes: the table made from
    # tensors): the live rows and pages as the definition's over the live step; padding
    # entries, one naming a live page and two an unused one, write nothing.
    from lockstep_exact.testing import padded_decode_case

    heads, dims, c, kern, seqs = PAGED["decodes, GQA 2"]
    decodes = [(p, page) for p, _, page in seqs]
    padded, book, (positions, slots, live), (starts, pos, sl) = padded_decode_case(
        heads, dims, c, decodes, [5, 3, 5], pages=8, kernel=kern, seed=9
    )
    q, k, v, g, beta, x, w = padded
    n = len(decodes)
    table = cpu_gdn.paged_seqs(starts, pos, sl, chunk=c)
    want_book = pages_to(book, "cpu")
    want = cpu_gdn.gdn_paged(q[:n], k[:n], v[:n], g[:n], beta[:n], want_book, table, chunk=c)
    want_x = cpu_gdn.conv1d_paged(x[:n], w, want_book, table, kernel=kern)
    mine = pages_to(book, "cpu")
    decode_table = cpu_gdn.paged_decodes(positions, slots, live, chunk=c)
    got = cuda_hybrid.paged(q, k, v, g, beta, mine, decode_table, chunk=c)
    got_x = cuda_hybrid.conv1d_pages(x, w, mine, decode_table, kernel=kern)
    after = [p + 1 for p in pos]
    a, b = live_pages(want_book, sl, after, c), live_pages(mine, sl, after, c)
    unused = all(same(getattr(mine, f)[5], getattr(book, f)[5]) for f in book.__dataclass_fields__)
    equal = same(want, got[:n]) and same(want_x, got_x[:n]) and all(same(a[m], b[m]) for m in a)
    out["paged: padded decodes"] = {"equal": equal and unused}
    # The control: one page's state moved (its largest element by 16 bf16 ulps, 2**20 fp32 ulps,
    # enough for the bf16 outputs to show it) moves that sequence's rows with the definition,
    # and no other sequence's.
    heads, dims, c, kern, seqs = PAGED["decodes, GQA 2"]
    (q, k, v, g, beta, *_), book, (starts, positions, slots) = gdn_paged_case(
        heads, dims, c, seqs, pages=8, kernel=kern, seed=0
    )
    table = cpu_gdn.paged_seqs(starts, positions, slots, chunk=c)
    base = cuda_hybrid.paged(q, k, v, g, beta, pages_to(book, "cpu"), table, chunk=c)
    r = next(i for i, p in enumerate(positions) if p >= c)  # a state past its first chunk
    s = book.s[slots[r]]
    s[0] = nudge_ulp(s[0], int(s[0].abs().argmax()), 1 << 20)
    got = cuda_hybrid.paged(q, k, v, g, beta, pages_to(book, "cpu"), table, chunk=c)
    want = cpu_gdn.gdn_paged(q, k, v, g, beta, book, table, chunk=c)
    out["control: one page's state moved"] = {
        "equal": same(got, want),
        "moved": not same(got[r : r + 1], base[r : r + 1])
        and same(got[:r], base[:r])
        and same(got[r + 1 :], base[r + 1 :]),
    }


def nan_canonical(t: torch.Tensor) -> torch.Tensor:
    """fp32 with every NaN as one pattern (the GPU suite's rule for fp32 outputs: a NaN's
    payload is not part of a program's bytes); bf16 outputs are compared as they are."""
    if t.dtype != torch.float32:
        return t
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def same_values(a, b) -> bool:
    return same(nan_canonical(a), nan_canonical(b))


@triton.jit
def _helper_kernel(x_ptr, o_ptr, N, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    if WHICH == 0:
        y = exactmath.exp(x)
    elif WHICH == 1:
        y = exactmath.log(x)
    elif WHICH == 2:
        y = exactmath.silu(x)
    elif WHICH == 3:
        y = exactmath.sigmoid(x)
    elif WHICH == 4:
        y = exactmath.softplus(x)
    else:
        y = exactmath.widen(exactmath.round_bf16(x))
    tl.store(o_ptr + offs, y, mask=ok)


def fp32_cases(n: int = 1 << 16) -> torch.Tensor:
    """Random fp32 bit patterns (NaNs, infinities, subnormals among them), a spread of
    ordinary values and the edges."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    edges = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.5, -0.5, 1.5, -1.5]
    edges += [88.72283172607421875, -103.97208404541015625, 89.0, -104.0, -87.5, -100.0]
    edges += [1e-45, -1e-45, 1.1754943508222875e-38, 3.4028234663852886e38, 1.0, 2.0, 0.7071068]
    return torch.cat([
        bits.to(torch.int32).view(torch.float32),
        torch.linspace(-120.0, 100.0, 20000),
        torch.randn(4000, generator=gen) * 30,
        torch.tensor(edges),
    ])  # fmt: skip


def check_helpers(out: dict) -> None:
    x = fp32_cases()
    wants = {
        "exp": cpu_arith.exp,
        "log": lambda t: cpu_arith.log(t.abs()),
        "silu": cpu_act.silu,
        "sigmoid": cpu_gdn.sigmoid,
        "softplus": cpu_gdn.softplus,
        "round_bf16": lambda t: cpu_arith.round_bf16(t).float(),
    }
    for which, (name, want) in enumerate(wants.items()):
        arg = x.abs() if name == "log" else x
        got = torch.empty_like(arg)
        _helper_kernel[(triton.cdiv(arg.numel(), 1024),)](arg, got, arg.numel(), which, 1024)
        out[f"helper: {name}"] = {"equal": same_values(got, want(arg))}


def bf16_cases(*shape, seed: int, scale: float = 3.0, specials: bool = True) -> torch.Tensor:
    """bf16 values of a normal spread, with every 7th element a random bit pattern (NaNs,
    infinities, subnormals) when ``specials``."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * scale).bfloat16()
    if specials:
        flat = x.view(-1).view(torch.int16)
        pick = torch.arange(0, flat.numel(), 7)
        flat[pick] = torch.randint(-(2**15), 2**15 - 1, (pick.numel(),), generator=gen).to(
            torch.int16
        )
    return x


def router_logits(t, e, dtype, seed):
    """Router logits with ties, a NaN, a row of one live expert and an infinity."""
    x = torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :5] = x[0, 5]
    x[1, 3] = float("nan")
    x[2] = -1e30
    x[2, 7 % e] = 0.0
    x[-1, 2] = float("inf")
    return x.to(dtype)


def moe_cases() -> dict:
    """router.softmax_topk and moe.fold against the definitions (``cpu/moe.py``, which is what
    the cuda backend ran before its kernels: the cuda lock's goldens equal the cpu ones)."""
    cases = {}
    for t, e, k, norm, dtype in (
        (5, 128, 8, True, torch.bfloat16), (3, 60, 4, False, torch.float32),
        (7, 16, 16, True, torch.bfloat16), (4, 33, 1, True, torch.float32),
        (6, 10, 3, True, torch.bfloat16), (5, 512, 10, True, torch.float32),
    ):  # fmt: skip
        name = f"router.softmax_topk T={t} E={e} k={k} normalize={norm} {str(dtype)[6:]}"
        cases[name] = (
            lambda x, k=k, n=norm: cuda_moe.route(x, k, n),
            lambda x, k=k, n=norm: cpu_moe.router_topk(x, k, normalize=n),
            (router_logits(t, e, dtype, seed=t + e),),
        )
    for t, k, h in ((5, 8, 300), (3, 3, 17), (4, 1, 256), (2, 16, 64)):
        y = bf16_cases(t, k, h, seed=t * k, scale=2.0)
        w = torch.rand(t, k, generator=torch.Generator().manual_seed(h)).bfloat16()
        cases[f"moe.fold T={t} k={k} H={h}"] = (cuda_moe.fold, cpu_moe.moe_fold, (y, w))
        cases[f"moe.fold fp32 T={t} k={k} H={h}"] = (
            cuda_moe.fold_fp32,
            cpu_moe.moe_fold_fp32,
            (y, w),
        )
    return cases


def check_plans(out: dict) -> None:
    """The expert plan's kernel against the torch form: every field, element for element."""
    gen = torch.Generator().manual_seed(5)
    for t, k, e in ((1, 8, 128), (64, 8, 128), (37, 4, 60), (300, 8, 128), (5, 1, 3),
                    (0, 8, 16), (100, 10, 512), (1024, 8, 128), (2, 64, 256)):  # fmt: skip
        rows = [torch.randperm(e, generator=gen)[:k] for _ in range(t)]
        ids = torch.stack(rows) if t else torch.zeros(0, k, dtype=torch.int64)
        if t > 3:
            ids[: t // 2] = ids[0]  # many rows on the same experts: tiles past one
        ids = torch.sort(ids, dim=-1).values
        want, got = expert_plan(ids, e), cuda_plan.plan(ids, e)
        fields = ("order", "src", "bounds", "tiles")
        out[f"plan: T={t} k={k} E={e}"] = {
            "equal": all(torch.equal(getattr(want, f), getattr(got, f)) for f in fields)
        }


def _kernel_draws(lp, temps, seeds, positions, rounds=3):
    """The sampler's one-kernel form, launched as ``cuda.sampling.sample`` launches it."""
    t = lp.shape[0]
    words = torch.tensor(list(seeds) + list(positions), dtype=torch.int64)
    out = torch.empty(t, dtype=torch.int64)
    cuda_sampling._sample_kernel[(t,)](
        lp, torch.tensor(temps, dtype=torch.float32), words[:t], words[t:], out, lp.shape[1],
        lp.stride(0), ROUNDS=rounds, BLOCK=cuda_sampling._BLOCK,
    )  # fmt: skip
    return out


def check_sampler(out: dict) -> None:
    """sample.gumbel_topp's one-kernel form (greedy and top_p 1 rows) against the definition:
    48 rows of 3,001 tokens (two blocks), temperatures 0 to 1.5, seeds across the 64-bit
    range, positions to 2**32 - 1, one to four stream rounds; ties in greedy rows."""
    gen = torch.Generator().manual_seed(11)
    t, v = 48, 3001
    lp = torch.log_softmax(torch.randn(t, v, generator=gen) * 2.5, dim=-1)
    lp[3, 10] = lp[3, 2000] = lp[3].max() + 1.0  # a greedy tie: the lower id wins
    temps = [[0.0, 1.0, 0.7, 1.5][i % 4] for i in range(t)]
    seeds = [int(x) for x in torch.randint(-(2**62), 2**62, (t,), generator=gen)]
    positions = [int(x) for x in torch.randint(0, 2**32, (t,), generator=gen)]
    positions[0] = 2**32 - 1
    for rounds in (1, 3, 4):
        want = cpu_sampling.sample(
            lp, temperature=temps, top_p=[1.0] * t, seeds=seeds, positions=positions,
            rounds=rounds,
        )  # fmt: skip
        got = _kernel_draws(lp, temps, seeds, positions, rounds)
        out[f"sampler: rounds={rounds}"] = {"equal": torch.equal(got, want)}
    # control: other seeds move some draws, in both forms alike
    moved = [s + 1 for s in seeds]
    got = _kernel_draws(lp, temps, moved, positions)
    want = cpu_sampling.sample(
        lp, temperature=temps, top_p=[1.0] * t, seeds=moved, positions=positions
    )
    out["control: seeds moved by one"] = {
        "equal": torch.equal(got, want),
        "moved": not torch.equal(got, _kernel_draws(lp, temps, seeds, positions)),
    }


def check_programs(out: dict) -> None:
    """Each program's launch against its cpu program, at odd sizes (specials included)."""
    b = bf16_cases
    cases = {
        "gdn.gating": (
            cuda_hybrid.gating, cpu_gdn.gdn_gating,
            (b(37, 5, seed=1, scale=4.0), b(37, 5, seed=2, scale=4.0),
             torch.randn(5, generator=torch.Generator().manual_seed(3)), b(5, seed=4)),
        ),
        "gdn.gating, bf16 A_log": (
            cuda_hybrid.gating, cpu_gdn.gdn_gating,
            (b(9, 3, seed=5), b(9, 3, seed=6), b(3, seed=7, specials=False), b(3, seed=8)),
        ),
        "gdn.l2norm, D 33": (cuda_hybrid.l2norm_rows, cpu_gdn.l2norm, (b(7, 3, 33, seed=9),)),
        "gdn.l2norm, D 128": (cuda_hybrid.l2norm_rows, cpu_gdn.l2norm, (b(5, 2, 128, seed=10),)),
        "conv1d.causal, D 300, kernel 4": (
            lambda x, w, win: cuda_hybrid.conv1d(x, w, win, kernel=4),
            lambda x, w, win: cpu_gdn.conv1d_causal(x, w, win, kernel=4),
            (b(6, 300, seed=11), b(300, 4, seed=12), b(3, 300, seed=13)),
        ),
        "conv1d.causal, D 20, kernel 3": (
            lambda x, w, win: cuda_hybrid.conv1d(x, w, win, kernel=3),
            lambda x, w, win: cpu_gdn.conv1d_causal(x, w, win, kernel=3),
            (b(1, 20, seed=14), b(20, 3, seed=15), b(2, 20, seed=16)),
        ),
        "rmsnorm.zero_centered, H 2048": (
            lambda x, w: cuda_hybrid.zero_centered(x, w, 1e-6),
            lambda x, w: cpu_hybrid.rmsnorm_zero_centered(x, w, 1e-6),
            (b(3, 2048, seed=17), b(2048, seed=18, scale=0.1)),
        ),
        "rmsnorm.zero_centered, H 24": (
            lambda x, w: cuda_hybrid.zero_centered(x, w, 1e-5),
            lambda x, w: cpu_hybrid.rmsnorm_zero_centered(x, w, 1e-5),
            (b(2, 5, 24, seed=19), b(24, seed=20, scale=0.1)),
        ),
        "rmsnorm.gated, V 128": (
            lambda x, z, w: cuda_hybrid.gated(x, z, w, 1e-6),
            lambda x, z, w: cpu_hybrid.rmsnorm_gated(x, z, w, 1e-6),
            (b(3, 4, 128, seed=21), b(3, 4, 128, seed=22), b(128, seed=23)),
        ),
        "rmsnorm.gated, V 40": (
            lambda x, z, w: cuda_hybrid.gated(x, z, w, 1e-6),
            lambda x, z, w: cpu_hybrid.rmsnorm_gated(x, z, w, 1e-6),
            (b(9, 40, seed=24), b(9, 40, seed=25), b(40, seed=26)),
        ),
        "gate.sigmoid": (
            cuda_hybrid.gate_sigmoid, cpu_hybrid.sigmoid_gate,
            (b(5, 3, 70, seed=27), b(5, 3, 70, seed=28)),
        ),
        "moe.shared_gate": (
            cuda_hybrid.shared_gate, cpu_hybrid.shared_expert_gate,
            (b(6, 90, seed=29), b(6, 90, seed=30), b(6, 1, seed=31)),
        ),
        "residual.add": (
            cuda_elementwise.added, cpu_norm.residual_add,
            (b(7, 333, seed=32, scale=1e30), b(7, 333, seed=33, scale=1e30)),
        ),
        "round_bf16": (cuda_arith.rounded, cpu_arith.round_bf16, (fp32_cases(1 << 12),)),
        "fold of 8 stacked partials": (
            cuda_grouped.folded, lambda s: fold_tree(list(s)),
            (fp32_cases(8 * 999)[: 8 * 999].reshape(8, 999),),
        ),
    }  # fmt: skip
    for name, (launch, program, args) in {**cases, **moe_cases()}.items():
        got, want = launch(*args), program(*args)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        out[f"program: {name}"] = {
            "equal": all(same_values(a, c) for a, c in zip(got, want, strict=True))
        }
    # The control: one input element one bf16 ulp up moves the launch's output with the
    # program's.
    x, w = b(3, 2048, seed=17, specials=False), b(2048, seed=18, scale=0.1)
    base = cuda_hybrid.zero_centered(x, w, 1e-6)
    moved = x.clone()
    moved.view(torch.int16)[1, 100] += 1  # the next bf16 away from zero
    got = cuda_hybrid.zero_centered(moved, w, 1e-6)
    out["control: a norm input one bf16 ulp up"] = {
        "equal": same(got, cpu_hybrid.rmsnorm_zero_centered(moved, w, 1e-6)),
        "moved": not same(got, base),
    }


@triton.jit
def _trap_on_host(bad):
    """``arith.trap_if`` for the interpreter (inline PTX does not run on the host): a failed
    device assertion where ``bad``, else zeros."""
    tl.device_assert(bad == 0, "trap_if")
    return bad.to(tl.int32) * 0


def _dot_of_values(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's ``tl.dot`` with bf16 operands read as their values: Triton 3.6's
    multiplies the raw uint16 patterns it stores bf16 in. An fp32 product of the values (in
    numpy's order, the same for every kernel that calls it)."""
    from triton.runtime import interpreter as ti

    def values(x):
        if x.dtype == tl.bfloat16:
            return ti._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return x.data

    out = np.matmul(values(a), values(b), dtype=d.data.dtype) + d.data
    return ti.TensorHandle(out, d.dtype.scalar)


@contextlib.contextmanager
def attention_on_host():
    """The cuda attention module with its launches runnable on cpu tensors: the device check
    off, ``trap_if`` as a device assertion (the interpreter's assertions on), the Hopper form
    off (it needs an sm_90 GPU), bf16 dots of values."""
    from triton.runtime import interpreter as ti

    saved = (cuda_attn.require_cuda, cuda_attn.trap_if, cuda_attn._HOPPER_PREFILL)
    dot, options = ti.InterpreterBuilder.create_dot, ti.interpreter_builder.options
    ti.interpreter_builder.options = dataclasses.replace(options, debug=True)
    cuda_attn.require_cuda = lambda *tensors: None
    cuda_attn.trap_if = _trap_on_host
    cuda_attn._HOPPER_PREFILL = False
    ti.InterpreterBuilder.create_dot = _dot_of_values
    try:
        yield
    finally:
        cuda_attn.require_cuda, cuda_attn.trap_if, cuda_attn._HOPPER_PREFILL = saved
        ti.InterpreterBuilder.create_dot = dot
        ti.interpreter_builder.options = options


# (query heads per kv head, head dim, block, segment, [(rows, keys)] per request): rows of
# 1, 5, 63, 64, 65 and 130 tokens, requests with no rows, chunks whose keys start before
# their rows, and rows past one segment (several at segment 64).
VARLEN_CASES = {
    "G=4 D=64 block 32 segment 64": (4, 64, 32, 64, [(1, 1), (5, 9), (63, 63), (0, 4), (65, 140)]),
    "G=2 D=128 block 64 segment 256": (
        2, 128, 64, 256, [(64, 64), (130, 300), (1, 260), (5, 5)],
    ),
    "G=4 D=128 block 64 segment 64": (4, 128, 64, 64, [(65, 65), (1, 200), (0, 0), (5, 70)]),
    "G=2 D=64 block 32 segment 256": (2, 64, 32, 256, [(130, 130), (63, 520), (1, 2), (0, 3)]),
}  # fmt: skip


def varlen_inputs(g, d, reqs, seed, hkv=2, shuffle=False):
    """Each request's q rows (the last ``rows`` positions of its ``keys``) and k/v."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks, vs, ps = [], [], [], []
    for n, s in reqs:
        qs.append(torch.randn(n, hkv * g, d, generator=gen).bfloat16())
        ks.append(torch.randn(s, hkv, d, generator=gen).bfloat16())
        vs.append(torch.randn(s, hkv, d, generator=gen).bfloat16())
        p = torch.arange(s - n, s)
        ps.append(p[torch.randperm(n, generator=gen)] if shuffle else p)
    return qs, ks, vs, ps


def varlen_pair(qs, ks, vs, ps, block, segment, dtype=torch.int64):
    """(one launch over all requests, each request through ``attention`` on its own)."""
    q_starts = torch.tensor([0, *torch.tensor([len(q) for q in qs]).cumsum(0).tolist()])
    k_starts = torch.tensor([0, *torch.tensor([len(k) for k in ks]).cumsum(0).tolist()])
    got = cuda_attn.attention_varlen(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(ps), q_starts.to(dtype),
        k_starts.to(dtype), max_rows=max(len(q) for q in qs), block=block, segment=segment,
    )  # fmt: skip
    want = [
        cuda_attn.attention(q, k, v, p, block=block, segment=segment, split=False)
        if len(q)
        else q.clone()
        for q, k, v, p in zip(qs, ks, vs, ps, strict=True)
    ]
    return got, torch.cat(want), q_starts


def check_varlen(out: dict) -> None:
    """attention_varlen's one launch against ``attention`` per request (the interpreter's dot
    is not the GPU's MMA, but both go through it alike: this checks the indexing)."""
    with attention_on_host():
        for i, (name, (g, d, block, segment, reqs)) in enumerate(VARLEN_CASES.items()):
            qs, ks, vs, ps = varlen_inputs(g, d, reqs, seed=40 + i, shuffle=i == 1)
            got, want, _ = varlen_pair(
                qs, ks, vs, ps, block, segment, torch.int32 if i % 2 else torch.int64
            )
            out[f"varlen: {name}"] = {"equal": same(got, want)}
        # The control: one key of request 2 one bf16 ulp up moves that request's rows only.
        g, d, block, segment, reqs = VARLEN_CASES["G=4 D=64 block 32 segment 64"]
        qs, ks, vs, ps = varlen_inputs(g, d, reqs, seed=40)
        base, _, starts = varlen_pair(qs, ks, vs, ps, block, segment)
        ks[2] = ks[2].clone()
        ks[2].view(torch.int16)[10, 1, 7] += 1
        got, want, _ = varlen_pair(qs, ks, vs, ps, block, segment)
        lo, hi = starts[2].item(), starts[3].item()
        rest = torch.cat([torch.arange(lo), torch.arange(hi, starts[-1].item())])
        out["control: one key of one request one bf16 ulp up"] = {
            "equal": same(got, want),
            "moved": not same(got[lo:hi], base[lo:hi]),
            "others_same": same(got[rest], base[rest]),
        }
        # The kernel's own checks (the host's set aside): rows that do not start at 0, and a
        # position past its request's keys, stop the kernel.
        q_starts, k_starts = starts.clone(), torch.tensor([0, 1, 10, 73, 77, 217])
        q_starts[0] = 1
        late = torch.cat(ps).clone()
        late[3] = 9  # request 1 (rows 1..5) has 9 keys
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        for name, (qs_, ps_) in {
            "offsets that skip row 0": (q_starts, torch.cat(ps)),
            "a position past its request's keys": (starts, late),
        }.items():
            stopped = varlen_stops(q, k, v, ps_, qs_, k_starts, block, segment)
            out[f"control: {name} stop the kernel"] = {"stopped": stopped}


def varlen_stops(q, k, v, positions, q_starts, k_starts, block, segment) -> bool:
    """Whether the one launch stops on its own check (``trap_if``), the host's set aside."""
    saved = cuda_attn.spans
    cuda_attn.spans = lambda *args: None
    try:
        cuda_attn.attention_varlen(
            q, k, v, positions, q_starts, k_starts, max_rows=65, block=block, segment=segment
        )
    except InterpreterError as err:  # the interpreter's failed assertion
        return "trap_if" in str(err)
    finally:
        cuda_attn.spans = saved
    return False


if __name__ == "__main__":
    results: dict = {}
    check_varlen(results)
    check_helpers(results)
    check_programs(results)
    check_plans(results)
    check_sampler(results)
    check_chunks(results)
    check_calls(results)
    check_paged(results)
    json.dump(results, sys.stdout)
