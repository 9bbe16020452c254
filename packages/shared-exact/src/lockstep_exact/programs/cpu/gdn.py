"""gdn.*: the Gated DeltaNet programs of the hybrid lane (Qwen3-Next), cpu backend.

gdn.chunked is the gated delta rule over chunks aligned to absolute positions; gdn.gating makes
its per-token decay and write strength; gdn.l2norm normalizes q and k; conv1d.causal is the short
depthwise convolution (with its cached window) that feeds them. Every value inside is fp32 and
every reduction is a fixed tree (``tree_sum``) or a fixed left-to-right chain whose length is set
by the program, never by how many tokens a call holds.

The code is device-generic: run on CUDA tensors it is the cuda backend's program too
(``programs.cuda.hybrid``), with the same bytes, because it keeps three rules. Every tensor it
creates lives on its inputs' device. No tensor is divided by a Python number or a cpu 0-dim
tensor (CUDA divides by such a scalar as a multiplication by its reciprocal: one more rounding);
a divisor is a tensor on the inputs' device, and a Python-number numerator (``1.0 / t``) is the
IEEE reciprocal on both. No op that a backend may fuse or reorder (addcmul, lerp, matmul, sum,
cumsum, ...): each + - * / sqrt is its own op, every reduction an explicit ``tree_sum``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .activation import silu
from .arith import BF16, F32, as_f32, exp, log, require, round_bf16, sqrt_rn, tree_sum

# Head groups are sized so one group's [heads, rows, K, V] products stay near this many bytes;
# heads never interact, so the grouping changes no byte.
_CHUNK_BYTES = 48 << 20


# --- gdn.gating ---------------------------------------------------------------------------------
def log1p_small(e: torch.Tensor) -> torch.Tensor:
    """log(1 + e) for fp32 e in [0, 1]: u = 1 + e, then log(u) * (e / (u - 1)), which keeps the
    digits of e that the rounding of 1 + e drops; e itself where 1 + e rounds to 1."""
    u = e + 1.0
    den = u - 1.0
    safe = torch.where(den == 0, torch.ones_like(den), den)
    return torch.where(den == 0, e, log(u) * (e / safe))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """fp32 log(1 + e**x) = max(x, 0) + log1p(e**-|x|), on the backend exp/log."""
    require(x.dtype == F32, "softplus: float32 input required")
    return torch.clamp(x, min=0.0) + log1p_small(exp(-x.abs()))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 1 / (1 + e**-x)."""
    require(x.dtype == F32, "sigmoid: float32 input required")
    return 1.0 / (exp(-x) + 1.0)


def check_gating(a, b, a_log, dt_bias) -> None:
    """gdn.gating's input checks (both backends)."""
    require(a.dtype == BF16 and b.dtype == BF16, "gdn.gating: bf16 a and b required")
    require(a.dim() == 2 and b.shape == a.shape, "gdn.gating: a and b [T, Hv] of one shape")
    h_v = a.shape[1]
    require(
        a_log.shape == (h_v,) and dt_bias.shape == (h_v,),
        f"gdn.gating: A_log and dt_bias must be [{h_v}], got {tuple(a_log.shape)} and "
        f"{tuple(dt_bias.shape)}",
    )


def gdn_gating(a, b, a_log, dt_bias):
    """(g, beta), fp32 [T, Hv]: g = -(exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b).

    a, b [T, Hv] bf16 (the in_proj_ba outputs); A_log, dt_bias [Hv] bf16 or fp32 (widened
    exactly). g <= 0 is the log of the per-token decay, beta in (0, 1) the write strength.
    """
    check_gating(a, b, a_log, dt_bias)
    sp = softplus(as_f32(a) + as_f32(dt_bias))
    g = -(exp(as_f32(a_log)) * sp)
    return g, sigmoid(as_f32(b))


# --- gdn.l2norm ---------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] bf16 -> fp32 x * (1 / sqrt(tree_sum_D(x*x) + eps)); no rounding to bf16."""
    require(x.dtype == BF16, f"gdn.l2norm: bf16 input required, got {x.dtype}")
    xf = as_f32(x)
    inv = 1.0 / sqrt_rn(tree_sum(xf * xf) + torch.tensor(eps, dtype=F32, device=x.device))
    return xf * inv[..., None]


# --- conv1d.causal ------------------------------------------------------------------------------
def check_conv1d(x, weight, window, kernel: int) -> None:
    """conv1d.causal's input checks (both backends)."""
    require(
        x.dtype == BF16 and weight.dtype == BF16 and window.dtype == BF16,
        "conv1d.causal: bf16 x, weight and window required",
    )
    require(x.dim() == 2, f"conv1d.causal: x must be [T, D], got {tuple(x.shape)}")
    d = x.shape[1]
    require(
        weight.shape == (d, kernel),
        f"conv1d.causal: weight must be [{d}, {kernel}] (kernel={kernel}), got "
        f"{tuple(weight.shape)}",
    )
    require(
        window.shape == (kernel - 1, d),
        f"conv1d.causal: the cached window must be [{kernel - 1}, {d}], got "
        f"{tuple(window.shape)}: a cache that does not match this layer",
    )


