"""GPU benchmark: the cuda byte programs against the torch ops an engine would run.

Every ratio is measured in one run, on one GPU: ``speed = torch time / exact time`` (1.0 means
as fast as torch; above 1, faster). Times are medians of ``triton.testing.do_bench`` (CUDA
events, L2 flushed before each call); each side is timed three times, interleaved with the
other, and its smallest median kept: bursts of other work on the machine moved single timings
of one kernel by up to 4x within one run. Timing only: bytes are checked by
packages/shared-exact/tests/test_programs_gpu.py.

A decode step, a log_softmax over few rows and a prefill of 2048 tokens are short enough that
the host (Python, argument checks, launches) can take longer than the GPU: their rows are
timed twice, called eagerly and replayed from a CUDA graph (as a serving engine runs decode),
both sides the same way. A replay of one call still carries the host's replay time (about
3 us on the H200, where one tiny kernel replayed alone takes 4.7 us and 1.4 us among twenty):
the rows marked "graph x20" capture twenty calls in one graph and report the time per call,
as inside an engine's decode step, where every layer's attention shares one replay. The gemm
rows are also timed as twenty calls a replay, each on its own weight, as a model's layers run.

    PYTHONPATH=packages/shared-exact/src python3 tools/bench/bench_gpu.py [--sweep] [--json F]
        [--only gemm|attention|norms|moe] [--block 32]

The MoE rows (``--only moe``) time a decode step's expert kernels at 1 to 256 requests of
Qwen3-30B-A3B layer shape: the router and the expert plan against their torch forms, and each
grouped expert site against reading the touched experts' weights once (the floor of a
bandwidth-bound kernel); ``--sweep`` adds the grouped kernel's other forms (columns a program,
pipeline stages), each timed only where its bytes equal the default form's.

Targets: gemm >= 0.9x cuBLAS at M >= 1024 and M <= 128; attention >= 0.8x SDPA;
rmsnorm and log_softmax >= 1.0x torch.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lockstep_exact import programs as P
from lockstep_exact.programs import Program

# The contract's program parameters (programs.CATALOG), never restated here.
SEGMENT = Program.of("attention.blocked").param("segment")

BF16 = torch.bfloat16
F32 = torch.float32
# Qwen3-8B-like shapes: hidden 4096, 32 query heads and 8 kv heads of 128.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
# Qwen3-30B-A3B layer shapes: hidden 2048, 128 experts, top 8, expert intermediate 768; the
# expert sites' programs as the qwen3-moe lane's contract names them.
MOE_HIDDEN, MOE_EXPERTS, MOE_TOPK, MOE_INTER = 2048, 128, 8, 768
MOE_SITES = {  # site: (N, K, gemm.kpart partitions; 1 is gemm.kblock), bk 32
    "gate_proj": (MOE_INTER, MOE_HIDDEN, 1),
    "down_proj": (MOE_HIDDEN, MOE_INTER, 8),
}


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_bench(fn: Callable[[], object], calls: int = 1) -> float:
    """do_bench of a CUDA-graph replay of ``calls`` calls of ``fn`` (captured after two warm-up
    calls), per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return bench(graph.replay) / calls


# gemm rows in a graph: this many calls, each on its own weight (a model's layers).
GEMM_WEIGHTS = 20


