"""Contract execution: the one way a lane composition calls a byte program.

``Ops(contract)`` is handed to the composition. Every call names its op site by its full path
(``layers.3.self_attn.q_proj``); the site's contract key is that path with every numeric part
replaced by ``*`` (``layers.*.self_attn.q_proj``), so one name serves the contract, the recorded
sites of ``lockstep bisect``, and error messages. The call reads the site's program and
parameters from the contract and runs that, nothing else: editing the contract moves the bytes.

Every call is also logged in ``invoked`` (site key -> the program it ran). The contract an
engine reports is built from that log (``invoked_contract``) after a forward it really ran, so
admission compares what each half executed, not what one function says both would execute.
With ``grad=True`` every program is wrapped as an autograd function (exact forward, the
textbook op's VJP backward: ``programs.vjp``), which is how a trainer runs the same composition.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

from .. import programs as P
from ..contract import Contract, ContractMismatch
from ..programs import Program
from ..programs import kernels as K
from ..programs import vjp as V
from ..sites import record

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def site_key(path: str) -> str:
    """``layers.3.mlp.experts.12.down_proj`` -> ``layers.*.mlp.experts.*.down_proj``."""
    return _INDEX.sub("*", path)


class SiteNotInContract(ContractMismatch):
    """The composition reached an op site its contract does not name."""


def site(method: Callable) -> Callable:
    """An op-site method (``self, path, ...``): the kernels its programs note while it runs
    are recorded under the site's key (``Ops.kernels``)."""

    @functools.wraps(method)
    def run(self, path: str, *args, **kwargs):
        with K.noting() as notes:
            out = method(self, path, *args, **kwargs)
        self.kernels.setdefault(site_key(path), set()).update(notes)
        return out

    return run


class AttentionSite:
    """A layer's attention op site as the engine's ``attend`` slot receives it: ``site`` its
    path; called per sequence, ``core(q_rows, keys, values, positions)``, or for many sequences
    at once, ``core.varlen(q, keys, values, positions, q_starts, k_starts, max_rows=...)``
    (``Ops.attention_varlen``: the same row bytes, one launch on cuda). Both run inside the
    site, so the kernels they note are recorded for it."""

    def __init__(self, ops: Ops, site: str):
        self.ops, self.site = ops, site

    def __call__(self, q, k, v, positions):
        return self.ops.attention(self.site, q, k, v, positions)

    def varlen(self, q, k, v, positions, q_starts, k_starts, *, max_rows: int):
        return self.ops.attention_varlen(
            self.site, q, k, v, positions, q_starts, k_starts, max_rows=max_rows
        )