def conv1d_causal(x, weight, window, *, kernel: int = 4):
    """(out, window'): depthwise causal convolution of one sequence, SiLU after.

    x [T, D] bf16 at consecutive positions; weight [D, W] bf16 (W = ``kernel``); window
    [W-1, D] bf16 holds the inputs of the W-1 positions before x (zeros before position 0).
    out[t] = bf16(silu(tree_sum_W(fp32 x[t-W+1+w] * fp32 weight[:, w]))), taps oldest first;
    window' is the last W-1 inputs, the cache of the next call.
    """
    check_conv1d(x, weight, window, kernel)
    full = torch.cat([window, x], dim=0)
    n = x.shape[0]
    ff = as_f32(full)
    wf = as_f32(weight)
    taps = torch.stack([ff[w : w + n] * wf[:, w] for w in range(kernel)], dim=-1)  # [T, D, W]
    out = round_bf16(silu(tree_sum(taps)))
    return out, full[full.shape[0] - (kernel - 1) :].clone()


def conv1d_window(d: int, *, kernel: int = 4, device=None) -> torch.Tensor:
    """The window of a sequence at position 0: W-1 zero inputs, on ``device`` (cpu if None)."""
    return torch.zeros(kernel - 1, d, dtype=BF16, device=device)


# --- gdn.chunked --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GdnState:
    """The recurrent cache of one sequence at one GDN layer.

    ``s`` [Hv, K, V] fp32 is the state at absolute position ``start``, a multiple of ``chunk``:
    a function of the tokens before ``start`` only. ``k`` [w, Hk, K] fp32 (l2-normalized),
    ``v`` [w, Hv, V] bf16 and ``g``, ``beta`` [w, Hv] fp32 are the tokens ``start ..
    start+w-1`` of the current chunk (0 <= w < chunk). The next token is at ``position``.

    ``u`` [w, Hv, V] and ``gcum`` [w, Hv] fp32 are what ``_chunk`` solved for those rows (the
    forward substitution's u and the cumulative gates G), kept so that a call does not solve
    them again: each is a function of ``s`` and the cached rows alone, computed by the same
    operations whenever it is computed, so a state without them (None: a trainer's state under
    autograd, say) gives the same bytes, solving them from the rows.
    """

    chunk: int
    start: int
    s: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    u: torch.Tensor | None = None
    gcum: torch.Tensor | None = None

    @property
    def position(self) -> int:
        return self.start + self.k.shape[0]


def gdn_state(h_k: int, h_v: int, d_k: int, d_v: int, *, chunk: int, device=None) -> GdnState:
    """The state of a sequence at position 0: S = 0 and an empty window, on ``device`` (cpu
    if None)."""
    return GdnState(
        chunk=chunk,
        start=0,
        s=torch.zeros(h_v, d_k, d_v, dtype=F32, device=device),
        k=torch.zeros(0, h_k, d_k, dtype=F32, device=device),
        v=torch.zeros(0, h_v, d_v, dtype=BF16, device=device),
        g=torch.zeros(0, h_v, dtype=F32, device=device),
        beta=torch.zeros(0, h_v, dtype=F32, device=device),
        u=torch.zeros(0, h_v, d_v, dtype=F32, device=device),
        gcum=torch.zeros(0, h_v, dtype=F32, device=device),
    )


def state_tensors(state: GdnState) -> tuple[torch.Tensor, ...]:
    """The state's tensors (s, k, v, g, beta): what must share the call's device."""
    return state.s, state.k, state.v, state.g, state.beta


def default_scale(d_k: int, device=None) -> torch.Tensor:
    """1 / sqrt(K) as float32, from IEEE sqrt and division (a 0-dim tensor on ``device``).
    Made once per (K, device) and shared, read-only: a decode step would otherwise spend some
    thirty small ops (``sqrt_rn``'s correction) on the same number."""
    return _scale(int(d_k), str(torch.device(device) if device is not None else "cpu"))


@functools.lru_cache(maxsize=64)
def _scale(d_k: int, device: str) -> torch.Tensor:
    return 1.0 / sqrt_rn(torch.tensor(float(d_k), dtype=F32, device=device))


