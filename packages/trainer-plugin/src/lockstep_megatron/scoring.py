"""Replay's scoring, in this process: recompute every decision of a trace in Megatron (teacher
forcing). ``replay.replay`` is the entry point (it runs ``replay_in_process`` here, or
``parallel.replay_tp``'s ranks, each of which runs it).

Admission first (contract fingerprint, model hash, adapter hash; the first mismatch is named),
then each sequence (prompt + sampled tokens) is teacher-forced in micro-batches of the
trainer's choosing, right-padded, and the logprob of every sampled token is gathered in the
trace's decision order. A trace drawn by a lane sampler records its sampling rule and seeds:
each sampled token must then be the rule's draw from the trainer's own row (``TokenRule``),
or the trace is refused naming the first decision that is not.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lockstep_exact.contract import (
    ContractMismatch,
    contract_from_json,
    first_difference,
)
from lockstep_exact.lanes.ops import check_invoked, check_kernels
from lockstep_exact.model import ModelDir
from lockstep_exact.trace import MANIFEST, TEACHER_FORCED, Trace

from . import export
from .convert import build
from .gdn.refusals import check_replay as check_hybrid_replay
from .spec import LockstepGPT


class AdmissionError(ContractMismatch):
    """The trace was not sampled from this model, adapter and lane."""


class TokenMismatch(AdmissionError):
    """A sampled token of the trace is not the one the trace's sampling rule draws."""


