"""Run the cuda backend's gdn.chunked kernel in Triton's interpreter on cpu tensors and compare
its bytes with the cpu program's (``test_interpret.py`` runs this in a Python that has Triton).

The interpreter executes each Triton operation with numpy on the host: fp32 ``+ - *`` are IEEE
there, so equal bytes mean the kernel performs the cpu program's operations in its order
(trees, chains, the exp construction). It says nothing of the GPU's own arithmetic (contraction,
denormals): the GPU suite compares the kernel's cuda bytes with the cpu bytes on the device.

Prints one JSON object: case name -> {"equal": bool, ...}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lockstep_exact.programs.cpu import gdn as cpu_gdn  # noqa: E402
from lockstep_exact.programs.cpu.arith import exp  # noqa: E402
from lockstep_exact.programs.cuda import gdn as kernel  # noqa: E402
from lockstep_exact.testing import nudge_ulp  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


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


@triton.jit
def _exp_kernel(x_ptr, o_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(o_ptr + offs, kernel._exp(tl.load(x_ptr + offs)))


def check_exp(out: dict) -> None:
    edges = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 0.5, -0.5, 1.5, -1.5]
    edges += [88.72283172607421875, -103.97208404541015625, 89.0, -104.0, -87.5, -100.0]
    spread = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * 30
    x = torch.cat([torch.linspace(-120.0, 100.0, 30000), spread, torch.tensor(edges)])
    width = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(width - x.numel())])
    got = torch.empty_like(x)
    _exp_kernel[(1,)](x, got, width)
    out["exp: the cpu exp's bytes"] = {"equal": same(got, exp(x))}


if __name__ == "__main__":
    results: dict = {}
    check_exp(results)
    check_chunks(results)
    check_calls(results)
    json.dump(results, sys.stdout)
