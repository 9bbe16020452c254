"""A measurement probe, not a program: the paged decode's segment in two passes.

The one-request decode misses its target at 2048 keys: each program walks its segment's 16
key blocks in one chain (QK product, row max, exps, row sum, rescale, PV product). This probe
splits that chain. The online softmax's running max is a max, which is exact in any order, so
every block's max, alpha = exp(m_before - m_after), P = exp(s - m_after) and row sum can be
computed before any PV product:
- pass A takes W blocks a step in one QK product of W * block keys, one warpgroup's columns
  per block (``num_warps`` = 4 W), so each block's row reductions run inside one warpgroup in
  the 64-row tile's layout (the program's reduction order). The running max across the W
  blocks is taken with masked maxes. P (bf16), alpha and the row sums go to global scratch;
- pass B runs only the accumulator's chain, one block a step:
  l = l * alpha + rowsum, acc = PV(P, V, acc * alpha), with the PV product's columns split
  over the warpgroups.

Each value is the program's op on the program's operands, so the bytes are the committed
kernel's (checked here against ``attention_decode_paged`` on every case, with a one-ulp
control). Timing-only flags: ``skip`` 1 runs pass B alone (on stale scratch), 2 pass A alone;
``noal`` drops pass B's alpha and row-sum loads (other bytes).

    PYTHONPATH=packages/shared-exact/src python3 tools/bench/decode_split.py [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
import triton
import triton.language as tl
from bench_gpu import graph_bench, paged_case

from lockstep_exact import programs as P
from lockstep_exact.programs.cuda.arith import BF16, EXACT, F32

A = importlib.import_module("lockstep_exact.programs.cuda.attention")


@triton.jit
def _block_at(
    base, kpos, kv_lim, pad, held, first, bt, stride_ks, stride_vs, stride_kp, stride_vp,
    PAGE: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, VALUES: tl.constexpr,
):  # fmt: skip
    """The K (or, ``VALUES``, V) rows of key positions ``kpos`` from ``base``, zeros at and past
    ``kv_lim``; pages from the held table entries, or looked up."""
    ok = kpos < kv_lim
    kq = tl.where(ok, kpos, pad)
    if NP > 0:
        page = tl.gather(held, kq // PAGE - first, 0)
        k_row, v_row = A._rows_in(page, kq, stride_ks, stride_vs, stride_kp, stride_vp, PAGE)
    else:
        k_row, v_row = A._page_rows(kq, bt, stride_ks, stride_vs, stride_kp, stride_vp, PAGE)
    row = v_row if VALUES else k_row
    return tl.load(base + row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, pos_ptr, stride_p, seq_lens_ptr, stride_sl, reach,
    m_buf, l_buf, a_buf, p_buf, al_buf, rs_buf, n_kv_heads, scale,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
    stride_bt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG_BLOCKS: tl.constexpr, SEG: tl.constexpr, PAGE: tl.constexpr, NP: tl.constexpr,
    W: tl.constexpr, SKIP: tl.constexpr, NOAL: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    s_idx = tl.program_id(2)
    p, kv_len = A._decode_pos(pos_ptr, stride_p, seq_lens_ptr, stride_sl, r, reach)
    if s_idx * SEG <= p:
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G
        offs_d = tl.arange(0, D)
        q_src = q_ptr + r * stride_qt + (h * G + rows)[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_src, mask=row_ok[:, None], other=0.0)
        kv_lim = tl.minimum(kv_len, p + 1)
        j_lo = s_idx * SEG_BLOCKS
        j_hi = tl.minimum(j_lo + SEG_BLOCKS, p // BLOCK_N + 1)
        k_base = kc_ptr + h * stride_kh
        v_base = vc_ptr + h * stride_vh
        bt = bt_ptr + r.to(tl.int64) * stride_bt
        prog = ((r * n_kv_heads + h) * tl.num_programs(2) + s_idx).to(tl.int64)
        # scratch of this program, indexed by absolute block
        p_base = p_buf + prog * (SEG_BLOCKS * G * BLOCK_N) - j_lo * (G * BLOCK_N)
        al_base = al_buf + prog * (SEG_BLOCKS * G) - j_lo * G
        rs_base = rs_buf + prog * (SEG_BLOCKS * G) - j_lo * G
        offs_n = tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, W * BLOCK_N)
        offs_i = tl.arange(0, W)
        first = (j_lo * BLOCK_N) // PAGE
        held = first  # a placeholder without held entries
        if NP > 0:
            at = first + tl.arange(0, NP)
            held = tl.load(bt + at, mask=at <= (kv_lim - 1) // PAGE, other=0)
        upto = (offs_i[None, :] <= offs_i[:, None])[None, :, :]  # [., i, i']: i' <= i
        before = (offs_i[None, :] < offs_i[:, None])[None, :, :]
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        # pass A: every block's max, alpha, P and row sum, W blocks a QK product
        for c in range(j_lo, j_hi if SKIP != 1 else j_lo, W):
            kpos = c * BLOCK_N + offs_w
            k = _block_at(
                k_base, kpos, kv_lim, j_lo * BLOCK_N, held, first, bt, stride_ks, stride_vs,
                stride_kp, stride_vp, PAGE, NP, D, False,
            )  # fmt: skip
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(kpos[None, :] <= p, s, float("-inf"))
            s3 = tl.reshape(s, [BLOCK_M, W, BLOCK_N])
            bm = tl.max(s3, 2)[:, None, :]  # [M, ., i']: each block's row max
            m_in = tl.maximum(m[:, None], tl.max(tl.where(upto, bm, float("-inf")), 2))
            m_ex = tl.maximum(m[:, None], tl.max(tl.where(before, bm, float("-inf")), 2))
            alpha = tl.exp(m_ex - m_in)
            pr = tl.exp(s3 - m_in[:, :, None])
            rs = tl.sum(pr, 2)
            m = tl.max(m_in, 1)
            blk = c + offs_i
            dst = p_base + blk[None, :, None] * (G * BLOCK_N) + rows[:, None, None] * BLOCK_N
            tl.store(dst + offs_n[None, None, :], pr.to(tl.bfloat16), mask=row_ok[:, None, None])
            at2 = blk[None, :] * G + rows[:, None]
            tl.store(al_base + at2, alpha, mask=row_ok[:, None])
            tl.store(rs_base + at2, rs, mask=row_ok[:, None])
        tl.debug_barrier()
        # pass B: the accumulator's chain; alpha and the row sum loaded one block ahead
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        al_n = tl.load(al_base + j_lo * G + rows, mask=row_ok, other=1.0, cache_modifier=".cg")
        rs_n = tl.load(rs_base + j_lo * G + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        for j in range(j_lo, j_hi if SKIP != 2 else j_lo):
            alpha = al_n
            rsj = rs_n
            if NOAL == 0:
                nxt = row_ok & (j + 1 < j_hi)
                at1 = al_base + (j + 1) * G + rows
                al_n = tl.load(at1, mask=nxt, other=1.0, cache_modifier=".cg")
                at1 = rs_base + (j + 1) * G + rows
                rs_n = tl.load(at1, mask=nxt, other=0.0, cache_modifier=".cg")
            kpos = j * BLOCK_N + offs_n
            v = _block_at(
                v_base, kpos, kv_lim, j_lo * BLOCK_N, held, first, bt, stride_ks, stride_vs,
                stride_kp, stride_vp, PAGE, NP, D, True,
            )  # fmt: skip
            pj = p_base + j * (G * BLOCK_N) + rows[:, None] * BLOCK_N + offs_n[None, :]
            pj = tl.load(pj, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            l_sum = l_sum * alpha + rsj
            acc = tl.dot(pj, v, acc * alpha[:, None])
        at = (s_idx * n_kv_heads + h) * (tl.num_programs(0) * G) + r * G + rows
        tl.store(m_buf + at, m, mask=row_ok)
        tl.store(l_buf + at, l_sum, mask=row_ok)
        tl.store(a_buf + at[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


def decode_split(
    q, key_cache, value_cache, block_table, seq_lens, positions, *, max_seq_len, block=32,
    segment=512, w=4, skip=0, noal=0,
):  # fmt: skip
    """``attention_decode_paged`` (no input checks) with the segment split in two passes."""
    n, h_q, d = q.shape
    _, h_kv, page, _ = key_cache.shape
    g = h_q // h_kv
    seg_blocks = segment // block
    assert seg_blocks % w == 0, "W must divide the segment's blocks"
    n_seg = triton.cdiv(max_seq_len, segment)
    reach = min(block_table.shape[1] * page, n_seg * segment)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    m_buf = torch.empty(n_seg, h_kv, n * g, dtype=F32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    a_buf = torch.empty(n_seg, h_kv, n * g, d, dtype=F32, device=q.device)
    n_prog = n * h_kv * n_seg
    p_buf = torch.empty(n_prog, seg_blocks, g, block, dtype=BF16, device=q.device)
    al_buf = torch.empty(n_prog, seg_blocks, g, dtype=F32, device=q.device)
    rs_buf = torch.empty_like(al_buf)
    # two stages where one K step of W blocks and the ring would pass shared memory
    stages = 2 if w * block * d > 16384 else 3
    _split_kernel[(n, h_kv, n_seg)](
        qc, key_cache, value_cache, block_table, positions, positions.stride(0), seq_lens,
        seq_lens.stride(0), reach, m_buf, l_buf, a_buf, p_buf, al_buf, rs_buf, h_kv,
        A._default_scale(d), qc.stride(0), qc.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), block_table.stride(0),
        G=g, D=d, BLOCK_M=64, BLOCK_N=block, SEG_BLOCKS=seg_blocks, SEG=segment, PAGE=page,
        NP=A._table_held(segment, page, 64), W=w, SKIP=skip, NOAL=noal, num_warps=4 * w,
        num_stages=stages, **EXACT,
    )  # fmt: skip
    A._combine(out, positions, m_buf, l_buf, a_buf, g, segment, seq_lens, reach)
    return out


def _randn(*shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(BF16)


def _paged(lens, page, seed, h_kv, d):
    """Requests of ``lens`` keys on shuffled pages of one cache (NaN/inf elsewhere)."""
    pages = [-(-n // page) for n in lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).cuda()
    kv = torch.full((num_blocks, h_kv, page, 2 * d), float("nan"), dtype=BF16, device="cuda")
    kv[..., d:] = float("inf")
    kc, vc = kv[..., :d], kv[..., d:]
    table = torch.zeros(len(lens) + 2, max(pages) + 2, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(lens):
        ids = perm[at : at + pages[i]]
        at += pages[i]
        table[i, : pages[i]] = ids.int()
        t = torch.arange(n, device="cuda")
        kc[ids[t // page], :, t % page] = _randn(n, h_kv, d, seed=seed + 7 * i)
        vc[ids[t // page], :, t % page] = _randn(n, h_kv, d, seed=seed + 7 * i + 1)
    return kc, vc, table


LENS = (1, 31, 32, 33, 100, 511, 512, 513, 2047, 2048, 2049, 3000, 4100)
# (page, block, query heads per kv head, head size, segment, positions)
CASES = [
    (16, 32, 4, 128, 512, "end"), (32, 32, 4, 128, 512, "end"), (64, 32, 4, 128, 512, "end"),
    (48, 32, 4, 128, 512, "end"), (8, 32, 4, 128, 512, "end"), (16, 64, 4, 128, 512, "end"),
    (32, 32, 16, 128, 512, "end"), (16, 32, 64, 128, 512, "end"), (32, 32, 4, 64, 512, "end"),
    (32, 32, 8, 256, 512, "end"), (32, 32, 1, 128, 512, "end"), (32, 32, 3, 128, 512, "mid"),
    (32, 32, 4, 128, 256, "end"), (32, 32, 4, 128, 128, "mid"), (16, 16, 4, 128, 512, "end"),
    (32, 32, 4, 128, 1024, "mid"),
]  # fmt: skip


def _bits(x):
    return x.view(torch.int16)


def check_bytes(w: int) -> list[dict]:
    rows = []
    for page, block, g, d, seg, kind in CASES:
        h_kv = 2
        kc, vc, table = _paged(LENS, page, seed=page + block + g, h_kv=h_kv, d=d)
        n = len(LENS)
        q = _randn(n + 2, h_kv * g, d, seed=99)
        seq = torch.tensor(list(LENS) + [0, 0], dtype=torch.int32, device="cuda")
        at = [m - 1 if kind == "end" else (m - 1) * 2 // 3 for m in LENS]
        pos = torch.tensor(at + [0, 0], device="cuda")
        kw = dict(max_seq_len=4200, block=block, segment=seg)
        want = P.attention_decode_paged(q, kc, vc, table, seq, pos, **kw)
        got = decode_split(q, kc, vc, table, seq, pos, w=w, **kw)
        bad = [i for i in range(n) if not torch.equal(_bits(got[i]), _bits(want[i]))]
        moved = q.clone()
        flat = moved[3].view(-1)
        top = int(q[3].float().abs().argmax())
        flat[top] = (flat[top].view(torch.int16) + 1).view(BF16)
        other = decode_split(moved, kc, vc, table, seq, pos, w=w, **kw)
        control = not torch.equal(_bits(other[3]), _bits(got[3])) and torch.equal(
            _bits(other[:3]), _bits(got[:3])
        )
        row = dict(w=w, page=page, block=block, g=g, d=d, segment=seg, positions=kind)
        row.update(equal=not bad, bad=bad, control=control)
        print(row, flush=True)
        rows.append(row)
    return rows


VARIANTS = {
    "split W=4 (16 warps)": dict(w=4),
    "split W=2 (8 warps)": dict(w=2),
    "split W=1 (4 warps)": dict(w=1),
    "pass B alone, W=1 (timing only)": dict(w=1, skip=1),
    "pass B alone, W=1, no alpha/sum loads (timing only)": dict(w=1, skip=1, noal=1),
    "pass A alone, W=4 (timing only)": dict(w=4, skip=2),
    "pass A alone, W=1 (timing only)": dict(w=1, skip=2),
}


def times(s_len: int, batch: int) -> dict:
    case = paged_case(s_len, batch, 32)
    q, kc, vc, table, lens, pos = case["args"]
    fns = {"program": case["exact"], "SDPA (GQA)": case["sdpa"]}
    for name, kw in VARIANTS.items():
        fns[name] = lambda kw=kw: decode_split(q, kc, vc, table, lens, pos, max_seq_len=s_len, **kw)
    want = _bits(fns["program"]())
    row = {"S": s_len, "batch": batch}
    for name, fn in fns.items():
        if name.startswith("split"):
            row[name + ": same bytes"] = torch.equal(_bits(fn()), want)
        row[name] = [round(1000 * min(graph_bench(fn, c) for _ in range(3)), 2) for c in (1, 20)]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    res = {"bytes": check_bytes(4) + check_bytes(2) + check_bytes(1), "times": []}
    for s_len, batch in ((2048, 1), (8192, 1), (32768, 1), (2048, 64)):
        res["times"].append(times(s_len, batch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
