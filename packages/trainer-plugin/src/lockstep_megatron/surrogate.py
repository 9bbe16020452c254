"""Exact forward, standard-math backward: one autograd Function for every op site.

``exact(program, ideal, *inputs)`` returns the byte program's output in the forward; in the
backward it recomputes ``ideal`` (the textbook op) on fp32 copies of the inputs and returns
its vector-Jacobian product, cast to each input's dtype. So the forward bytes are the
contract's and the gradient is the gradient of the op the program approximates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lockstep_exact import programs as P
from lockstep_exact.programs.cpu import rope_tables

F32 = torch.float32


class _Exact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program, ideal, *xs):
        ctx.ideal = ideal
        ctx.save_for_backward(*xs)
        with torch.no_grad():
            return program(*xs)

    @staticmethod
    def backward(ctx, grad):
        xs = ctx.saved_tensors
        wanted = [i for i, x in enumerate(xs) if ctx.needs_input_grad[i + 2]]
        grads: list[torch.Tensor | None] = [None] * len(xs)
        if wanted:
            with torch.enable_grad():
                xf = [x.detach().to(F32) if x.is_floating_point() else x for x in xs]
                for i in wanted:
                    xf[i].requires_grad_(True)
                out = ctx.ideal(*xf)
                got = torch.autograd.grad(out, [xf[i] for i in wanted], grad.to(F32))
            for i, g in zip(wanted, got, strict=True):
                grads[i] = g.to(xs[i].dtype)
        return (None, None, *grads)


def exact(program: Callable, ideal: Callable, *xs: torch.Tensor) -> torch.Tensor:
    return _Exact.apply(program, ideal, *xs)


# --- the op sites ------------------------------------------------------------------------------
def gemm(x, w, out_dtype=torch.bfloat16):
    return exact(lambda a, b: P.gemm(a, b, out_dtype=out_dtype), lambda a, b: a @ b.T, x, w)


def rmsnorm(x, w, eps: float):
    def ideal(a, b):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * b

    return exact(lambda a, b: P.rmsnorm(a, b, eps), ideal, x, w)


def residual_add(a, b):
    return exact(P.residual_add, lambda u, v: u + v, a, b)


def swiglu(gate, up):
    return exact(P.swiglu, lambda g, u: torch.nn.functional.silu(g) * u, gate, up)


def rope(x, positions, base: float):
    """x [T, H, D]; the backward rotates by -theta with the program's own fp32 tables."""

    def ideal(a):
        half = a.shape[-1] // 2
        cos_t, sin_t = rope_tables(base, a.shape[-1], int(positions.max()) + 1)
        cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]
        a1, a2 = a[..., :half], a[..., half:]
        return torch.cat([a1 * cos - a2 * sin, a2 * cos + a1 * sin], dim=-1)

    return exact(lambda a: P.rope(a, positions, base), ideal, x)


def attention(q, k, v, positions):
    """Causal GQA of one sequence: q [T, Hq, D], k/v [S, Hkv, D]."""

    def ideal(qf, kf, vf):
        g = qf.shape[1] // kf.shape[1]
        kk = kf.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, S, D]
        vv = vf.repeat_interleave(g, dim=1).transpose(0, 1)
        s = (qf.transpose(0, 1) @ kk.transpose(1, 2)) / (qf.shape[-1] ** 0.5)  # [Hq, T, S]
        keys = torch.arange(kf.shape[0], device=kf.device)
        s = s.masked_fill(keys[None, None, :] > positions[None, :, None], float("-inf"))
        return (torch.softmax(s, dim=-1) @ vv).transpose(0, 1)

    return exact(lambda a, b, c: P.attention(a, b, c, positions), ideal, q, k, v)


def router_weights(logits, k: int, normalize: bool):
    """(ids, weights): ids carry no gradient; the weights' VJP is softmax-gather-normalize."""
    ids, wts = P.router_topk(logits.detach(), k, normalize=normalize)

    def ideal(lg):
        w = torch.gather(torch.softmax(lg, dim=-1), 1, ids)
        return w / w.sum(-1, keepdim=True) if normalize else w

    return ids, exact(lambda lg: wts, ideal, logits)


def moe_fold(expert_out, weights):
    return exact(P.moe_fold, lambda y, w: (w[..., None] * y).sum(1), expert_out, weights)


def lora_shrink(x, a):
    return exact(P.lora_shrink, lambda u, v: u @ v.T, x, a)


def lora_expand(base, t, b, scale: float):
    return exact(
        lambda y, u, v: P.lora_expand(y, u, v, scale),
        lambda y, u, v: y + scale * (u @ v.T),
        base,
        t,
        b,
    )


def log_softmax(logits):
    return exact(P.log_softmax, lambda z: torch.log_softmax(z, dim=-1), logits)


def to_bf16(x):
    """A fp32 master tensor seen in bf16 (RNE), straight-through gradient."""
    return exact(P.round_bf16, lambda u: u, x)