def each_weight(ws: list, call: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    """A callable that runs ``call`` on the next weight of ``ws`` (cycling) at each call: a
    graph of len(ws) calls captures every weight once."""
    it = itertools.cycle(ws)
    return lambda: call(next(it))


# Decode rows: eager, one call a graph replay, twenty calls a replay (see the module text).
DECODE_MODES = (0, 1, 20)


def mode_label(graph: int) -> str:
    return "" if not graph else " graph" if graph == 1 else f" graph x{graph}"


def timed(fn: Callable[[], object], graph: int) -> float:
    """``graph``: 0 eager, else that many calls captured in one CUDA graph (time per call)."""
    return graph_bench(fn, int(graph)) if graph else bench(fn)


def rand(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def row(table, op, shape, exact, base, base_name, target=None, extra="", graph=0, reps=3):
    """``graph``: as ``timed``."""
    t_exact = t_base = float("inf")
    for _ in range(reps):  # interleaved; the smallest median of each side is kept
        t_exact = min(t_exact, timed(exact, graph))
        t_base = min(t_base, timed(base, graph))
    speed = t_base / t_exact
    met = "" if target is None else ("met" if speed >= target else "MISSED")
    table.append(
        {
            "op": op,
            "shape": shape,
            "exact_us": round(t_exact * 1e3, 2),
            "torch": base_name,
            "torch_us": round(t_base * 1e3, 2),
            "speed": round(speed, 3),
            "target": target,
            "status": met,
            "note": extra,
        }
    )
    print(
        f"{op:<14} {shape:<26} exact {t_exact * 1e3:9.2f} us  {base_name:<14} "
        f"{t_base * 1e3:9.2f} us  speed {speed:6.3f}x {met} {extra}",
        flush=True,
    )


def gemm_rows(table, bk, sweep, n=4096, ms=(1, 16, 128, 1024, 8192)):
    from lockstep_exact.programs import cuda

    gemm_mod = importlib.import_module("lockstep_exact.programs.cuda.gemm")

    k = 4096
    w = rand(n, k, scale=0.02)
    ws = [rand(n, k, scale=0.02) for _ in range(GEMM_WEIGHTS)]
    for m in ms:
        x = rand(m, k)
        if sweep:  # every tiling as the graph rows below time it (twenty weights a replay)
            ref = cuda.gemm(x, w, bk=bk, tiling="m128n256")
            times = {}
            for name in cuda.TILINGS:
                out = cuda.gemm(x, w, bk=bk, tiling=name)
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                times[name] = graph_bench(
                    each_weight(ws, lambda w, x=x, name=name: cuda.gemm(x, w, bk=bk, tiling=name)),
                    GEMM_WEIGHTS,
                )
                print(
                    f"  sweep gemm M={m} bk={bk} {name:<11} {times[name] * 1e3:8.2f} us same={same}"
                )
            t_ref = graph_bench(each_weight(ws, lambda w, x=x: torch.mm(x, w.t())), GEMM_WEIGHTS)
            print(
                f"  sweep gemm M={m} bk={bk} best {min(times, key=times.get)} "
                f"(cuBLAS {t_ref * 1e3:.2f} us)",
                flush=True,
            )
        flop = 2 * m * n * k
        t = bench(lambda x=x: P.gemm(x, w, bk=bk))
        tf = flop / (t * 1e-3) / 1e12
        pick = cuda.pick_tiling(m, n, gemm_mod.k_step(bk, k))
        target = 0.9 if m >= 1024 or m <= 128 else None
        row(table, "gemm", f"M={m} N={n} K=4096 bk={bk}", lambda x=x: P.gemm(x, w, bk=bk),
            lambda x=x: torch.mm(x, w.t()), "cuBLAS mm", target,
            f"{tf:.0f} TFLOP/s ({pick})")  # fmt: skip
        # The same product over twenty weights in one graph replay, as a model's layers run:
        # no host time (an eager call's Python and launch took 45-75 us on the H200 against
        # cuBLAS's 15-20, more than the kernel below ~1000 rows), and each weight is read
        # from memory as in a forward pass, not from L2 as twenty calls on one weight would.
        row(table, "gemm", f"M={m} N={n} K=4096 bk={bk} graph x20 (20 weights)",
            each_weight(ws, lambda w, x=x: P.gemm(x, w, bk=bk)),
            each_weight(ws, lambda w, x=x: torch.mm(x, w.t())), "cuBLAS mm", target,
            f"({pick})", graph=GEMM_WEIGHTS)  # fmt: skip


def attention_rows(table, block, sweep, t_len=2048, decode=True):
    sdpa = F.scaled_dot_product_attention
    q = rand(t_len, HEADS, HEAD_DIM)
    k = rand(t_len, KV_HEADS, HEAD_DIM)
    v = rand(t_len, KV_HEADS, HEAD_DIM)
    pos = torch.arange(t_len, device="cuda", dtype=torch.int32)
    g = HEADS // KV_HEADS
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks = k.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous()
    vs = v.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous()
    if sweep:  # the segment length is a program parameter: time the candidates
        for seg in (256, 512, 1024, 2048):
            tt = bench(lambda seg=seg: P.attention(q, k, v, pos, block=block, segment=seg))
            msg = f"  sweep attention block={block} segment={seg} prefill {tt * 1e3:8.2f} us"
            for s_len in (2048, 8192, 32768):
                kc = rand(s_len, KV_HEADS, HEAD_DIM)
                qd = rand(1, HEADS, HEAD_DIM)
                pd = torch.tensor([s_len - 1], device="cuda", dtype=torch.int32)
                td = graph_bench(
                    lambda qd=qd, kc=kc, pd=pd, seg=seg: P.attention(
                        qd, kc, kc, pd, block=block, segment=seg
                    )
                )
                tb = graph_bench(paged_case(s_len, 64, block, segment=seg)["exact"])
                msg += f" | S={s_len} decode {td * 1e3:.2f} us, 64 paged {tb * 1e3:.2f} us"
            print(msg + " (decode: graph replays)", flush=True)
    flop = 4 * HEADS * HEAD_DIM * t_len * (t_len + 1) / 2
    # Prefill rows, eager and as twenty calls a graph replay: the Hopper kernel's launch
    # (TMA descriptors, Gluon's launcher) took 60-110 us of host time on the H200, near the
    # kernel's own time at T = 2048, so the eager row can time the host
    for graph in (0, 20):
        t = timed(lambda: P.attention(q, k, v, pos, block=block, segment=SEGMENT), graph)
        row(
            table,
            "attention",
            f"prefill T={t_len} block={block}" + mode_label(graph),
            lambda: P.attention(q, k, v, pos, block=block, segment=SEGMENT),
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
            "SDPA causal",
            0.8,
            f"{flop / (t * 1e-3) / 1e12:.0f} TFLOP/s",
            graph=graph,
        )
    for s_len in (2048, 8192, 32768) if decode else ():
        kc = rand(s_len, KV_HEADS, HEAD_DIM)
        vc = rand(s_len, KV_HEADS, HEAD_DIM)
        qd = rand(1, HEADS, HEAD_DIM)
        pd = torch.tensor([s_len - 1], device="cuda", dtype=torch.int32)
        qds = qd.transpose(0, 1).unsqueeze(0).contiguous()
        kcs = kc.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous()
        vcs = vc.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0).contiguous()
        kgs = kc.transpose(0, 1).unsqueeze(0).contiguous()
        vgs = vc.transpose(0, 1).unsqueeze(0).contiguous()
        # Two references: SDPA over K/V repeated to the query heads (the older row), and SDPA
        # reading the kv heads once (enable_gqa), as the paged rows do; the second is faster.
        refs = (
            ("SDPA", lambda qds=qds, kcs=kcs, vcs=vcs: sdpa(qds, kcs, vcs)),
            ("SDPA (GQA)", lambda qds=qds, kgs=kgs, vgs=vgs: sdpa(qds, kgs, vgs, enable_gqa=True)),
        )

        def exact(qd=qd, kc=kc, vc=vc, pd=pd):
            return P.attention(qd, kc, vc, pd, block=block, segment=SEGMENT)

        for graph in DECODE_MODES:
            t = timed(exact, graph)
            gbs = 2 * kc.numel() * 2 / (t * 1e-3) / 1e9
            for name, ref in refs:
                row(
                    table,
                    "attention",
                    f"decode S={s_len} block={block}" + mode_label(graph),
                    exact,
                    ref,
                    name,
                    0.8,
                    f"{gbs:.0f} GB/s of KV",
                    graph=graph,
                )


def paged_case(s_len: int, batch: int, block: int, page: int = 32, segment: int = 512) -> dict:
    """A batch of one-token decodes over a paged cache (as the lane's vLLM decode step runs
    them): the exact program ``attention_decode_paged`` and SDPA over the same keys laid out
    [batch, kv heads, S, D] (GQA by ``enable_gqa``), and the program's arguments (``args``:
    q, key and value caches, block table, seq_lens, positions) for probes of other kernels."""
    from lockstep_exact.programs import cuda

    pages = s_len // page
    kc = rand(batch * pages, KV_HEADS, page, HEAD_DIM)
    vc = rand(batch * pages, KV_HEADS, page, HEAD_DIM)
    table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), s_len, device="cuda", dtype=torch.int32)
    pos = lens - 1
    q = rand(batch, HEADS, HEAD_DIM)

    def laid(c):
        return (
            c.view(batch, pages, KV_HEADS, page, HEAD_DIM)
            .permute(0, 2, 1, 3, 4)
            .reshape(batch, KV_HEADS, s_len, HEAD_DIM)
        )

    ks, vs, qs = laid(kc), laid(vc), q.unsqueeze(2)
    return {
        "exact": lambda: cuda.attention_decode_paged(
            q, kc, vc, table, lens, pos, max_seq_len=s_len, block=block, segment=segment
        ),
        "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
        "args": (q, kc, vc, table, lens, pos),
    }