def _check(q, k, v, g, beta, state: GdnState, position: int, chunk: int):
    require(chunk >= 1 and chunk & (chunk - 1) == 0, f"gdn.chunked: chunk {chunk} not a power of 2")
    require(
        q.dtype == F32 and k.dtype == F32,
        f"gdn.chunked: q and k must be float32 (gdn.l2norm outputs), got {q.dtype} and {k.dtype}",
    )
    require(v.dtype == BF16, f"gdn.chunked: v must be bf16, got {v.dtype}")
    require(
        g.dtype == F32 and beta.dtype == F32,
        f"gdn.chunked: g and beta must be float32 (gdn.gating outputs), got {g.dtype} and "
        f"{beta.dtype}",
    )
    require(
        q.dim() == 3 and k.shape == q.shape and v.dim() == 3,
        "gdn.chunked: q, k [T, Hk, K] of one shape and v [T, Hv, V]",
    )
    n, h_k, d_k = q.shape
    _, h_v, d_v = v.shape
    require(v.shape[0] == n, "gdn.chunked: q and v hold different token counts")
    require(h_v % h_k == 0, f"gdn.chunked: {h_v} value heads over {h_k} key heads")
    require(g.shape == (n, h_v) and beta.shape == (n, h_v), "gdn.chunked: g and beta [T, Hv]")
    devices = {str(t.device) for t in (q, k, v, g, beta, *state_tensors(state))}
    require(
        len(devices) == 1,
        f"gdn.chunked: the tokens and the state must be on one device, got {sorted(devices)}: "
        "a sequence's state lives on the device of its model",
    )
    require(
        state.chunk == chunk,
        f"gdn.chunked: chunk size mismatch: the state was built with chunk={state.chunk}, "
        f"the program runs chunk={chunk}",
    )
    require(
        state.s.dtype == F32 and state.s.shape == (h_v, d_k, d_v),
        f"gdn.chunked: the state must be float32 [{h_v}, {d_k}, {d_v}], got {state.s.dtype} "
        f"{tuple(state.s.shape)}: a cache that does not match this layer",
    )
    w = state.k.shape[0]
    require(
        state.start >= 0 and state.start % chunk == 0 and w < chunk,
        f"gdn.chunked: the state starts at {state.start} with {w} cached tokens; it must start "
        f"at a multiple of chunk={chunk} and hold fewer than {chunk}",
    )
    require(
        state.k.shape == (w, h_k, d_k)
        and state.v.shape == (w, h_v, d_v)
        and state.g.shape == (w, h_v)
        and state.beta.shape == (w, h_v)
        and state.k.dtype == F32
        and state.v.dtype == BF16
        and state.g.dtype == F32
        and state.beta.dtype == F32,
        "gdn.chunked: the cached window (k, v, g, beta) does not match the layer's heads and "
        "dims or dtypes",
    )
    if state.u is not None or state.gcum is not None:
        require(
            state.u is not None
            and state.gcum is not None
            and state.u.shape == (w, h_v, d_v)
            and state.gcum.shape == (w, h_v)
            and state.u.dtype == F32
            and state.gcum.dtype == F32
            and {str(state.u.device), str(state.gcum.device)} == devices,
            "gdn.chunked: the cached rows' solutions (u, gcum) do not match the cached window",
        )
    require(
        position == state.position,
        f"gdn.chunked: the state is at position {state.position}, the call starts at {position}:"
        " a cache that does not match this sequence",
    )
    return n, h_k, h_v, d_k, d_v


def gdn_chunked(q, k, v, g, beta, state: GdnState, *, position: int, chunk: int, scale=None):
    """(out [T, Hv, V] bf16, state'): the gated delta rule for T new tokens of ONE sequence.

    q, k [T, Hk, K] fp32 (gdn.l2norm outputs), v [T, Hv, V] bf16, g, beta [T, Hv] fp32
    (gdn.gating outputs), at absolute positions ``position .. position+T-1``; ``state`` holds
    the state at the chunk start c of ``position`` and the cached tokens c .. position-1. Value
    head h reads key head h // (Hv / Hk). Chunks are [jC, (j+1)C) in absolute positions; every
    output is computed from its chunk's start state and the chunk's tokens up to it (``_chunk``),
    the state moves only when a chunk is complete. state' is at the chunk start of the next token.
    """
    return run_chunks(_chunk_heads, q, k, v, g, beta, state, position=position, chunk=chunk,
                      scale=scale)  # fmt: skip


