"""Micro-benchmark: each cpu byte program against the plain torch op on the same shapes.

Prints one table with both times and the ratio (exact / torch), all measured in one run.
Shapes follow a small Qwen3 (hidden 1024, 16 query / 8 kv heads of 128, intermediate 3072).
Timing only: bytes are checked by the tests, never here.

    uv run python tools/bench/bench_programs.py [--quick] [--threads N] [--only NAME]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockstep_exact import programs as P
from lockstep_exact.programs import Program

# The contract's program parameters (programs.CATALOG), never restated here.
BK = Program.of("gemm.kblock").param("bk")
BLOCK = Program.of("attention.blocked").param("block")
EXPAND_BK = Program.of("lora.expand").param("bk")
SEGMENT = Program.of("attention.blocked").param("segment")
SHRINK_BK = Program.of("lora.shrink").param("bk")

BF16 = torch.bfloat16
F32 = torch.float32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
EXPERTS, TOPK, RANK = 128, 8, 16


@dataclass
class Case:
    program: str
    shape: str
    exact: Callable[[], object]
    torch: Callable[[], object]


def rand(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# --- torch baselines that are more than one call ------------------------------------------------
def qwen3_rmsnorm(x, weight, eps):
    """transformers' Qwen3RMSNorm.forward."""
    h = x.to(F32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def rope_tables_torch(base, dim, n_pos):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=F32) / dim))
    theta = torch.arange(n_pos, dtype=F32)[:, None] * inv_freq[None, :]
    return torch.cos(theta), torch.sin(theta)


def rope_torch(x, positions, cos_t, sin_t):
    cos = torch.cat([cos_t[positions]] * 2, dim=-1)[:, None, :]
    sin = torch.cat([sin_t[positions]] * 2, dim=-1)[:, None, :]
    xf = x.to(F32)
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def sdpa(q, k, v, causal):
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, enable_gqa=True
    )
    return out.transpose(0, 1)


