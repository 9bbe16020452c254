"""Replay: recompute every decision of a trace in Megatron (teacher forcing).

Admission first (contract fingerprint, model hash, adapter hash; the first mismatch is named),
then each sequence (prompt + sampled tokens) is teacher-forced in micro-batches of the
trainer's choosing, right-padded, and the logprob of every sampled token is gathered in the
trace's decision order.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lockstep_exact.contract import ContractMismatch, admit, lane_contract
from lockstep_exact.hashing import dir_sha256
from lockstep_exact.trace import Trace

from . import export
from .convert import build
from .spec import LockstepGPT


class AdmissionError(ContractMismatch):
    """The trace was not sampled from this model, adapter and lane."""


def admit_trace(
    trace: Trace,
    model_dir: Path,
    adapter_dir: Path | None,
    backend: str = "cpu",
    control: bool = False,
) -> None:
    """Refuse, naming which, a trace of another contract, model or adapter. ``control``
    (negative controls only) skips the adapter check; contract and model are still admitted."""
    try:
        admit(lane_contract(model_dir, backend=backend), trace.contract_fingerprint)
    except ContractMismatch as err:
        raise AdmissionError(f"contract fingerprint: {err}") from err
    model_hash = dir_sha256(model_dir)
    if trace.model_hash != model_hash:
        raise AdmissionError(
            f"model hash: the trace was sampled from {trace.model_hash}, "
            f"{model_dir} hashes to {model_hash}"
        )
    adapter_hash = export.adapter_hash(adapter_dir, model_dir) if adapter_dir else None
    if not control and trace.adapter_hash != adapter_hash:
        raise AdmissionError(
            f"adapter hash: the trace was sampled with adapter {trace.adapter_hash}, "
            f"the trainer has {adapter_hash}"
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


def sampled_logprobs(model: LockstepGPT, batch: list[tuple[torch.Tensor, int]]) -> list:
    """Per sequence, the logprob of each sampled token (teacher forcing over the whole
    sequence; the last token is never an input)."""
    device = next(model.parameters()).device
    inputs = pad_batch([s[:-1] for s, _ in batch]).to(device)
    lp = model(inputs)
    out = []
    for i, (s, p) in enumerate(batch):
        rows = torch.arange(p - 1, len(s) - 1, device=device)
        out.append(lp[i, rows, s[p:].to(device)].cpu())
    return out


def score(model: LockstepGPT, trace: Trace, micro_batch: int = 3) -> torch.Tensor:
    seqs = sequences(trace)
    if any(p < 1 for _, p in seqs):
        raise ValueError("a sequence with an empty prompt has no logprob for its first token")
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for b in range(0, len(seqs), micro_batch):
            out.extend(sampled_logprobs(model, seqs[b : b + micro_batch]))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float32)


def replay(
    model_dir: Path,
    trace_dir: Path,
    adapter_dir: Path | None = None,
    backend: str = "cpu",
    micro_batch: int = 3,
    control: bool = False,
) -> tuple[torch.Tensor, float]:
    """(fp32 logprob per decision in trace order, seconds)."""
    if backend != "cpu":
        raise NotImplementedError(f"the Megatron exact lane runs on cpu here, not {backend!r}")
    trace = Trace.load(trace_dir)
    adapter = Path(adapter_dir) if adapter_dir else None
    admit_trace(trace, Path(model_dir), adapter, backend, control)
    t0 = time.perf_counter()
    model = build(model_dir).eval()
    if adapter_dir is not None:
        export.load_into(model, adapter_dir, model_dir)
    lps = score(model, trace, micro_batch)
    return lps, time.perf_counter() - t0