def run_chunks(chunk_pass, q, k, v, g, beta, state: GdnState, *, position: int, chunk: int,
               scale=None):  # fmt: skip
    """``gdn_chunked`` with each chunk's pass done by ``chunk_pass`` (``_chunk_heads`` here;
    the cuda backend's one-launch pass, ``programs.cuda.gdn.chunk``, which computes the same
    bytes): the calls, the state and the chunk boundaries are this function's."""
    n, h_k, h_v, d_k, d_v = _check(q, k, v, g, beta, state, position, chunk)
    dev = q.device
    if scale is None:
        scale = default_scale(d_k, dev)
    if n == 0:
        return torch.zeros(0, h_v, d_v, dtype=BF16, device=dev), state
    head_map = torch.arange(h_v, device=dev) // (h_v // h_k)
    kk = torch.cat([state.k, k], dim=0)
    vv = torch.cat([state.v, v], dim=0)
    gg = torch.cat([state.g, g], dim=0)
    bb = torch.cat([state.beta, beta], dim=0)
    qs = q * scale
    end = position + n
    s = state.s
    outs = []
    c = state.start
    # The first chunk's cached rows arrive solved when the state kept them (GdnState.u, gcum).
    solved = (state.u, state.gcum) if state.u is not None else None
    u_kept = torch.zeros(0, h_v, d_v, dtype=F32, device=dev)
    g_kept = torch.zeros(0, h_v, dtype=F32, device=dev)
    while c < end:
        lo = c - state.start
        m = min(chunk, end - c)
        first = max(position - c, 0)  # first row of this chunk that is a new token
        q_rows = qs[c + first - position : c + m - position]
        o, s_next, u_rows, g_rows = chunk_pass(
            s,
            q_rows[:, head_map],
            kk[lo : lo + m][:, head_map],
            as_f32(vv[lo : lo + m]),
            gg[lo : lo + m],
            bb[lo : lo + m],
            first,
            chunk,
            solved if lo == 0 else None,
        )
        outs.append(o)
        if m == chunk:
            s = s_next
            c += chunk
        else:
            u_kept, g_kept = u_rows, g_rows  # the rows the new state keeps, solved
            break
    out = round_bf16(torch.cat(outs, dim=0))
    keep = c - state.start
    new_state = GdnState(
        chunk=chunk,
        start=c,
        s=s,
        k=kk[keep:].clone(),
        v=vv[keep:].clone(),
        g=gg[keep:].clone(),
        beta=bb[keep:].clone(),
        u=u_kept,
        gcum=g_kept,
    )
    return out, new_state


# --- many sequences over state pages (serving) -------------------------------------------------
@dataclass(frozen=True)
class GdnPages:
    """One GDN layer's state pages, a page per sequence slot (a serving engine's cache):
    ``s`` [P, Hv, K, V] fp32 the GdnState at the chunk start; the chunk's cached rows
    ``k`` [P, C, Hk, K] fp32, ``v`` [P, C, Hv, V] bf16, ``g``, ``beta`` [P, C, Hv] fp32 and
    their solutions ``u`` [P, C, Hv, V], ``gcum`` [P, C, Hv] fp32 (the first w = position mod
    C rows of a page are live); ``conv`` [P, W-1, D] bf16 the conv window."""

    s: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    u: torch.Tensor
    gcum: torch.Tensor
    conv: torch.Tensor

    def state(self, slot: int, position: int, chunk: int) -> GdnState:
        """The GdnState a page holds for a sequence whose next token is at ``position``."""
        w = position % chunk
        return GdnState(
            chunk=chunk,
            start=position - w,
            s=self.s[slot],
            k=self.k[slot, :w],
            v=self.v[slot, :w],
            g=self.g[slot, :w],
            beta=self.beta[slot, :w],
            u=self.u[slot, :w],
            gcum=self.gcum[slot, :w],
        )

    def keep(self, slot: int, state: GdnState) -> None:
        """Write ``state`` into page ``slot`` (copies)."""
        w = state.k.shape[0]
        self.s[slot] = state.s
        for name in ("k", "v", "g", "beta", "u", "gcum"):
            getattr(self, name)[slot, :w] = getattr(state, name)


class _StepTable:
    """What a step's table over state pages answers (``PagedSeqs``, ``PagedPasses``): its
    rows and its sequences."""

    @property
    def rows(self) -> int:
        return self.starts[-1]

    @property
    def count(self) -> int:
        """Sequences in the step (padding entries included)."""
        return self.table.shape[0]


@dataclass(frozen=True)
class PagedSeqs(_StepTable):
    """The sequences of one step over state pages: sequence r has the rows
    ``starts[r]:starts[r+1]`` of the step, its first at ``positions[r]``, its state in page
    ``slot_ids[r]`` (int64 on the pages' device). ``positions`` and ``slots`` hold the same on
    the host where they are known there (the cpu programs read them; on cuda the pages stay on
    the device; a step made on the device, ``paged_decodes``, knows neither: None).
    ``table`` is the same as int32 [R, 4] on the pages' device (row start, rows, position,
    page): what the cuda kernels read. A sequence of 0 rows is a padding entry: its page is
    neither read nor written. Made by ``paged_seqs`` or ``paged_decodes``."""

    starts: tuple[int, ...]
    positions: tuple[int, ...] | None
    slots: tuple[int, ...] | None
    chunk: int
    table: torch.Tensor
    slot_ids: torch.Tensor

    def host_rows(self) -> list[tuple[int, int, int, int]]:
        """(row start, rows, position, page) of every sequence with rows, on the host (the
        definition indexes them a sequence at a time; from the table where the host does not
        hold them: one read)."""
        if self.positions is not None and self.slots is not None:
            rows = [
                (self.starts[r], self.starts[r + 1] - self.starts[r], p, slot)
                for r, (p, slot) in enumerate(zip(self.positions, self.slots, strict=True))
            ]
        else:
            rows = [tuple(int(x) for x in row) for row in self.table.tolist()]
        return [row for row in rows if row[1] > 0]