def router_torch(logits, k):
    p = torch.softmax(logits.to(F32), dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(BF16)


# --- the cases ----------------------------------------------------------------------------------
def cases() -> list[Case]:
    out: list[Case] = []
    for n, k in ((128, 128), (1024, 128)):
        w = rand(n, k)
        for m in (1, 8, 64, 512):
            x = rand(m, k)
            out.append(
                Case(
                    "gemm.kblock",
                    f"M={m} N={n} K={k}",
                    lambda x=x, w=w: P.gemm(x, w, bk=BK),
                    lambda x=x, w=w: F.linear(x, w),
                )
            )

    nw = (1 + 0.1 * torch.randn(HIDDEN)).to(BF16)
    for t in (8, 512):
        x = rand(t, HIDDEN, scale=3.0)
        out.append(
            Case(
                "rmsnorm.qwen3",
                f"T={t} H={HIDDEN}",
                lambda x=x: P.rmsnorm(x, nw, 1e-6),
                lambda x=x: qwen3_rmsnorm(x, nw, 1e-6),
            )
        )

    a, b = rand(512, HIDDEN), rand(512, HIDDEN)
    out.append(
        Case(
            "residual.add",
            f"T=512 H={HIDDEN}",
            lambda: P.residual_add(a, b),
            lambda: a + b,
        )
    )

    for t in (8, 512):
        g, u = rand(t, INTER, scale=3.0), rand(t, INTER)
        out.append(
            Case(
                "swiglu",
                f"T={t} I={INTER}",
                lambda g=g, u=u: P.swiglu(g, u),
                lambda g=g, u=u: F.silu(g) * u,
            )
        )

    for v in (1024, 32000):
        logits = rand(64, v, dtype=F32, scale=5.0)
        out.append(
            Case(
                "softmax.tree",
                f"T=64 V={v}",
                lambda z=logits: P.softmax(z),
                lambda z=logits: torch.softmax(z, dim=-1),
            )
        )
        out.append(
            Case(
                "log_softmax.tree",
                f"T=64 V={v}",
                lambda z=logits: P.log_softmax(z),
                lambda z=logits: torch.log_softmax(z, dim=-1),
            )
        )

    cos_t, sin_t = rope_tables_torch(1e6, HEAD_DIM, 4096)
    for t, positions in ((1, torch.tensor([1000])), (256, torch.arange(256))):
        x = rand(t, HEADS, HEAD_DIM)
        out.append(
            Case(
                "rope.neox",
                f"T={t} H={HEADS} D={HEAD_DIM}",
                lambda x=x, p=positions: P.rope(x, p, 1e6),
                lambda x=x, p=positions: rope_torch(x, p, cos_t, sin_t),
            )
        )

    geometry = f"Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}"
    q, k, v = (
        rand(256, HEADS, HEAD_DIM),
        rand(256, KV_HEADS, HEAD_DIM),
        rand(256, KV_HEADS, HEAD_DIM),
    )
    out.append(
        Case(
            "attention.blocked",
            f"prefill T=256 {geometry}",
            lambda: P.attention(q, k, v, torch.arange(256), block=BLOCK, segment=SEGMENT),
            lambda: sdpa(q, k, v, causal=True),
        )
    )
    for s in (256, 1024):
        q1 = rand(1, HEADS, HEAD_DIM)
        kc, vc = rand(s, KV_HEADS, HEAD_DIM), rand(s, KV_HEADS, HEAD_DIM)
        out.append(
            Case(
                "attention.blocked",
                f"decode S={s} {geometry}",
                lambda q1=q1, kc=kc, vc=vc, s=s: P.attention(
                    q1, kc, vc, torch.tensor([s - 1]), block=BLOCK, segment=SEGMENT
                ),
                lambda q1=q1, kc=kc, vc=vc: sdpa(q1, kc, vc, causal=False),
            )
        )

    for t in (64, 512):
        logits = rand(t, EXPERTS, scale=2.0)
        out.append(
            Case(
                "router.softmax_topk",
                f"T={t} E={EXPERTS} k={TOPK}",
                lambda z=logits: P.router_topk(z, TOPK),
                lambda z=logits: router_torch(z, TOPK),
            )
        )

    y, wt = rand(64, TOPK, HIDDEN), rand(64, TOPK).abs()
    for acc in ("bf16", "fp32"):
        out.append(
            Case(
                f"moe.fold acc={acc}",
                f"T=64 k={TOPK} H={HIDDEN}",
                lambda acc=acc: P.moe_fold(y, wt, acc=acc),
                lambda: (y * wt[..., None]).sum(dim=1),
            )
        )

    lora_a, lora_b = rand(RANK, HIDDEN, scale=0.1), rand(HIDDEN, RANK, scale=0.1)
    for t in (8, 512):
        x, base = rand(t, HIDDEN), rand(t, HIDDEN)
        r = P.lora_shrink(x, lora_a, bk=SHRINK_BK)
        out.append(
            Case(
                "lora.shrink",
                f"T={t} K={HIDDEN} r={RANK}",
                lambda x=x: P.lora_shrink(x, lora_a, bk=SHRINK_BK),
                lambda x=x: F.linear(x, lora_a),
            )
        )
        out.append(
            Case(
                "lora.expand",
                f"T={t} N={HIDDEN} r={RANK}",
                lambda base=base, r=r: P.lora_expand(base, r, lora_b, 2.0, bk=EXPAND_BK),
                lambda base=base, r=r: base + F.linear(r, lora_b) * 2.0,
            )
        )
    return out


# --- timing -------------------------------------------------------------------------------------
def seconds_per_call(fn: Callable[[], object], reps: int, warmup: int, target: float) -> float:
    """Median over ``reps`` of the mean time of a batch of calls sized to last about ``target``."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    inner = max(1, math.ceil(target / max(once, 1e-9)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for entry in f:
                if entry.startswith("model name"):
                    return entry.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="fewer reps, shorter batches")
    parser.add_argument("--only", default="", help="run programs whose name contains this")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reps, warmup, target = (3, 1, 0.01) if args.quick else (9, 3, 0.05)
    selected = [c for c in cases() if args.only in c.program]
    if not selected:
        parser.error(f"no program name contains {args.only!r}")

    print(
        f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"python {platform.python_version()}, {cpu_model()}"
    )
    print(f"# median of {reps} reps (warmup {warmup}), each rep >= {target * 1e3:.0f} ms of calls")
    print()
    w_prog = max(len("program"), *(len(c.program) for c in selected))
    w_shape = max(len("shape"), *(len(c.shape) for c in selected))

    def line(program, shape, exact, stock, ratio):
        return (
            f"| {program:<{w_prog}} | {shape:<{w_shape}} | {exact:>9} | {stock:>9} | {ratio:>11} |"
        )

    print(line("program", "shape", "exact ms", "torch ms", "exact/torch"))
    print(f"|{'-' * (w_prog + 2)}|{'-' * (w_shape + 2)}|{'-' * 10}:|{'-' * 10}:|{'-' * 12}:|")
    for case in selected:
        exact = seconds_per_call(case.exact, reps, warmup, target)
        stock = seconds_per_call(case.torch, reps, warmup, target)
        ratio = f"{exact / stock:.1f}x"
        print(line(case.program, case.shape, fmt_ms(exact), fmt_ms(stock), ratio), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