def paged_decode_rows(table, block, batch):
    for s_len in (2048, 8192, 32768):
        case = paged_case(s_len, batch, block)
        for graph in DECODE_MODES:
            row(
                table,
                "attention",
                f"decode x{batch} paged S={s_len} block={block}" + mode_label(graph),
                case["exact"],
                case["sdpa"],
                "SDPA (GQA)",
                0.8,
                graph=graph,
            )
        del case


def norm_rows(table):
    for m in (1, 128, 8192):
        x = rand(m, HIDDEN)
        w = rand(HIDDEN) + 1.0

        def hf(x=x, w=w):  # Qwen3RMSNorm.forward
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h.to(BF16)

        row(table, "rmsnorm", f"M={m} H={HIDDEN}", lambda x=x, w=w: P.rmsnorm(x, w, 1e-6),
            lambda x=x, w=w: F.rms_norm(x, (HIDDEN,), w, 1e-6), "F.rms_norm", 1.0)  # fmt: skip
        row(table, "rmsnorm", f"M={m} H={HIDDEN}", lambda x=x, w=w: P.rmsnorm(x, w, 1e-6),
            hf, "HF Qwen3RMSNorm", 1.0)  # fmt: skip
    for m, vocab in ((1, 151936), (16, 151936), (256, 151936), (4096, 32768), (4096, 1024)):
        x = rand(m, vocab, dtype=F32, scale=4.0)
        # few long rows run as three short kernels: time them eagerly and from a graph
        for graph in (False, True) if m <= 16 else (False,):
            row(table, "log_softmax", f"M={m} V={vocab}" + (" graph" if graph else ""),
                lambda x=x: P.log_softmax(x), lambda x=x: torch.log_softmax(x, -1), "torch",
                1.0, graph=graph)  # fmt: skip