def _checked_step(starts, positions, slots, chunk: int):
    """What both step tables check of a step (``paged_seqs``, ``paged_passes``): R >= 1
    sequences, starts from 0, a power-of-2 chunk, and pages given on the host distinct and
    >= 0. Returns (starts, positions, slots): tuples, ``slots`` as host integers or the
    tensor it was given as (its pages are checked on its device, ``_page_ids``)."""
    starts, positions = tuple(starts), tuple(positions)
    n_seq = len(positions)
    if not isinstance(slots, torch.Tensor):
        slots = tuple(int(x) for x in slots)
    require(
        len(starts) == n_seq + 1 and len(slots) == n_seq and n_seq > 0 and starts[0] == 0,
        "gdn paged: starts [R + 1] from 0, positions [R] and slots [R] of R >= 1 sequences",
    )
    require(chunk >= 1 and chunk & (chunk - 1) == 0, f"gdn paged: chunk {chunk} not a power of 2")
    if isinstance(slots, tuple):
        require(len(set(slots)) == n_seq, "gdn paged: two sequences share a state page")
        require(min(slots) >= 0, "gdn paged: a negative page index")
    return starts, positions, slots


def _page_ids(uploaded: torch.Tensor, slots) -> torch.Tensor:
    """A step's pages as int64 on their device: host pages are the tail of the step's one
    upload; an engine's page tensor is used where it lives, its pages asserted distinct and
    >= 0 there (no host read)."""
    if isinstance(slots, tuple):
        return uploaded[uploaded.shape[0] - len(slots) :]
    ids = slots.to(torch.int64)
    order = ids.sort().values
    torch._assert_async(((order[1:] != order[:-1]).all()) & (order[0] >= 0))
    return ids


def paged_seqs(starts, positions, slots, *, chunk: int, device=None, upload=None) -> PagedSeqs:
    """``PagedSeqs`` of a step, checked: each sequence has rows and its rows stay inside the
    chunk of its first one (position mod chunk + rows <= chunk), its page is not another's.
    ``slots``: the pages, host integers or an int64 tensor on the pages' device (a serving
    engine's block table: then nothing of it is read on the host, and distinct pages are
    asserted on the device). ``upload(host_tensor)``: how the host part reaches ``device``
    (default ``.to``; a tensor ``slots`` sets the device)."""
    starts, positions, slots = _checked_step(starts, positions, slots, chunk)
    n_seq = len(positions)
    on_host = isinstance(slots, tuple)
    if not on_host:
        device = slots.device
    head = []
    for r, p in enumerate(positions):
        n = starts[r + 1] - starts[r]
        require(
            n >= 1 and p >= 0 and p % chunk + n <= chunk,
            f"gdn paged: sequence {r} ({n} rows at position {p}) must have rows inside one "
            f"chunk of {chunk}",
        )
        head += (starts[r], n, p)
    move = upload or (lambda t: t.to(device))
    up = move(torch.tensor(head + (list(slots) if on_host else []), dtype=torch.int64))
    ids = _page_ids(up, slots)
    table = torch.cat([up[: 3 * n_seq].view(n_seq, 3), ids[:, None]], dim=1).to(torch.int32)
    return PagedSeqs(
        starts=starts,
        positions=positions,
        slots=slots if on_host else (tuple(ids.tolist()) if ids.device.type == "cpu" else None),
        chunk=chunk,
        table=table,
        slot_ids=ids,
    )


@dataclass(frozen=True)
class PagedPasses(_StepTable):
    """A step whose sequences run past a chunk boundary (a prefill), as passes over the state
    pages: pass j holds the j-th chunk-aligned piece of every sequence that has one (the first
    piece runs to its chunk's end, the next ones are whole chunks, the last the remainder), so
    each pass is a ``PagedSeqs`` step (every sequence's rows inside one chunk) and the passes
    in order advance each page as the sequence's one call would: a row gets the bytes of its
    sequence's own ``gdn_chunked`` / ``conv1d_causal`` call. ``passes``: (rows, seqs) per pass,
    ``rows`` int64 on the pages' device the step's rows of the pass in the pass's order (the
    pass's inputs are those rows; its outputs go back to them). ``table`` and ``slot_ids``:
    the whole step's, as ``PagedSeqs``' (row start, rows, position, page), what the pages
    hold after it. Made by ``paged_passes``."""

    passes: tuple[tuple[torch.Tensor, PagedSeqs], ...]
    starts: tuple[int, ...]
    chunk: int
    table: torch.Tensor
    slot_ids: torch.Tensor


