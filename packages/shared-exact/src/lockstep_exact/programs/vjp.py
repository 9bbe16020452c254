"""Exact forward, standard-math backward: the byte programs as autograd functions.

A trainer differentiates the programs it runs. ``exact(program, ideal, *inputs)`` returns the
program's output in the forward (its bytes are the contract's); in the backward it recomputes
``ideal`` (the textbook op the program approximates) on fp32 copies of the inputs and returns
its vector-Jacobian product, cast to each input's dtype. The ideal op of every program lives
here, beside the programs, so any trainer gets the same gradients: ``lanes.ops.Ops(grad=True)``
is the one user in this repository.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cpu import rope_tables

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
                # allow_unused: an output may not read every input (gdn.chunked's state'
                # reads no query); such an input gets no gradient (None, a zero).
                got = torch.autograd.grad(
                    out, [xf[i] for i in wanted], grad.to(F32), allow_unused=True
                )
            for i, g in zip(wanted, got, strict=True):
                grads[i] = None if g is None else g.to(xs[i].dtype)
        return (None, None, *grads)


def exact(program: Callable, ideal: Callable, *xs: torch.Tensor) -> torch.Tensor:
    """``program(*xs)`` forward, the VJP of ``ideal`` backward (no graph when nothing needs it)."""
    if not torch.is_grad_enabled() or not any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in xs
    ):
        return program(*xs)
    return _Exact.apply(program, ideal, *xs)


# --- the ideal op of each program (fp32 inputs) ------------------------------------------------
def gemm(x, w):
    return x @ w.T


def rmsnorm(eps: float):
    return lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def residual_add(a, b):
    return a + b


def swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def rope(positions: torch.Tensor, base: float):
    """Rotation by theta, with the cpu program's own fp32 tables (its VJP rotates by -theta)."""

    def ideal(x):
        half = x.shape[-1] // 2
        cos_t, sin_t = rope_tables(base, x.shape[-1], int(positions.max()) + 1)
        pos = positions.to(cos_t.device)
        cos = cos_t[pos][:, None, :].to(x.device)
        sin = sin_t[pos][:, None, :].to(x.device)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return ideal


def attention(positions: torch.Tensor):
    """Causal GQA of one sequence: q [T, Hq, D], k/v [S, Hkv, D], query t at ``positions[t]``."""

    def ideal(q, k, v):
        g = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, S, D]
        vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
        s = (q.transpose(0, 1) @ kk.transpose(1, 2)) / (q.shape[-1] ** 0.5)  # [Hq, T, S]
        keys = torch.arange(k.shape[0], device=k.device)
        s = s.masked_fill(keys[None, None, :] > positions[None, :, None], float("-inf"))
        return (torch.softmax(s, dim=-1) @ vv).transpose(0, 1)

    return ideal


def router_weights(ids: torch.Tensor, normalize: bool):
    """The chosen experts' softmax weights (renormalized); the ids carry no gradient."""

    def ideal(logits):
        w = torch.gather(torch.softmax(logits, dim=-1), 1, ids)
        return w / w.sum(-1, keepdim=True) if normalize else w

    return ideal


def moe_fold(y, w):
    return (w[..., None] * y).sum(1)


def lora_shrink(x, a):
    return x @ a.T


def lora_expand(scale: float):
    return lambda y, t, b: y + scale * (t @ b.T)


def log_softmax(z):
    return torch.log_softmax(z, dim=-1)


def identity(x):
    return x


# --- the hybrid lane's programs (Qwen3-Next) ----------------------------------------------------
def rmsnorm_zero_centered(eps: float):
    """rmsnorm.zero_centered: the weight is stored as w - 1."""
    return lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def rmsnorm_gated(eps: float):
    """rmsnorm.gated: the normalized x times w, gated by silu(z)."""

    def ideal(x, z, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        return y * torch.nn.functional.silu(z)

    return ideal


def sigmoid_gate(x, gate):
    return x * torch.sigmoid(gate)


def shared_gate(routed, shared, logit):
    return routed + torch.sigmoid(logit) * shared


def rope_partial(positions: torch.Tensor, base: float, rotary: int):
    """rope.neox (its tables, built for ``rotary`` dims) on the first ``rotary`` dims; the
    rest pass through."""
    turn = rope(positions, base)
    return lambda x: torch.cat([turn(x[..., :rotary]), x[..., rotary:]], dim=-1)


def gdn_decay(a, a_log, dt_bias):
    """gdn.gating's g: -(exp(A_log) * softplus(a + dt_bias))."""
    return -(torch.exp(a_log) * torch.nn.functional.softplus(a + dt_bias))


def gdn_beta(b):
    """gdn.gating's beta: sigmoid(b)."""
    return torch.sigmoid(b)


def l2norm(eps: float):
    return lambda x: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def conv1d_causal(kernel: int):
    """conv1d.causal over the cached window then x, SiLU after: x [T, D], w [D, W],
    window [W-1, D]."""

    def ideal(x, w, window):
        full = torch.cat([window, x], dim=0)
        n = x.shape[0]
        acc = sum(full[i : i + n] * w[:, i] for i in range(kernel))
        return torch.nn.functional.silu(acc)

    return ideal


def _delta_rule(q, k, v, g, beta, s0, ck, cv, cg, cb, *, keep: int | None):
    """The gated delta rule, token by token (the textbook recurrence gdn.chunked computes in
    chunks): S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t / sqrt(K).
    The cached tokens (ck, cv, cg, cb) come first, from the state s0, and give no output.
    Returns the new tokens' outputs [T, Hv, V], or with ``keep`` the state after the first
    ``keep`` tokens (cached then new)."""
    r = v.shape[1] // k.shape[1]
    kk = torch.cat([ck, k], dim=0).repeat_interleave(r, dim=1)  # [w+T, Hv, K]
    vv = torch.cat([cv, v], dim=0)
    gg = torch.cat([cg, g], dim=0)
    bb = torch.cat([cb, beta], dim=0)
    qs = q.repeat_interleave(r, dim=1) / (q.shape[-1] ** 0.5)
    w = ck.shape[0]
    stop = kk.shape[0] if keep is None else keep
    s, outs = s0, []
    for t in range(stop):
        s = s * torch.exp(gg[t])[:, None, None]
        err = vv[t] - torch.einsum("hkv,hk->hv", s, kk[t])
        s = s + kk[t][:, :, None] * (bb[t][:, None] * err)[:, None, :]
        if t >= w:
            outs.append(torch.einsum("hkv,hk->hv", s, qs[t - w]))
    if keep is not None:
        return s
    if not outs:
        return v.new_zeros(0, *v.shape[1:])
    return torch.stack(outs)


def gdn_chunked(q, k, v, g, beta, s0, ck, cv, cg, cb):
    """gdn.chunked's output: q, k [T, Hk, K] (l2-normalized, unscaled), v [T, Hv, V],
    g, beta [T, Hv]; the state: s0 [Hv, K, V] at its chunk start and that chunk's cached
    tokens ck [w, Hk, K], cv [w, Hv, V], cg, cb [w, Hv]. The chunking moves no value."""
    return _delta_rule(q, k, v, g, beta, s0, ck, cv, cg, cb, keep=None)


def gdn_state(keep: int):
    """gdn.chunked's state' S (gdn_chunked's inputs): the state after the first ``keep``
    tokens, cached then new (the complete chunks)."""
    return lambda *xs: _delta_rule(*xs, keep=keep)