def grouped_forms(x, w, plan, parts, sweep):
    """(label, callable) of the grouped kernel's forms to time: the default, and with
    ``sweep`` every (columns a program, pipeline stages) pair whose bytes equal the default's
    on this input (a form that parts from them is reported, never timed)."""
    from lockstep_exact.programs.cuda import grouped as G

    size = x.shape[1] // parts
    n_dim = w.shape[1]

    def launch(block_n=None, stages=G._STAGES):
        y = torch.empty(plan.pairs, n_dim, dtype=BF16 if parts == 1 else F32, device="cuda")
        G._launch(x, w, y, plan.tiles, plan.pairs, plan.tiles.shape[0], size, 32, parts, 1,
                  block_n=block_n, stages=stages)  # fmt: skip
        return y

    forms = [("default", launch)]
    if sweep:
        want = launch()
        for block_n, stages in itertools.product((32, 64, 128), (2, 3, 4, 5)):
            label = f"BN={block_n} stages={stages}"
            fn = lambda b=block_n, st=stages: launch(b, st)  # noqa: E731
            try:
                same = torch.equal(fn(), want)
            except Exception as err:  # noqa: BLE001 -- a form Triton cannot build here
                print(f"grouped form {label}: not built ({type(err).__name__})", flush=True)
                continue
            if not same:
                print(f"grouped form {label}: BYTES DIFFER from the default; not timed")
                continue
            forms.append((label, fn))
    return forms