def paged_passes(
    starts, positions, slots, *, chunk: int, device=None, upload=None
) -> PagedSeqs | PagedPasses:
    """A step of sequences over state pages (as ``paged_seqs``: sequence r has the rows
    ``starts[r]:starts[r+1]``, its first at ``positions[r]``, its state in page ``slots[r]``):
    ``paged_seqs``' table where every sequence's rows stay inside one chunk, else the step as
    ``PagedPasses``. Checked as ``paged_seqs`` checks (but for the chunk). Everything the
    passes need of the host goes to the device in one upload."""
    starts, positions, slots = _checked_step(starts, positions, slots, chunk)
    n_seq = len(positions)
    sizes = [starts[r + 1] - starts[r] for r in range(n_seq)]
    for r, (n, p) in enumerate(zip(sizes, positions, strict=True)):
        require(n >= 1 and p >= 0, f"gdn paged: sequence {r} has {n} rows at position {p}")
    if all(p % chunk + n <= chunk for n, p in zip(sizes, positions, strict=True)):
        return paged_seqs(starts, positions, slots, chunk=chunk, device=device, upload=upload)
    on_host = isinstance(slots, tuple)
    if not on_host:
        device = slots.device
    # pieces[j]: (sequence, first row, rows, position) of each sequence's j-th piece
    pieces: list[list[tuple[int, int, int, int]]] = []
    for r, (n, p) in enumerate(zip(sizes, positions, strict=True)):
        done, j = 0, 0
        while done < n:
            take = min(n - done, chunk - (p + done) % chunk)
            if j == len(pieces):
                pieces.append([])
            pieces[j].append((r, starts[r] + done, take, p + done))
            done, j = done + take, j + 1
    # one host tensor: each pass's rows, then each pass's (row start, rows, position) and
    # sequences, then the whole step's (row start, rows, position)
    flat: list[int] = []
    for piece in pieces:
        for _, lo, n, _ in piece:
            flat.extend(range(lo, lo + n))
    heads_at = len(flat)
    for piece in pieces:
        at = 0
        for r, _, n, p in piece:
            flat += (at, n, p, r)
            at += n
    whole_at = len(flat)
    for r in range(n_seq):
        flat += (starts[r], sizes[r], positions[r])
    move = upload or (lambda t: t.to(device))
    up = move(torch.tensor(flat + (list(slots) if on_host else []), dtype=torch.int64))
    ids = _page_ids(up, slots)
    passes = []
    row_at, head_at = 0, heads_at
    for piece in pieces:
        n_rows = sum(n for _, _, n, _ in piece)
        head = up[head_at : head_at + 4 * len(piece)].view(len(piece), 4)
        sel = ids[head[:, 3]]
        table = torch.cat([head[:, :3], sel[:, None]], dim=1).to(torch.int32)
        pass_starts = [0]
        for _, _, n, _ in piece:
            pass_starts.append(pass_starts[-1] + n)
        seqs = PagedSeqs(
            starts=tuple(pass_starts),
            positions=tuple(p for *_, p in piece),
            slots=tuple(slots[r] for r, *_ in piece) if on_host else None,
            chunk=chunk,
            table=table,
            slot_ids=sel,
        )
        passes.append((up[row_at : row_at + n_rows], seqs))
        row_at, head_at = row_at + n_rows, head_at + 4 * len(piece)
    whole = up[whole_at : whole_at + 3 * n_seq].view(n_seq, 3)
    return PagedPasses(
        passes=tuple(passes),
        starts=starts,
        chunk=chunk,
        table=torch.cat([whole, ids[:, None]], dim=1).to(torch.int32),
        slot_ids=ids,
    )


def paged_decodes(positions, slots, live, *, chunk: int) -> PagedSeqs:
    """``PagedSeqs`` of a step of one-row sequences made on the pages' device, nothing read on
    the host (a CUDA graph replays it with new values in the same tensors): row r is sequence
    r, at ``positions[r]``, its state in page ``slots[r]``; ``live[r]`` False makes r a
    padding entry (no rows: its page is neither read nor written; a batch padded to a captured
    size). One row always stays inside its chunk; distinct pages of the live entries are
    asserted on the device."""
    n = positions.shape[0]
    require(
        n >= 1 and positions.dim() == 1 and slots.shape == (n,) and live.shape == (n,),
        "gdn paged: positions, slots and live [R] of R >= 1 one-row sequences",
    )
    require(live.dtype == torch.bool, "gdn paged: live must be bool")
    require(chunk >= 1 and chunk & (chunk - 1) == 0, f"gdn paged: chunk {chunk} not a power of 2")
    ids = slots.to(torch.int64)
    both = live[:, None] & live[None, :]
    shared = (ids[:, None] == ids[None, :]) & both  # the diagonal: each live entry itself
    torch._assert_async((shared.sum() == live.sum()) & ((ids >= 0) | ~live).all())
    table = torch.stack(
        [
            torch.arange(n, device=ids.device),
            live.to(torch.int64),
            torch.where(live, positions.to(torch.int64), 0),
            ids,
        ],
        dim=1,
    ).to(torch.int32)
    return PagedSeqs(
        starts=tuple(range(n + 1)), positions=None, slots=None, chunk=chunk, table=table,
        slot_ids=ids,
    )  # fmt: skip


