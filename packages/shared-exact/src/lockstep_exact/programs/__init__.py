"""Byte programs: named, versioned floating-point programs, and the one dispatch point.

A program is the exact sequence of floating-point operations of one op: operand dtypes,
accumulator dtype, reduction tree, rounding points. ``Program`` names one (with its
parameters); ``CATALOG`` lists every program this release implements; the functions below
are what both engines call. Each picks its backend from the device of its tensors and fails
closed where a backend lacks the program: there is no fallback to a non-exact path.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import ModuleType

import torch

from . import cpu  # noqa: F401  (the always-present backend; tests reach it as P.cpu)
from . import grouping as _grouping
from .kernels import note


@dataclass(frozen=True)
class Program:
    """One byte program with its parameters: ``gemm.kblock@1{bk=32,out=bf16}``."""

    name: str
    version: int
    params: tuple[tuple[str, object], ...] = field(default=())

    @classmethod
    def of(cls, name: str, **params) -> Program:
        if name not in CATALOG:
            raise KeyError(f"unknown byte program {name!r}; known: {', '.join(sorted(CATALOG))}")
        version, defaults = CATALOG[name]
        unknown = set(params) - set(defaults)
        if unknown:
            raise KeyError(f"program {name} has no parameter(s) {sorted(unknown)}")
        merged = {**defaults, **params}
        return cls(name, version, tuple(sorted(merged.items())))

    @property
    def ident(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}@{self.version}{{{inner}}}"

    def param(self, key: str):
        return dict(self.params)[key]

    def __str__(self) -> str:
        return self.ident


# name -> (version, default parameters). A change that moves any output bit is a new version.
# Version 2 of the programs that take a square root: the cpu backend's sqrt is now IEEE
# (``arith.sqrt_rn``); version 1 took torch's CPU sqrt, one ulp off for about a fifth of fp32
# inputs (MKL's vector math) and different on other CPUs.
CATALOG: dict[str, tuple[int, dict[str, object]]] = {
    "embedding.gather": (1, {}),
    "gemm.kblock": (1, {"bk": 32, "out": "bf16"}),
    "gemm.kpart": (1, {"bk": 32, "parts": 8, "out": "bf16"}),
    "rmsnorm.qwen3": (2, {"eps": 1e-6}),
    "residual.add": (1, {}),
    "swiglu": (1, {}),
    "rope.neox": (1, {"base": 1000000.0}),
    # Version 3: merges at segments of ``segment`` keys (the cuda decode's parallel unit); v2's
    # cuda program merged at a fixed 2048 and the cpu program not at all.
    "attention.blocked": (3, {"block": 32, "segment": 512}),
    "softmax.tree": (1, {}),
    "log_softmax.tree": (1, {}),
    "router.softmax_topk": (1, {"k": 2, "normalize": True}),
    "moe.fold": (1, {"acc": "bf16"}),
    "lora.shrink": (1, {"bk": 32}),
    "lora.expand": (1, {"bk": 32}),
    "sample.gumbel_topp": (1, {"rounds": 3}),
    # The hybrid lane (Qwen3-Next): Gated DeltaNet, its conv and norms, the output gates.
    "gdn.chunked": (2, {"chunk": 64}),
    "gdn.gating": (1, {}),
    "gdn.l2norm": (2, {"eps": 1e-6}),
    "conv1d.causal": (1, {"kernel": 4}),
    "rmsnorm.zero_centered": (2, {"eps": 1e-6}),
    "rmsnorm.gated": (2, {"eps": 1e-6}),
    "gate.sigmoid": (1, {}),
    "moe.shared_gate": (1, {}),
    # Qwen3-Next's attention rotates only the first ``rotary`` dims of each head.
    "rope.partial": (1, {"base": 1000000.0, "rotary": 64}),
}

BACKENDS = ("cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """A program was asked for on a backend that does not implement it."""


def backend_of(*tensors: torch.Tensor) -> str:
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"a byte program's tensors must share one device, got {sorted(devices)}")
    (device,) = devices
    if device not in BACKENDS:
        raise BackendUnavailable(f"no byte-program backend for device type {device!r}")
    return device


@functools.cache  # imported once: every program call resolves its backend (eager host time)
def backend_module(backend: str) -> ModuleType:
    try:
        return importlib.import_module(f"lockstep_exact.programs.{backend}")
    except ModuleNotFoundError as err:
        raise BackendUnavailable(
            f"the {backend!r} backend of the byte programs is not available here ({err}); "
            "Lockstep never falls back to a non-exact path"
        ) from err


def _impl(fn_name: str, *tensors: torch.Tensor):
    backend = backend_of(*tensors)
    module = backend_module(backend)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise BackendUnavailable(f"{module.__name__} does not implement {fn_name}")
    note(f"{backend}.{fn_name}")  # the op site's kernel record (programs.kernels)
    return fn


_POSITION_BOUND: ContextVar[int | None] = ContextVar("lockstep_position_bound", default=None)


@contextmanager
def position_bound(n: int) -> Iterator[None]:
    """A promise that every position a program is given lies in [0, n). Under it the cuda
    programs read no position on the host (rope sizes its table from ``n`` and checks the
    promise on the device), so a step can be captured in a CUDA graph; the bytes are the
    same either way (a rope table row depends on its position only)."""
    if int(n) < 1:
        raise ValueError(f"position_bound: the bound must be positive, got {n}")
    token = _POSITION_BOUND.set(int(n))
    try:
        yield
    finally:
        _POSITION_BOUND.reset(token)


def position_bound_now() -> int | None:
    """The bound of the innermost ``position_bound``, or None outside one."""
    return _POSITION_BOUND.get()


def gemm(x, w, *, bk: int, out_dtype=torch.bfloat16):
    return _impl("gemm", x, w)(x, w, bk=bk, out_dtype=out_dtype)


def kpart_partial(x, w, *, bk: int, parts: int):
    """gemm.kpart on one rank's share of K: fp32 [..., N], the balanced pairwise tree over its
    ``parts`` equal, contiguous K partitions of gemm.kblock fp32 sums (``parts`` a power of
    two dividing this K). A rank's partitions are a whole subtree of the full tree."""
    k_dim = x.shape[-1]
    if parts < 1 or parts & (parts - 1) or k_dim % parts:
        raise ValueError(
            f"gemm.kpart: {parts} partitions must be a power of two dividing K = {k_dim}"
        )
    size = k_dim // parts
    backend = backend_of(x, w)
    module = backend_module(backend)
    one_call = getattr(module, "kpart_partial", None)
    if parts > 1 and one_call is not None:
        # The backend's own form of the same partitions and fold, at every row count (gated
        # bitwise; the cuda one picks its kernels by rows and records which).
        note(f"{backend}.kpart_partial")
        return one_call(x, w, bk=bk, parts=parts)
    # K-slices as views: the cuda gemm reads them in place (a row stride), the cpu gemm's
    # elementwise fp32 operations give the same bytes whatever the operands' layout.
    sums = [
        gemm(
            x[..., p * size : (p + 1) * size],
            w[:, p * size : (p + 1) * size],
            bk=bk,
            out_dtype=torch.float32,
        )
        for p in range(parts)
    ]
    return fold_tree(sums)