def moe_rows(table, sweep):
    """The MoE decode step's own kernels at 1 to 256 requests: the router against torch's
    softmax + topk, the expert plan against the torch plan (argsort), and each grouped expert
    site against reading the touched experts' weights once (``w[:touched].sum()``: the bytes a
    bandwidth-bound kernel must read, so speed is the fraction of that floor it reaches).
    Graph x20: twenty calls in one replay, as inside the engine's decode graph."""
    from lockstep_exact.programs import grouping

    for t in (1, 16, 64, 256):
        logits = rand(t, MOE_EXPERTS, scale=2.0)

        def base_router(lg=logits):
            w, ids = torch.topk(torch.softmax(lg.float(), -1), MOE_TOPK)
            return ids, (w / w.sum(-1, keepdim=True)).to(BF16)

        for graph in (0, 20):
            row(table, "router", f"T={t} E={MOE_EXPERTS} k={MOE_TOPK}" + mode_label(graph),
                lambda lg=logits: P.router_topk(lg, MOE_TOPK), base_router,
                "torch softmax+topk", graph=graph)  # fmt: skip
        ids, _ = P.router_topk(logits, MOE_TOPK)
        row(table, "expert_plan", f"T={t} E={MOE_EXPERTS} k={MOE_TOPK}" + mode_label(20),
            lambda i=ids: P.expert_plan(i, MOE_EXPERTS),
            lambda i=ids: grouping.expert_plan(i, MOE_EXPERTS), "torch plan", graph=20)  # fmt: skip
        plan = P.expert_plan(ids, MOE_EXPERTS)
        touched = int(torch.unique(ids).numel())
        for site, (n_dim, k_dim, parts) in MOE_SITES.items():
            w = rand(MOE_EXPERTS, n_dim, k_dim, scale=0.02)
            x = rand(plan.pairs, k_dim)
            floor = w[:touched]
            for label, fn in grouped_forms(x, w, plan, parts, sweep):
                row(table, f"grouped {site}",
                    f"T={t} pairs={plan.pairs} experts={touched} {label}" + mode_label(20),
                    fn, lambda f=floor: f.sum(), "read W once", graph=20,
                    extra=f"{floor.numel() * 2 / 1e6:.0f} MB")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time every gemm tiling, attention segment and grouped-expert form",
    )
    ap.add_argument("--only", default="", help="gemm, attention, norms or moe")
    ap.add_argument(
        "--block", type=int, action="append", help="attention key blocks to time (default: all)"
    )
    ap.add_argument("--json", default="", help="write the table here")
    args = ap.parse_args()
    from lockstep_exact.programs import cuda

    torch.manual_seed(0)
    env = cuda.environment()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp} {env}", flush=True)
    table: list[dict] = []
    if args.only in ("", "gemm"):
        for bk in (32, 64):
            gemm_rows(table, bk, args.sweep)
            gemm_rows(table, bk, args.sweep, n=12288, ms=(1, 64, 512, 4096))
    if args.only in ("", "attention"):
        for block in args.block or (32, 64, 128):
            attention_rows(table, block, args.sweep)
            if block == 32:  # the lanes' block
                attention_rows(table, block, False, t_len=8192, decode=False)
            for batch in (1, 64):  # the lane's decode step (vLLM, SGLang) is the paged one
                paged_decode_rows(table, block, batch)
    if args.only in ("", "norms"):
        norm_rows(table)
    if args.only in ("", "moe"):
        moe_rows(table, args.sweep)
    print("\n| op | shape | exact (us) | torch op | torch (us) | speed | target | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        tgt = "" if r["target"] is None else f">= {r['target']}x"
        print(
            f"| {r['op']} | {r['shape']} | {r['exact_us']} | {r['torch']} | {r['torch_us']} "
            f"| {r['speed']}x | {tgt} {r['status']} | {r['note']} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": stamp, "env": env, "rows": table}, fh, indent=1)


if __name__ == "__main__":
    main()