def check_paged(q, k, v, g, beta, pages: GdnPages, seqs: PagedSeqs, chunk: int) -> None:
    """gdn.chunked's paged form's input checks (both backends): the step's table and rows,
    the dtypes and shapes of the tokens, and pages that hold this layer's state."""
    require(chunk == seqs.chunk, f"gdn paged: chunk {chunk}, the step's table {seqs.chunk}")
    require(q.shape[0] == seqs.rows, f"gdn paged: {q.shape[0]} rows, the table {seqs.rows}")
    require(
        q.dtype == F32 and k.dtype == F32 and q.dim() == 3 and q.shape == k.shape,
        f"gdn paged: q and k fp32 [T, Hk, K] of the step's {seqs.rows} rows",
    )
    t, h_k, d_k = k.shape
    require(v.dtype == BF16 and v.dim() == 3 and v.shape[0] == t, "gdn paged: v bf16 [T, Hv, V]")
    h_v, d_v = v.shape[1:]
    require(
        g.dtype == F32 and beta.dtype == F32 and g.shape == (t, h_v) and beta.shape == g.shape,
        "gdn paged: g and beta fp32 [T, Hv]",
    )
    require(
        pages.s.shape[1:] == (h_v, d_k, d_v) and pages.k.shape[1:] == (chunk, h_k, d_k),
        "gdn paged: the pages do not hold this layer's state",
    )


def check_conv1d_paged(x, weight, pages: GdnPages, seqs: PagedSeqs, kernel: int) -> None:
    """conv1d.causal's paged form's input checks (both backends): conv1d.causal's, with a
    page's window as the window, and the step's rows."""
    win = pages.conv
    require(win.dim() == 3 and win.shape[0] > 0, "conv1d paged: the windows must be [P, W-1, D]")
    check_conv1d(x, weight, win[0], kernel)
    require(x.shape[0] == seqs.rows, f"conv1d paged: {x.shape[0]} rows, the table {seqs.rows}")


def gdn_paged(q, k, v, g, beta, pages: GdnPages, seqs: PagedSeqs, *, chunk: int, scale=None):
    """gdn.chunked for many sequences, each continued from its state page: the rows of
    sequence r (``seqs``) are ``gdn_chunked``'s call on its page's state, out [T, Hv, V] bf16
    their outputs, and each page holds the advanced state after. The definition: a call per
    sequence (the cuda backend: one launch, the same bytes). Rows of no sequence (padding)
    are zeros here; their bytes are no program's."""
    check_paged(q, k, v, g, beta, pages, seqs, chunk)
    out = torch.zeros(v.shape, dtype=BF16, device=v.device)
    for start, n, p, slot in seqs.host_rows():
        rows = slice(start, start + n)
        if p == 0:
            state = gdn_state(k.shape[1], v.shape[1], k.shape[2], v.shape[2], chunk=chunk,
                              device=v.device)  # fmt: skip
        else:
            state = pages.state(slot, p, chunk)
        o, new = gdn_chunked(
            q[rows], k[rows], v[rows], g[rows], beta[rows], state, position=p, chunk=chunk,
            scale=scale,
        )  # fmt: skip
        out[rows] = o
        pages.keep(slot, new)
    return out


def conv1d_paged(x, weight, pages: GdnPages, seqs: PagedSeqs, *, kernel: int = 4):
    """conv1d.causal for many sequences, each continued from its page's window: the rows of
    sequence r are ``conv1d_causal``'s call on its window (zeros at position 0), out [T, D]
    bf16, and each page holds the advanced window after. The definition: a call per sequence
    (the cuda backend: one launch, the same bytes). Rows of no sequence are zeros here."""
    check_conv1d_paged(x, weight, pages, seqs, kernel)
    out = torch.zeros(x.shape, dtype=BF16, device=x.device)
    for start, n, p, slot in seqs.host_rows():
        rows = slice(start, start + n)
        window = conv1d_window(x.shape[1], kernel=kernel, device=x.device)
        y, new = conv1d_causal(
            x[rows], weight, window if p == 0 else pages.conv[slot], kernel=kernel
        )
        out[rows] = y
        pages.conv[slot] = new
    return out