class Ops:
    """The byte programs of one contract, called by op-site path."""

    def __init__(self, contract: Contract, *, grad: bool = False):
        self.contract = contract
        self.grad = grad
        self.invoked: dict[str, Program] = {}
        self.kernels: dict[str, set[str]] = {}  # site key -> the kernels it ran (``site``)

    # --- bookkeeping -----------------------------------------------------------------------
    def program(self, path: str, expect: str | tuple[str, ...]) -> Program:
        """The contract's program at ``path``; it must be a ``expect`` program (or one of)."""
        key = site_key(path)
        prog = self.contract.sites.get(key)
        if prog is None:
            raise SiteNotInContract(
                f"op site {key!r} is not in the contract of lane {self.contract.lane}; "
                "the composition and the contract disagree"
            )
        if prog.name not in ((expect,) if isinstance(expect, str) else expect):
            raise ContractMismatch(
                f"op site {key!r}: the contract names {prog.ident}, the composition runs a "
                f"{expect if isinstance(expect, str) else ' or '.join(expect)} program there"
            )
        return prog

    def _ran(self, path: str, prog: Program) -> None:
        key = site_key(path)
        seen = self.invoked.setdefault(key, prog)
        if seen != prog:
            raise ContractMismatch(
                f"op site {key!r} ran two programs in one lane: {seen.ident} and {prog.ident}"
            )

    def invoked_contract(self) -> Contract:
        """The contract of what this engine actually ran: its sites are the invoked log."""
        if not self.invoked:
            raise RuntimeError(
                "no op site has run yet: the invoked contract comes from a real forward"
            )
        c = self.contract
        kernels = {k: tuple(sorted(self.kernels.get(k, ()))) for k in self.invoked}
        return Contract(
            c.lane, c.dtype, c.backend, c.layout, c.geometry, dict(self.invoked), c.pins, kernels
        )

    def _call(self, path: str, prog: Program, fn: Callable, ideal: Callable, *xs):
        self._ran(path, prog)
        out = V.exact(fn, ideal, *xs) if self.grad else fn(*xs)
        return record(path, out)

    # --- the programs ------------------------------------------------------------------------
    @site
    def embed(self, path: str, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        prog = self.program(path, "embedding.gather")
        self._ran(path, prog)
        K.note("gather")  # a row copy on any device: no backend function
        return record(path, table[ids])

    @site
    def gemm(self, path: str, x, w, gather=P.LOCAL):
        """gemm.kblock, or gemm.kpart where the contract says so (a row-parallel site: under
        tensor parallelism ``x``/``w`` are this rank's share of K and ``gather`` collects
        the ranks' fp32 partials; the VJP is the local matmul's, as for any row-parallel
        linear whose output gradient every rank holds)."""
        prog = self.program(path, ("gemm.kblock", "gemm.kpart"))
        out = {"bf16": torch.bfloat16, "fp32": torch.float32}[prog.param("out")]
        bk = prog.param("bk")
        if prog.name == "gemm.kpart":
            parts = prog.param("parts")

            def fn(a, b):
                return P.gemm_kpart(a, b, bk=bk, parts=parts, out_dtype=out, gather=gather)
        else:
            if gather.size != 1:
                raise ContractMismatch(
                    f"op site {site_key(path)!r} runs {prog.ident}, which has no K partitions: "
                    f"it cannot be split over {gather.size} tensor-parallel ranks"
                )

            def fn(a, b):
                return P.gemm(a, b, bk=bk, out_dtype=out)

        return self._call(path, prog, fn, V.gemm, x, w)

    @site
    def gemm_grouped(self, path: str, x, w, plan):
        """The site's gemm.kblock or gemm.kpart (one device) for the rows of an expert plan
        (``path`` names the site with ``*`` for the expert): x [P, K] in the plan's sorted
        order, w [E, N, K] the experts' weights stacked. Row i has the bytes of the site's
        program on x[i] and its expert's weight (serving only, no VJP)."""
        prog = self.program(path, ("gemm.kblock", "gemm.kpart"))
        if self.grad:
            raise ContractMismatch(f"op site {site_key(path)!r}: grouped experts have no VJP")
        self._ran(path, prog)
        out = {"bf16": torch.bfloat16, "fp32": torch.float32}[prog.param("out")]
        parts = prog.param("parts") if prog.name == "gemm.kpart" else 1
        return P.gemm_grouped(x, w, plan, bk=prog.param("bk"), parts=parts, out_dtype=out)

    @site
    def rmsnorm(self, path: str, x, w):
        prog = self.program(path, "rmsnorm.qwen3")
        eps = prog.param("eps")
        return self._call(path, prog, lambda a, b: P.rmsnorm(a, b, eps), V.rmsnorm(eps), x, w)

    @site
    def residual_add(self, path: str, a, b):
        prog = self.program(path, "residual.add")
        return self._call(path, prog, P.residual_add, V.residual_add, a, b)

    @site
    def swiglu(self, path: str, gate, up):
        prog = self.program(path, "swiglu")
        return self._call(path, prog, P.swiglu, V.swiglu, gate, up)

    @site
    def rope(self, path: str, x, positions):
        prog = self.program(path, "rope.neox")
        base = prog.param("base")
        return self._call(
            path, prog, lambda a: P.rope(a, positions, base), V.rope(positions, base), x
        )

    @site
    def attention(self, path: str, q, k, v, positions):
        """One sequence: q [T, Hq, D] at ``positions``, k/v [S, Hkv, D] from position 0."""
        prog = self.program(path, "attention.blocked")
        block, segment = prog.param("block"), prog.param("segment")
        return self._call(
            path,
            prog,
            lambda a, b, c: P.attention(a, b, c, positions, block=block, segment=segment),
            V.attention(positions),
            q,
            k,
            v,
        )

    @site
    def attention_varlen(self, path: str, q, k, v, positions, q_starts, k_starts, *, max_rows):
        """The site's attention.blocked for many sequences at once (``P.attention_varlen``:
        each row the bytes of ``attention`` on its request's rows and keys; serving only, no
        VJP)."""
        prog = self.program(path, "attention.blocked")
        if self.grad:
            raise ContractMismatch(f"op site {site_key(path)!r}: the many-sequence form has no VJP")
        self._ran(path, prog)
        out = P.attention_varlen(
            q, k, v, positions, q_starts, k_starts, max_rows=max_rows,
            block=prog.param("block"), segment=prog.param("segment"),
        )  # fmt: skip
        return record(path, out)

    @site
    def attention_decode_paged(
        self, path: str, q, key_cache, value_cache, block_table, seq_lens, positions, *,
        max_seq_len: int,
    ):  # fmt: skip
        """The site's attention.blocked for a batch of one-token decodes over a paged cache
        (each row the bytes of ``attention`` on its request's keys; serving only, no VJP)."""
        prog = self.program(path, "attention.blocked")
        if self.grad:
            raise ContractMismatch(f"op site {site_key(path)!r}: the paged decode has no VJP")
        self._ran(path, prog)
        out = P.attention_decode_paged(
            q, key_cache, value_cache, block_table, seq_lens, positions,
            max_seq_len=max_seq_len, block=prog.param("block"), segment=prog.param("segment"),
        )  # fmt: skip
        return record(path, out)

    @site
    def router(self, path: str, logits):
        """(expert ids [T, k], weights [T, k] bf16); ids are recorded as ``<path>.ids``."""
        prog = self.program(path, "router.softmax_topk")
        k, normalize = prog.param("k"), prog.param("normalize")
        ids, wts = P.router_topk(logits.detach(), k, normalize=normalize)
        record(f"{path}.ids", ids)
        weights = self._call(path, prog, lambda _lg: wts, V.router_weights(ids, normalize), logits)
        return ids, weights

    @site
    def moe_fold(self, path: str, expert_out, weights):
        prog = self.program(path, "moe.fold")
        acc = prog.param("acc")
        return self._call(
            path, prog, lambda y, w: P.moe_fold(y, w, acc=acc), V.moe_fold, expert_out, weights
        )

    @site
    def lora_shrink(self, path: str, x, a):
        prog = self.program(path, "lora.shrink")
        bk = prog.param("bk")
        return self._call(path, prog, lambda u, v: P.lora_shrink(u, v, bk=bk), V.lora_shrink, x, a)

    @site
    def lora_expand(self, path: str, base, t, b, scale: float):
        prog = self.program(path, "lora.expand")
        bk = prog.param("bk")
        return self._call(
            path,
            prog,
            lambda y, u, v: P.lora_expand(y, u, v, scale, bk=bk),
            V.lora_expand(scale),
            base,
            t,
            b,
        )

    @site
    def log_softmax(self, path: str, logits, *, start: int = 0, vocab=None, gather=P.LOCAL):
        """log_softmax.tree over the row. Vocab-parallel (``vocab`` given, or ``gather`` over
        several ranks): ``logits`` are this rank's columns [start, start + n) of a possibly
        padded vocabulary of ``vocab`` real columns, and the result is this rank's real
        columns, with the unsharded bytes (``programs.log_softmax_sharded``)."""
        prog = self.program(path, "log_softmax.tree")
        if vocab is None and gather.size == 1:
            return self._call(path, prog, P.log_softmax, V.log_softmax, logits)
        vocab = logits.shape[-1] if vocab is None else vocab

        def fn(z):
            return P.log_softmax_sharded(z, start, vocab, gather)

        return self._call(path, prog, fn, _sharded_log_softmax_ideal(start, vocab, gather), logits)

    @site
    def sample(self, path: str, logprobs, *, temperature, top_p, seeds, positions, check=True):
        """int64 [T]: each fp32 log-probability row's token under the contract's sampling rule
        (``check=False``: ``programs.sample``'s deferred refusal, -1 for a row it cannot draw).

        A decision, not a tensor site: logged in ``invoked`` but not recorded for bisect."""
        prog = self.program(path, "sample.gumbel_topp")
        self._ran(path, prog)
        return P.sample(
            logprobs,
            temperature=temperature,
            top_p=top_p,
            seeds=seeds,
            positions=positions,
            rounds=prog.param("rounds"),
            check=check,
        )


class _RowGather(torch.autograd.Function):
    """Every rank's real columns concatenated in rank order (the whole row); backward: the
    gradients every rank computed for this rank's columns, summed in rank order."""

    @staticmethod
    def forward(ctx, gather, lo, z):
        widths = [int(w) for w in gather.all(torch.tensor([z.shape[-1]], device=z.device))]
        ctx.gather, ctx.lo, ctx.width = gather, lo, z.shape[-1]
        return gather.cat(z, widths)

    @staticmethod
    def backward(ctx, grad):
        total = None
        for g in ctx.gather.all(grad.contiguous()):
            total = g if total is None else total + g
        return None, None, total[..., ctx.lo : ctx.lo + ctx.width]


def _sharded_log_softmax_ideal(start: int, vocab: int, gather):
    """The textbook VJP of a vocab-parallel log_softmax: this rank's columns of
    torch.log_softmax over the gathered row (a collective in the backward, too)."""

    def ideal(z):
        real = max(0, min(z.shape[-1], vocab - start))
        lo = min(start, vocab)
        zr = z[..., :real]
        if gather.size == 1:
            return torch.log_softmax(zr, dim=-1)
        full = _RowGather.apply(gather, lo, zr)
        return torch.log_softmax(full, dim=-1)[..., lo : lo + real]

    return ideal


def check_kernels(invoked: Contract, who: str) -> None:
    """Every site ``who`` ran must have run kernels its program's tests gate on its backend
    (``programs.kernels``), and a record must be there: an invoked contract without one is
    refused."""
    if not invoked.kernels:
        raise ContractMismatch(
            f"{who}'s invoked contract records no kernels; it was made before kernels were "
            "recorded: run it again with this release"
        )
    where = K.ungated(
        {k: p.name for k, p in invoked.sites.items()}, invoked.kernels, invoked.backend
    )
    if where is not None:
        raise ContractMismatch(f"{who}: {where}")


def check_invoked(declared: Contract, invoked: Contract, who: str) -> None:
    """Every site ``who`` ran must be a declared site running the declared program."""
    for key in sorted(invoked.sites):
        want = declared.sites.get(key)
        got = invoked.sites[key]
        if want is None:
            raise ContractMismatch(f"{who} ran op site {key!r}, which its contract does not name")
        if want != got:
            raise ContractMismatch(
                f"{who} ran {got.ident} at op site {key!r}; its contract says {want.ident}"
            )


def to_bf16(x: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """An fp32 master seen in bf16 (RNE), with a straight-through gradient when training."""
    return V.exact(P.round_bf16, V.identity, x) if grad else P.round_bf16(x)