def fold_tree(parts):
    """The balanced adjacent-pair tree over a power-of-two list of fp32 tensors (element 2i
    plus element 2i+1, level by level): the fixed fold of canonical partitions and of ranks."""
    parts = list(parts)
    n = len(parts)
    if n < 1 or n & (n - 1):
        raise ValueError(f"fold_tree: {n} partials; a power of two is required")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


class Gather:
    """How the ranks sharing one tensor-parallel group exchange fp32 partials: ``size`` ranks;
    ``all(t)`` returns every rank's ``t`` in rank order (an all-gather). This one is a single
    device; engines hand the programs their own (``torch.distributed`` over gloo or NCCL)."""

    size = 1

    def all(self, t):
        return [t]

    def cat(self, t, widths):
        """Every rank's ``t``, ``widths[r]`` wide in its last dim, concatenated along it in
        rank order: each is padded to the widest, all-gathered, and cut back (no arithmetic)."""
        padded = torch.nn.functional.pad(t, (0, max(widths) - t.shape[-1]))
        parts = self.all(padded)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


LOCAL = Gather()


def gemm_kpart(x, w, *, bk: int, parts: int, out_dtype=torch.bfloat16, gather=LOCAL):
    """gemm.kpart: x [..., K] times w [N, K]^T with K cut into ``parts`` canonical partitions.

    Each partition is a gemm.kblock fp32 sum; the partition sums are added over the balanced
    pairwise tree; one rounding to ``out_dtype``. Under tensor parallelism each of
    ``gather.size`` ranks holds a contiguous share of K (the size dividing ``parts``): it
    folds its own partitions (a whole subtree), ``gather.all`` collects every rank's fp32
    partial in rank order and the top of the same tree folds them, so every layout gives the
    bytes of one device. Never an all-reduce: its order is the backend's, not the contract's.
    """
    ranks = gather.size
    if parts % ranks:
        raise ValueError(
            f"gemm.kpart: {ranks} tensor-parallel ranks do not divide the contract's {parts} "
            "K partitions"
        )
    local = kpart_partial(x, w, bk=bk, parts=parts // ranks)
    total = local if ranks == 1 else fold_tree(gather.all(local))
    return total if out_dtype == torch.float32 else round_bf16(total)


def expert_plan(ids, experts: int):
    """A router's ids [T, k] sorted by expert on their device, for ``gemm_grouped``
    (``programs.grouping.ExpertPlan``; no host read). A backend with a one-launch form
    (cuda: ``programs/cuda/plan.py``) computes the same integers in one kernel."""
    one_launch = getattr(backend_module(backend_of(ids)), "expert_plan", None)
    if one_launch is not None:
        return one_launch(ids, experts)
    return _grouping.expert_plan(ids, experts)


def gemm_grouped(x, w, plan, *, bk: int, parts: int, out_dtype=torch.bfloat16):
    """Every sorted pair of ``plan`` through its expert's weight, the experts' gemm at once.

    ``x``: [P, K] rows in the plan's sorted order; ``w``: [E, N, K] the experts' weights
    stacked. Row i of the result is gemm.kblock{bk} (``parts`` = 1) or gemm.kpart{bk, parts}
    (one device) of x[i] and w[expert of pair i]: the bytes of running each expert's rows
    through the plain program, which a row's bytes never depend on the other rows of."""
    backend = backend_of(x, w)
    one_launch = getattr(backend_module(backend), "gemm_grouped", None)
    if one_launch is not None:
        note(f"{backend}.gemm_grouped")
        return one_launch(x, w, plan, bk=bk, parts=parts, out_dtype=out_dtype)
    # The definition, run as it reads (the cpu backend): each expert's rows through the plain
    # program, the experts found by one host read of the plan's bounds.
    if w.dim() != 3 or w.shape[0] != plan.experts or x.shape[0] != plan.pairs:
        raise ValueError(
            f"gemm_grouped: rows {tuple(x.shape)} and weights {tuple(w.shape)} do not fit a "
            f"plan of {plan.pairs} pairs over {plan.experts} experts"
        )
    y = torch.empty(plan.pairs, w.shape[1], dtype=out_dtype, device=x.device)
    bounds = plan.bounds.tolist()
    for e in range(plan.experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = (
                gemm(x[lo:hi], w[e], bk=bk, out_dtype=out_dtype)
                if parts == 1
                else gemm_kpart(x[lo:hi], w[e], bk=bk, parts=parts, out_dtype=out_dtype)
            )
    return y


def rmsnorm(x, weight, eps: float):
    return _impl("rmsnorm", x, weight)(x, weight, eps)


def residual_add(a, b):
    return _impl("residual_add", a, b)(a, b)


def swiglu(gate, up):
    return _impl("swiglu", gate, up)(gate, up)


def _within_bound(x, positions, what: str) -> None:
    """A host tensor's positions against ``position_bound``'s promise, checked here (the cuda
    kernels check it on the device and stop), so a broken promise fails on every backend."""
    bound = position_bound_now()
    if bound is None or x.is_cuda or positions.is_cuda or not len(positions):
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= bound:
        raise ValueError(
            f"{what}: position {hi if hi >= bound else lo} outside the promised range "
            f"[0, {bound}) of programs.position_bound"
        )


def rope(x, positions, base: float):
    _within_bound(x, positions, "rope")
    return _impl("rope", x)(x, positions, base)


def rope_partial(x, positions, base: float, rotary: int):
    """rope.partial: rope.neox on the first ``rotary`` dims of each head, the rest copied."""
    _within_bound(x, positions, "rope.partial")
    return _impl("rope_partial", x)(x, positions, base, rotary)


def attention(q, k, v, positions, *, scale=None, block: int, segment: int):
    return _impl("attention", q, k, v)(
        q, k, v, positions, scale=scale, block=block, segment=segment
    )


def attention_varlen(
    q, k, v, positions, q_starts, k_starts, *, max_rows: int, block: int, segment: int
):
    """attention.blocked for many sequences at once: request r's rows
    q[q_starts[r]:q_starts[r+1]] over its keys k/v[k_starts[r]:k_starts[r+1]]. Each row has
    the bytes ``attention`` gives on its request's rows and keys (cpu: ``attention`` per
    request; cuda: one launch). ``max_rows`` bounds every request's row count."""
    return _impl("attention_varlen", q, k, v)(
        q, k, v, positions, q_starts, k_starts, max_rows=max_rows, block=block, segment=segment
    )


def attention_decode_paged(
    q, key_cache, value_cache, block_table, seq_lens, positions, *, max_seq_len: int,
    block: int, segment: int,
):  # fmt: skip
    """attention.blocked for a batch of one-token decodes over a paged KV cache (the cuda
    backend; each row has the bytes ``attention`` gives on its request's contiguous keys)."""
    return _impl("attention_decode_paged", q, key_cache, value_cache)(
        q, key_cache, value_cache, block_table, seq_lens, positions, max_seq_len=max_seq_len,
        block=block, segment=segment,
    )  # fmt: skip


def write_pages(key_cache, value_cache, k, v, slots) -> None:
    """Copy K/V rows into their paged-cache slots (slot < 0 skipped): a copy, no arithmetic."""
    _impl("write_pages", key_cache, value_cache, k, v)(key_cache, value_cache, k, v, slots)


def softmax(x):
    return _impl("softmax", x)(x)


def log_softmax(x):
    return _impl("log_softmax", x)(x)


def log_softmax_sharded(x, start: int, vocab: int, gather=LOCAL):
    """log_softmax.tree of a row the ranks of ``gather`` hold in contiguous shards.

    ``x`` [..., n] fp32 is this rank's columns [start, start + n) of the vocabulary, which may
    be padded (Megatron's): columns from ``vocab`` on are cut before the program sees them.
    Returns [..., r], the log-probabilities of this rank's r real columns; the ranks' results
    concatenated in rank order are the bytes of ``log_softmax`` on the whole row.

    cpu: every rank sums exp over the nodes of the unsharded tree that lie inside its columns,
    the nodes (and each rank's max, exact) are all-gathered in rank order, and the top of the
    same tree is folded from them: the additions of the unsharded program. A backend without
    that split (cuda: its lanes sum in another shape) all-gathers the whole fp32 row and runs
    its ``log_softmax``: the same bytes, a row of memory per rank.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ValueError(f"log_softmax.tree takes float32 logits, got {getattr(x, 'dtype', x)}")
    n = x.shape[-1]
    if start < 0 or vocab < 1:
        raise ValueError(f"log_softmax.tree: shard at column {start} of a {vocab}-column row")
    real = max(0, min(n, vocab - start))
    x = x[..., :real]
    if gather.size == 1:
        if start != 0 or real != vocab:
            raise ValueError(
                f"log_softmax.tree: one rank holds columns [{start}, {start + n}) of a "
                f"{vocab}-column row; a single rank must hold the whole row"
            )
        return log_softmax(x)
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= int(d)
    meta = torch.tensor([start, n, rows], dtype=torch.int64, device=x.device)
    metas = [tuple(int(v) for v in m.tolist()) for m in gather.all(meta)]
    if len({m[2] for m in metas}) != 1:
        counts = [m[2] for m in metas]
        raise ValueError(f"log_softmax.tree: the ranks hold different numbers of rows: {counts}")
    end = 0
    for r, (s0, w, _) in enumerate(metas):
        if s0 != end:
            raise ValueError(
                f"log_softmax.tree: rank {r} holds columns from {s0}, but the ranks before it "
                f"end at {end}: the shards must tile the vocabulary in rank order"
            )
        end = s0 + w
    if end < vocab:
        raise ValueError(f"log_softmax.tree: the {len(metas)} shards end at column {end} < {vocab}")
    ranges = [(min(s0, vocab), min(s0 + w, vocab)) for s0, w, _ in metas]
    x2 = x.reshape(rows, real)
    backend = backend_of(x)
    module = backend_module(backend)
    if not hasattr(module, "shard_tree_nodes"):
        full = gather.cat(x2, [hi - lo for lo, hi in ranges])
        lo = min(start, vocab)
        return log_softmax(full)[:, lo : lo + real].reshape(*lead, real)
    m_local = x2.amax(-1) if real else x2.new_full((rows,), float("-inf"))
    m = torch.stack(gather.all(m_local)).amax(0)  # exact in any order
    s = x2 - m[:, None]
    note(f"{backend}.shard_tree_nodes")
    nodes = module.shard_tree_nodes(s, min(start, vocab), vocab)
    total = module.fold_tree_nodes(ranges, gather.all(nodes), vocab)
    return module.log_softmax_from_sum(s, total).reshape(*lead, real)


def router_topk(logits, k: int, *, normalize: bool = True):
    return _impl("router_topk", logits)(logits, k, normalize=normalize)


def moe_fold(expert_out, weights, *, acc: str = "bf16"):
    if acc == "bf16":
        return _impl("moe_fold", expert_out, weights)(expert_out, weights)
    if acc == "fp32":
        return _impl("moe_fold_fp32", expert_out, weights)(expert_out, weights)
    raise ValueError(f"moe.fold: unknown accumulation {acc!r} (bf16 or fp32)")


def lora_shrink(x, a, *, bk: int):
    return _impl("lora_shrink", x, a)(x, a, bk=bk)


def lora_expand(base, t, b, scale: float, *, bk: int):
    return _impl("lora_expand", base, t, b)(base, t, b, scale, bk=bk)


# --- the hybrid lane (Qwen3-Next) -----------------------------------------------------------
GdnState = cpu.GdnState


def gdn_state(h_k: int, h_v: int, d_k: int, d_v: int, *, chunk: int, device=None) -> GdnState:
    """The gdn.chunked cache of a sequence at position 0 (S = 0, empty window), its tensors on
    ``device`` (cpu if None): a model's states live on its device."""
    return cpu.gdn_state(h_k, h_v, d_k, d_v, chunk=chunk, device=device)


def gdn_chunked(q, k, v, g, beta, state, *, position: int, chunk: int):
    """gdn.chunked: (out [T, Hv, V] bf16, state') for T new tokens of one sequence at absolute
    positions ``position ..``; ``state`` is the sequence's GdnState
    (docs/programs/gdn.chunked.md)."""
    # The state's tensors pick the backend with the tokens': a cpu state with cuda tokens is
    # refused here, naming both devices.
    return _impl("gdn_chunked", q, k, v, g, beta, *cpu.gdn.state_tensors(state))(
        q, k, v, g, beta, state, position=position, chunk=chunk
    )


GdnPages = cpu.GdnPages
PagedSeqs = cpu.PagedSeqs
PagedPasses = cpu.PagedPasses
paged_seqs = cpu.paged_seqs
paged_passes = cpu.paged_passes
paged_decodes = cpu.paged_decodes


def _by_passes(call, xs, passes):
    """``call(*rows_of_xs, seqs)`` for each pass of ``passes`` (``PagedPasses``), in order, its
    output rows put back where the pass's rows came from."""
    if any(x.shape[0] != passes.rows for x in xs):
        raise ValueError(f"paged passes: {xs[0].shape[0]} rows, the step's table {passes.rows}")
    out = None
    for rows, seqs in passes.passes:
        part = call(*(x[rows] for x in xs), seqs)
        if out is None:
            out = torch.empty((passes.rows, *part.shape[1:]), dtype=part.dtype, device=part.device)
        out[rows] = part
    return out


def gdn_paged(q, k, v, g, beta, pages, seqs, *, chunk: int):
    """gdn.chunked for many sequences at once, each continued from its state page
    (``GdnPages``; ``seqs``: ``paged_seqs``, each sequence's rows inside one chunk, or
    ``paged_passes``, a pass per chunk): every row has the bytes ``gdn_chunked`` gives on its
    sequence's state, and the pages are advanced (cpu: a call per sequence; cuda: one launch
    a pass)."""
    run = _impl("gdn_paged", q, k, v, g, beta, pages.s, pages.k)
    if isinstance(seqs, PagedPasses):
        if chunk != seqs.chunk:
            raise ValueError(f"gdn paged: chunk {chunk}, the step's table {seqs.chunk}")
        return _by_passes(
            lambda *xs: run(*xs[:5], pages, xs[5], chunk=chunk), (q, k, v, g, beta), seqs
        )
    return run(q, k, v, g, beta, pages, seqs, chunk=chunk)


def conv1d_paged(x, weight, pages, seqs, *, kernel: int = 4):
    """conv1d.causal for many sequences at once, each continued from its page's window: every
    row has the bytes ``conv1d_causal`` gives on its sequence; the windows are advanced
    (cpu: a call per sequence; cuda: one launch a pass of ``paged_passes``)."""
    run = _impl("conv1d_paged", x, weight, pages.conv)
    if isinstance(seqs, PagedPasses):
        return _by_passes(lambda rows, s: run(rows, weight, pages, s, kernel=kernel), (x,), seqs)
    return run(x, weight, pages, seqs, kernel=kernel)


def gdn_gating(a, b, a_log, dt_bias):
    """gdn.gating: (g, beta) fp32 [T, Hv] from the bf16 a/b projections, A_log and dt_bias."""
    return _impl("gdn_gating", a, b, a_log, dt_bias)(a, b, a_log, dt_bias)


def l2norm(x, eps: float = 1e-6):
    """gdn.l2norm: bf16 [..., D] -> fp32, each row over the tree norm (q and k of gdn.chunked)."""
    return _impl("l2norm", x)(x, eps)


def conv1d_causal(x, weight, window, *, kernel: int = 4):
    """conv1d.causal: (bf16 out [T, D], window' [kernel-1, D]) for one sequence, SiLU after."""
    return _impl("conv1d_causal", x, weight, window)(x, weight, window, kernel=kernel)


def conv1d_window(d: int, *, kernel: int = 4, device=None):
    """The conv1d.causal window of a sequence at position 0 (zeros on ``device``, cpu if None)."""
    return cpu.conv1d_window(d, kernel=kernel, device=device)


def rmsnorm_zero_centered(x, weight, eps: float):
    return _impl("rmsnorm_zero_centered", x, weight)(x, weight, eps)


def rmsnorm_gated(x, z, weight, eps: float):
    return _impl("rmsnorm_gated", x, z, weight)(x, z, weight, eps)


def sigmoid_gate(x, gate):
    return _impl("sigmoid_gate", x, gate)(x, gate)


def shared_expert_gate(routed, shared, logit):
    return _impl("shared_expert_gate", routed, shared, logit)(routed, shared, logit)


def round_bf16(x):
    return _impl("round_bf16", x)(x)


def sample(logprobs, *, temperature, top_p, seeds, positions, rounds: int = 3, check=True):
    """int64 [T]: the token each fp32 log-probability row draws (sample.gumbel_topp).

    ``temperature``/``top_p``: a number or one per row; ``seeds``/``positions``: one per row
    (the request's seed, the absolute position of the token being chosen).

    A row with a NaN or no finite entry draws nothing: the call raises, naming the problem.
    With ``check=False`` a backend whose check would read the device (cuda) returns -1 for
    such a row instead, without waiting for the device; the caller then must refuse any -1
    before a token is used (vLLM's lane does when the tokens reach the host). Other backends
    raise as with ``check=True``.
    """
    return _impl("sample", logprobs)(
        logprobs,
        temperature=temperature,
        top_p=top_p,
        seeds=seeds,
        positions=positions,
        rounds=rounds,
        check=check,
    )


__all__ = [
    "BACKENDS",
    "CATALOG",
    "BackendUnavailable",
    "GdnState",
    "conv1d_causal",
    "conv1d_window",
    "gdn_chunked",
    "gdn_gating",
    "gdn_state",
    "l2norm",
    "rmsnorm_gated",
    "rmsnorm_zero_centered",
    "shared_expert_gate",
    "sigmoid_gate",
    "Program",
    "attention",
    "attention_decode_paged",
    "attention_varlen",
    "backend_of",
    "conv1d_paged",
    "gdn_paged",
    "GdnPages",
    "PagedPasses",
    "PagedSeqs",
    "paged_passes",
    "paged_seqs",
    "paged_decodes",
    "backend_module",
    "Gather",
    "LOCAL",
    "fold_tree",
    "gemm",
    "expert_plan",
    "gemm_grouped",
    "gemm_kpart",
    "kpart_partial",
    "log_softmax",
    "log_softmax_sharded",
    "lora_expand",
    "lora_shrink",
    "moe_fold",
    "position_bound",
    "position_bound_now",
    "residual_add",
    "rmsnorm",
    "rope",
    "rope_partial",
    "round_bf16",
    "router_topk",
    "sample",
    "softmax",
    "swiglu",
    "write_pages",
]