def _chunk_heads(s0, q, k, v, g, beta, first, chunk, solved=None):
    """``_chunk`` over groups of heads (heads never interact). ``solved``: (u [w, H, V],
    gcum [w, H]) of the chunk's first w rows, or None."""
    h_v, d_k, d_v = s0.shape
    per_head = chunk * max(chunk, d_k) * d_v * 4
    group = max(1, _CHUNK_BYTES // max(1, per_head))
    outs, states, us, gs = [], [], [], []
    for h0 in range(0, h_v, group):
        hs = slice(h0, h0 + group)
        part = None if solved is None else (solved[0][:, hs], solved[1][:, hs])
        o, s, u, gc = _chunk(
            s0[hs], q[:, hs], k[:, hs], v[:, hs], g[:, hs], beta[:, hs], first, chunk, part
        )
        outs.append(o)
        states.append(s)
        us.append(u)
        gs.append(gc)
    s_end = torch.cat(states, dim=0) if states[0] is not None else None
    return torch.cat(outs, dim=1), s_end, torch.cat(us, dim=1), torch.cat(gs, dim=1)


def _chunk(s0, q, k, v, g, beta, first, chunk, solved=None):
    """One chunk of one sequence: rows 0..m-1 present (m <= C), outputs for rows first..m-1.

    s0 [H, K, V]; q [m-first, H, K] (scaled); k [m, H, K]; v [m, H, V]; g, beta [m, H]; all
    fp32. Every reduction over the chunk's rows is a tree of fixed width C whose entries past
    the row's own token are forced to +0, so a row's bytes do not depend on m. ``solved``:
    (u [w, H, V], G [w, H]) of rows 0..w-1 (w <= first) from an earlier call, which this one
    then does not solve again (they are the values it would compute: row i's u and G depend on
    rows 0..i and s0 only, by the same operations).
    Returns (out fp32 [m-first, H, V], the state at the chunk end if m == C else None,
    u [m, H, V], G [m, H]).
    """
    m = k.shape[0]
    c = chunk
    h = s0.shape[0]
    dev = s0.device
    w = 0 if solved is None else solved[0].shape[0]
    zero = torch.zeros((), dtype=F32, device=dev)
    # Head-major, padded to C rows with zeros (padding never reaches a kept value: masks below).
    kh = torch.zeros(h, c, k.shape[2], dtype=F32, device=dev)
    kh[:, :m] = k.transpose(0, 1)
    vh = v.transpose(0, 1)  # [H, m, V]
    bh = beta.transpose(0, 1)  # [H, m]
    # G_i = g_0 + g_1 + ... + g_i, left to right; rows past m stay 0 (always masked).
    gcum = torch.zeros(h, c, dtype=F32, device=dev)
    if w:
        gcum[:, :w] = solved[1].transpose(0, 1)
        acc = gcum[:, w - 1]
        todo = range(w, m)
    else:
        acc = g[0]
        gcum[:, 0] = acc
        todo = range(1, m)
    for i in todo:
        acc = acc + g[i]
        gcum[:, i] = acc
    gam = exp(gcum)  # [H, C] decay from the chunk start through token i
    rows = torch.arange(c, device=dev)
    le = rows[None, :] <= rows[:, None]  # [i, j]: j <= i
    lt = rows[None, :] < rows[:, None]
    # exp(G_i - G_j) for the rows read below only: w..m-1 (the rows solved here, the outputs
    # first..m-1 with first >= w, and the last row C-1 when the chunk is complete); elementwise,
    # so the same bytes as the whole [C, C] table's rows.
    decay = exp(gcum[:, w:m, None] - gcum[:, None, :])  # [H, i - w, j]
    decay = torch.where(le[w:m], decay, zero)
    # Rows w..m-1 only (the rows before w arrive solved); each is elementwise in its row.
    kk = tree_sum(kh[:, w:m, None, :] * kh[:, None, :, :])  # [H, m-w, C] k_i . k_j over K
    # a_ij = beta_i * (k_i.k_j * exp(G_i - G_j)), j < i
    a = torch.where(lt[w:m], bh[:, w:, None] * (kk * decay), zero)  # [H, m-w, C]
    # r_i = beta_i * (v_i - gamma_i * (S0^T k_i)); S0^T k_i is a tree over K.
    sk = tree_sum(s0[:, None, :, :] * kh[:, w:m, :, None], dim=2)  # [H, m-w, V]
    r = bh[:, w:, None] * (vh[:, w:] - gam[:, w:m, None] * sk)
    # Forward substitution, row by row: u_i = r_i - tree_sum_C(a_ij * u_j), j < i.
    u = torch.zeros(h, c, vh.shape[2], dtype=F32, device=dev)
    if w:
        u[:, :w] = solved[0].transpose(0, 1)
    for i in range(w, m):
        prod = torch.where(lt[i][None, :, None], a[:, i - w, :, None] * u, zero)
        u[:, i] = r[:, i - w] - tree_sum(prod, dim=1)
    # Outputs: o_i = gamma_i * (S0^T q_i) + tree_sum_C(q_i.k_j * exp(G_i - G_j) * u_j), j <= i.
    qh = q.transpose(0, 1)  # [H, n, K]
    sel = slice(first, m)
    qk = tree_sum(qh[:, :, None, :] * kh[:, None, :, :])  # [H, n, C]
    p = torch.where(le[sel], qk * decay[:, first - w :], zero)
    intra = tree_sum(torch.where(le[sel][None, :, :, None], p[..., None] * u[:, None], zero), dim=2)
    sq = tree_sum(s0[:, None, :, :] * qh[..., None], dim=2)  # [H, n, V]
    out = gam[:, sel, None] * sq + intra
    s_end = None
    if m == c:
        # S_end = gamma_last * S0 + tree_sum_C((exp(G_last - G_j) * k_j) u_j^T)
        wk = decay[:, c - 1 - w, :, None] * kh  # [H, C, K]
        upd = tree_sum(wk[:, :, :, None] * u[:, :, None, :], dim=1)  # [H, K, V]
        s_end = gam[:, c - 1, None, None] * s0 + upd
    return out.transpose(0, 1), s_end, u[:, :m].transpose(0, 1), gcum[:, :m].transpose(0, 1)