class TokenRule:
    """The trace's sampling rule, recomputed on the trainer's own logprob rows.

    A trace drawn by a lane sampler records the rule (``sampling.rule``, a byte program
    ident), its temperature and top-p, and each sequence's seed; the token at position ``q``
    of sequence ``i`` must be ``P.sample(row, temperature, top_p, seeds[i], q)`` of the row
    that predicts it. A teacher-forced reference (``rule`` ``TEACHER_FORCED``: tokens given,
    not drawn) has no draw to check; a trace naming no rule is refused when it is loaded."""

    def __init__(self, trace: Trace, ops):
        sampling = trace.sampling
        self.ops = ops
        self.ident = None if sampling.rule == TEACHER_FORCED else sampling.rule
        self.temperature, self.top_p = sampling.temperature, sampling.top_p
        self.seeds = sampling.seeds
        if self.ident is None:
            return
        mine = ops.program("sample", "sample.gumbel_topp")  # this lane's contract says
        if self.ident != mine.ident:
            raise TokenMismatch(
                f"sampling rule: the trace's tokens were drawn by {self.ident}; this trainer "
                f"checks {mine.ident}"
            )
        if self.temperature != 0 and self.seeds is None:
            raise TokenMismatch(
                "sampling rule: the trace records no per-sequence seeds (sampling.seeds), so "
                "its random draws cannot be checked"
            )

    def __bool__(self) -> bool:
        return self.ident is not None

    def check(self, seq: int, rows: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> None:
        """Refuse, naming the first such decision, a token the rule does not draw from
        ``rows`` (fp32 [n, V], row j predicting the token at position prompt_len + j)."""
        n = tokens.numel()
        seed = self.seeds[seq] if self.seeds is not None else 0
        drawn = self.ops.sample(
            "sample",
            rows.to(torch.float32),
            temperature=self.temperature,
            top_p=self.top_p,
            seeds=[seed] * n,
            positions=[prompt_len + j for j in range(n)],
        ).cpu()
        bad = torch.nonzero(drawn != tokens.cpu()).reshape(-1)
        if bad.numel():
            j = int(bad[0])
            raise TokenMismatch(
                f"sampled token: sequence {seq}, position {prompt_len + j} (step {j}): the "
                f"trace has token {int(tokens[j])} but {self.ident} draws {int(drawn[j])} "
                f"(seed {seed}, temperature {self.temperature}, top_p {self.top_p})"
            )


def admit_trace(
    trace: Trace,
    model_dir: Path | ModelDir,
    adapter_dir: Path | None,
    backend: str = "cpu",
    control: bool = False,
) -> None:
    """Refuse, naming which, a trace of another contract, model or adapter. ``control``
    (negative controls only) skips the adapter check; contract and model are still admitted.

    The contract check here is against what this lane declares: every site the sampler ran
    must be a site of this lane running the same program. What the trainer itself runs is
    compared after its probe forward (``admit_invoked``). ``model_dir`` may be a parsed
    ``ModelDir``: its model hash (the weights read in full) is then computed once per job."""
    base = ModelDir.of(model_dir)
    declared = base.contract(backend)
    if trace.contract is not None:
        sampler = contract_from_json(trace.contract)
        where = first_difference(declared.with_sites(sampler.sites), sampler)
        try:
            if where is not None:
                raise ContractMismatch(f"contracts differ at {where}")
            check_invoked(declared, sampler, "the sampler")
        except ContractMismatch as err:
            raise AdmissionError(f"contract fingerprint: {err}") from err
        try:  # the kernels each site ran: recorded, and every one gated for its program
            check_kernels(sampler, "the sampler")
        except ContractMismatch as err:
            raise AdmissionError(f"kernels: {err}") from err
    if trace.model_hash != base.model_hash:
        raise AdmissionError(
            f"model hash: the trace was sampled from {trace.model_hash}, "
            f"{base.path} hashes to {base.model_hash}: replay with the model the trace was "
            f"captured from (`lockstep contract show --model DIR --model-hash` prints a "
            f"model's hash; the trace's is model_hash in its {MANIFEST})"
        )
    vocab = int(declared.geometry["vocab"])
    for name in ("prompt_tokens", "sampled_tokens"):
        ids = getattr(trace, name)
        if ids.numel() and int(ids.max()) >= vocab:
            i = int(ids.argmax())
            raise AdmissionError(
                f"{name}[{i}] = {int(ids[i])} is past the model's vocabulary ({vocab} ids): "
                "the trace was edited or made for another model; capture it again"
            )
    adapter_hash = export.adapter_hash(adapter_dir, base, backend) if adapter_dir else None
    if not control and trace.adapter_hash != adapter_hash:
        raise AdmissionError(
            f"adapter hash: the trace was sampled with adapter {trace.adapter_hash}, "
            f"the trainer has {adapter_hash}: replay with the adapter the trace was captured "
            f"with (--adapter; none if it was captured without one). "
            f"`lockstep contract show --model {base.path} --adapter DIR` prints an adapter's "
            f"hash; the trace's is adapter_hash in its {MANIFEST}"
        )


def _without(c, suffixes: tuple[str, ...]):
    """``c`` without the sites whose key ends with one of ``suffixes``."""
    return c.with_sites({k: p for k, p in c.sites.items() if not k.endswith(suffixes)})


LORA_SITES = (".lora_shrink", ".lora_expand")


def admit_invoked(
    trace: Trace,
    model: LockstepGPT,
    model_dir: Path | ModelDir,
    backend: str,
    control: bool = False,
) -> None:
    """The trainer's probe: one forward of the trace's first sequence, then what the trainer
    ran (its invoked contract) must be what the sampler ran, site by site. A negative control
    (an adapter other than the trace's, possibly none on one side) compares the non-LoRA sites
    only, and a trace with no recorded rule is compared without the rule's ``sample`` site."""
    device = next(model.parameters()).device
    with torch.no_grad():
        rule = None if control else TokenRule(trace, model.ops(device))
        sampled_logprobs(model, sequences(trace)[:1], rule)  # the rule's site runs too
    mine = model.invoked_contract(device)
    # Sites the trainer has no cause to run on this trace are not compared: a control's
    # adapter sites (either side may run none) and the rule's, when no rule is checked.
    skip = (LORA_SITES if control else ()) + (() if rule else ("sample",))
    try:
        check_invoked(ModelDir.of(model_dir).contract(backend), mine, "the Megatron lane")
    except ContractMismatch as err:
        raise AdmissionError(f"contract fingerprint: {err}") from err
    try:
        check_kernels(mine, "the Megatron lane")
    except ContractMismatch as err:
        raise AdmissionError(f"kernels: {err}") from err
    if mine.fingerprint == trace.contract_fingerprint:
        return
    where = None
    if trace.contract is not None:
        theirs = contract_from_json(trace.contract)
        mine, theirs = _without(mine, skip), _without(theirs, skip)
        where = first_difference(mine, theirs)
        if where is None:
            return
    raise AdmissionError(
        "contract fingerprint: the trainer ran "
        + (
            f"another program set ({where}; local = trainer, remote = sampler)"
            if where
            else f"{mine.fingerprint}, the trace records {trace.contract_fingerprint}"
        )
    )


def sequences(trace: Trace) -> list[tuple[torch.Tensor, int]]:
    """(prompt + sampled tokens, prompt length) per sequence."""
    return [
        (torch.cat([trace.prompt(i), trace.sampled(i)]), len(trace.prompt(i)))
        for i in range(trace.num_sequences)
    ]


def pad_batch(seqs: list[torch.Tensor], pad: int = 0) -> torch.Tensor:
    toks = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks


def sampled_logprobs(
    model: LockstepGPT,
    batch: list[tuple[torch.Tensor, int]],
    rule: TokenRule | None = None,
    first: int = 0,
) -> list:
    """Per sequence, the logprob of each sampled token (teacher forcing over the whole
    sequence; the last token is never an input). With ``rule``, each sampled token is also
    checked against the rule's draw from its full row (``first``: the trace index of
    ``batch[0]``)."""
    device = next(model.parameters()).device
    inputs = pad_batch([s[:-1] for s, _ in batch]).to(device)
    lp = model(inputs)
    out = []
    for i, (s, p) in enumerate(batch):
        rows = torch.arange(p - 1, len(s) - 1, device=device)
        if rule:
            rule.check(first + i, lp[i, rows], s[p:], p)
        out.append(lp[i, rows, s[p:].to(device)].cpu())
    return out


def share_of(num_sequences: int, micro_batch: int, index: int, ways: int) -> list[int]:
    """The micro-batches (by number) that data-parallel rank ``index`` of ``ways`` scores:
    micro-batch i goes to rank i % ways."""
    return list(range(index, -(-num_sequences // micro_batch), ways))


def score(
    model: LockstepGPT,
    trace: Trace,
    micro_batch: int = 3,
    control: bool = False,
    share: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """The trace's decisions' logprobs; the tokens are checked against the trace's sampling
    rule too, except for a negative control (a perturbed model or adapter draws otherwise).
    ``share`` (index, ways): only the micro-batches ``share_of`` gives that rank, in order
    (the expert-parallel ranks' split); a rank with one micro-batch fewer than the others
    runs one more forward of the first sequence, discarded, so every rank's MoE layers
    exchange tokens as many times."""
    seqs = sequences(trace)
    if any(p < 1 for _, p in seqs):
        raise ValueError("a sequence with an empty prompt has no logprob for its first token")
    rule = None if control else TokenRule(trace, model.ops(next(model.parameters()).device))
    index, ways = share
    mine = share_of(len(seqs), micro_batch, index, ways)
    rounds = len(share_of(len(seqs), micro_batch, 0, ways))
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for i in mine:
            b = i * micro_batch
            out.extend(sampled_logprobs(model, seqs[b : b + micro_batch], rule, b))
        for _ in range(rounds - len(mine)):
            sampled_logprobs(model, seqs[:1])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float32)


def replay_in_process(
    model_dir: Path,
    trace_dir: Path,
    adapter_dir: Path | None = None,
    backend: str = "cpu",
    micro_batch: int = 3,
    control: bool = False,
    tp: int = 1,
    ep: int = 1,
) -> tuple[torch.Tensor, float]:
    """``replay.replay`` in this process: (fp32 logprob per decision in trace order,
    seconds). At ``tp`` or ``ep`` > 1 this runs in each of ``parallel.replay_tp``'s ranks, on
    its share of the micro-batches (``share_of``)."""
    check_replay_backend(backend, tp * ep)
    check_hybrid_replay(model_dir, adapter_dir, backend, tp, ep)  # what the hybrid lane lacks
    trace = Trace.load(trace_dir)
    adapter = Path(adapter_dir) if adapter_dir else None
    # Parsed and hashed once for every check below; the Megatron half scores the hybrid lane
    # (Qwen3-Next, gdn/) too.
    base = ModelDir(model_dir, hybrid=True)
    admit_trace(trace, base, adapter, backend, control)
    t0 = time.perf_counter()
    model = build(base.path, tp, ep).eval()
    if adapter_dir is not None:
        export.load_into(model, adapter_dir, base, backend)
        if base.family == "qwen3-next":
            model.requires_grad_(False)  # scoring only: no autograd graph over the adapter
    if backend == "cuda":
        model = model.cuda()  # the programs dispatch on the tensors' device: the cuda lane
    admit_invoked(trace, model, base, backend, control)
    share = (0, 1)
    if ep > 1:  # the expert-parallel ranks are data-parallel for the rest of the layer
        from megatron.core import parallel_state

        share = (parallel_state.get_expert_model_parallel_rank(), ep)
    lps = score(model, trace, micro_batch, control, share)
    return lps, time.perf_counter() - t0


def check_replay_backend(backend: str, world: int = 1) -> None:
    """cpu at any layout; cuda on one GPU (the cuda programs make Megatron's forward the
    sampler's bytes there; tensor and expert parallel ranks on cuda run in layout tests only)."""
    if backend not in ("cpu", "cuda"):
        raise NotImplementedError(f"the Megatron exact lane runs on cpu or cuda, not {backend!r}")
    if backend == "cuda":
        if world > 1:
            raise NotImplementedError(
                f"replay on cuda runs on one GPU here (tp x ep = 1), not {world} ranks"
            )
        if not torch.cuda.is_available():
            raise NotImplementedError("replay on cuda: no CUDA device here")
