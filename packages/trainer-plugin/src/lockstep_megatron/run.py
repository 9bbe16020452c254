"""The qualification ladder's training job (hook ``lockstep_train_step``), run through the one
trainer stack: a policy session (``session.PolicySession``, the one ``lockstep train`` uses)
admits the trace, takes the steps (a GRPO-style token loss, AdamW on the adapters), writes a
checkpoint of the session's state (``checkpoint.py``) and exports the adapter (PEFT).

``open_job`` builds the job (``Job``); ``train`` is the hook's whole job: open, resume from
the latest checkpoint under ``checkpoint_dir``, step, checkpoint, export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lockstep_exact.requests import TrainerSessionRequest, TrainRequest, TrainResult
from lockstep_exact.trace import Trace

from . import export
from .checkpoint import check_resume, load_checkpoint, save_checkpoint
from .scoring import sequences
from .session import PolicySession, check_backend


def toy_advantages(trace: Trace, vocab: int) -> torch.Tensor:
    """GRPO advantages from a toy reward (share of sampled ids in the lower half of the
    vocabulary), normalized over the trace: deterministic, so the ladder can check bytes."""
    r = torch.stack(
        [
            (trace.sampled(i) < vocab // 2).to(torch.float32).mean()
            for i in range(trace.num_sequences)
        ]
    )
    return (r - r.mean()) / (r.std(unbiased=False) + 1e-6)


def grpo_token_loss(logprobs: list[torch.Tensor], advantages: torch.Tensor) -> torch.Tensor:
    """-(sum over sampled tokens of A_seq * logprob) / number of tokens (on-policy: ratio 1)."""
    total = sum((-a * lp).sum() for lp, a in zip(logprobs, advantages, strict=True))
    return total / sum(len(lp) for lp in logprobs)


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(
        (p for p in root.glob("step-*") if (p / "manifest.json").is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    return found[-1] if found else None


@dataclass
class Job:
    """One trace to learn from, a policy session, and what a resume must match: ``settings``
    (the trace's sha256, rank, alpha, lr, micro-batch, seed, the advantages in use) and
    ``identity`` (contract, model hash, adapter-in hash, steps, backend)."""

    request: TrainRequest
    session: PolicySession
    trace: Trace
    advantages: torch.Tensor
    settings: dict
    identity: dict

    def run(self, steps: int) -> list[float]:
        """``steps`` AdamW steps, one micro-batch each (the session draws them)."""
        seqs = sequences(self.trace)
        return self.session.update(
            seqs, None, lambda lps, idx: grpo_token_loss(lps, self.advantages[idx]), steps
        )

    def save(self, path: str | Path) -> Path:
        job = {
            "position": self.session.position,
            "settings": self.settings,
            "identity": self.identity,
        }
        return save_checkpoint(path, self.session.state_files(), job)

    def resume(self, path: str | Path) -> None:
        """Continue from the checkpoint at ``path``; refuses (``CheckpointError``), naming the
        field, one made for another job or with other settings."""
        files, job = load_checkpoint(path)
        check_resume(job["identity"], self.identity, str(path), free=("steps",))
        check_resume(job["settings"], self.settings, str(path))
        self.session.load_state_files(files)

    def export(self, out_dir: str | Path) -> Path:
        path, _ = self.session.export(out_dir)
        return path


def open_job(request: TrainRequest) -> Job:
    check_backend(request.backend)  # before the trace or the model is read
    trace = Trace.load(request.trace_dir)
    adapter_in = Path(request.adapter_in) if request.adapter_in else None
    session = PolicySession(
        TrainerSessionRequest(
            model_dir=Path(request.model_dir),
            role="policy",
            backend=request.backend,
            adapter_in=adapter_in,
            rank=request.rank,
            alpha=request.alpha,
            lr=request.lr,
            seed=request.seed,
            micro_batch=request.micro_batch,
        )
    )
    session.admit(trace, adapter_in)  # before any backward pass
    if request.advantages is None:
        advantages = toy_advantages(trace, session.base.geometry.vocab)
    elif len(request.advantages) != trace.num_sequences:
        raise ValueError(
            f"{len(request.advantages)} advantages for {trace.num_sequences} trace sequences"
        )
    else:
        advantages = torch.tensor(request.advantages, dtype=torch.float32)
    settings = {
        "trace_sha256": trace.sha256(),
        "rank": request.rank,
        "alpha": request.alpha,
        "lr": request.lr,
        "micro_batch": request.micro_batch,
        "seed": request.seed,
        "advantages": [float(a) for a in advantages.tolist()],
    }
    identity = {
        "contract": trace.contract_fingerprint,
        "model_hash": trace.model_hash,
        "adapter_in": (
            export.adapter_hash(adapter_in, session.base, request.backend) if adapter_in else None
        ),
        "steps": request.steps,
        "backend": request.backend,
    }
    return Job(request, session, trace, advantages, settings, identity)


def train(request: TrainRequest) -> TrainResult:
    job = open_job(request)
    before = job.session.backbone_hash()
    ckpt_root = Path(request.checkpoint_dir) if request.checkpoint_dir else None
    if ckpt_root is not None and (last := latest_checkpoint(ckpt_root)) is not None:
        job.resume(last)
    losses = tuple(job.run(request.steps))
    if ckpt_root is not None:
        job.save(ckpt_root / f"step-{job.session.position}")
    after = job.session.backbone_hash()
    out = job.export(request.adapter_out)
    return TrainResult(
        losses=losses, backbone_hash_before=before, backbone_hash_after=after, adapter_dir=out
    )
