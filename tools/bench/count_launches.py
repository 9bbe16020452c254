"""Torch operations per call of the hybrid lane's programs, as the cuda backend launches them.

On cuda every torch operation is a kernel launch. The hybrid programs used to run on cuda as the
cpu code op by op; they are now one Triton kernel each, and gdn.chunked keeps the cpu code's
calls and state around a one-kernel chunk pass. This counts, on the host, the torch operations of
the op-by-op form (the cpu code) and, for gdn.chunked, the torch operations left around the
chunk passes (views, which launch nothing, are not counted). Shapes: one GDN layer of
Qwen3-Next-80B (Hk 16, Hv 32, K = V = 128, chunk 64, hidden 2048, conv width 4).

    uv run python tools/bench/count_hybrid_launches.py
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lockstep_exact.programs import grouping
from lockstep_exact.programs.cpu import gdn, hybrid, moe

_VIEWS = {
    "view", "slice", "select", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze",
    "alias", "_unsafe_view", "as_strided", "detach", "lift_fresh",
}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.passes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEWS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> _Count:
    with _Count() as c:
        fn(c)
    return c


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, c, hidden = 16, 32, 128, 128, 64, 2048
    b16 = torch.bfloat16

    def rows(t):
        q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=gen), dim=-1)
        v = torch.randn(t, hv, dv, generator=gen).to(b16)
        return q, k, v, -torch.rand(t, hv, generator=gen) * 0.1, torch.rand(t, hv, generator=gen)

    def one_pass(counter):
        def chunk_pass(*args):
            with _disable_current_modes():
                out = gdn._chunk_heads(*args)
            counter.passes += 1
            return out

        return chunk_pass

    print("| program | call | op by op (torch ops) | kernel form (torch ops + kernels) |")
    print("| --- | --- | --- | --- |")
    for t, at in ((512, 0), (1, 0), (1, 30)):
        state = gdn.gdn_state(hk, hv, dk, dv, chunk=c)
        if at:
            _, state = gdn.gdn_chunked(*rows(at), state, position=0, chunk=c)
        args = rows(t)
        gdn.default_scale(dk)  # made once per process in both forms
        before = count(
            lambda _c, a=args, s=state, p=at: gdn.run_chunks(
                gdn._chunk_heads, *a, s, position=p, chunk=c
            )
        )
        after = count(
            lambda cn, a=args, s=state, p=at: gdn.run_chunks(
                one_pass(cn), *a, s, position=p, chunk=c
            )
        )
        what = f"{t} tokens from position {at}"
        print(f"| gdn.chunked | {what} | {before.ops} | {after.ops} + {after.passes} |")
    x = torch.randn(1, hv, dv, generator=gen).to(b16)
    d = 2 * hk * dk + hv * dv
    others = {
        "gdn.gating": lambda _c: gdn.gdn_gating(
            x[:, :, 0], x[:, :, 1], torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
        ),
        "gdn.l2norm": lambda _c: gdn.l2norm(x[:, :hk]),
        "conv1d.causal": lambda _c: gdn.conv1d_causal(
            torch.randn(1, d, generator=gen).to(b16),
            torch.randn(d, 4, generator=gen).to(b16),
            torch.zeros(3, d, dtype=b16),
        ),
        "rmsnorm.gated": lambda _c: hybrid.rmsnorm_gated(x, x, x[0, 0], 1e-6),
        "rmsnorm.zero_centered": lambda _c: hybrid.rmsnorm_zero_centered(
            x.reshape(1, -1)[:, :hidden], x.reshape(-1)[:hidden], 1e-6
        ),
        "gate.sigmoid": lambda _c: hybrid.sigmoid_gate(x, x),
        "moe.shared_gate": lambda _c: hybrid.shared_expert_gate(
            x.reshape(1, -1)[:, :hidden], x.reshape(1, -1)[:, :hidden], x[:, :1, 0]
        ),
    }
    t, e, k = 64, 128, 8
    logits = torch.randn(t, e, generator=gen).to(b16)
    ids, weights = moe.router_topk(logits, k)
    y = torch.randn(t, k, hidden, generator=gen).to(b16)
    others["router.softmax_topk (64 rows)"] = lambda _c: moe.router_topk(logits, k)
    others["expert plan (64 rows)"] = lambda _c: grouping.expert_plan(ids, e)
    others["moe.fold (64 rows)"] = lambda _c: moe.moe_fold(y, weights)
    around = {"conv1d.causal": "2 (the window joined, the next window copied) + 1"}
    for name, fn in others.items():
        call = "64 rows" if "64 rows" in name else "one token"
        name = name.replace(" (64 rows)", "")
        print(f"| {name} | {call} | {count(fn).ops} | {around.get(name, '1 kernel')} |")


if __name__ == "__main__":
    main()
