"""LoRA training on the exact lane: a GRPO-style token loss, AdamW on the adapters only.

Read top to bottom: a ``Trainer`` holds the model (backbone frozen), the optimizer, the data
generator (which sequences each step sees) and the data position. ``step()`` draws a
micro-batch, runs forward + backward, and steps AdamW. ``state()``/``load_state()`` are what a
checkpoint holds; ``settings()`` is what a resume must match (the trace's sha256, every
``TrainConfig`` field and the advantages actually used), and ``load_state`` refuses a state
whose settings differ, naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lockstep_exact.trace import Trace

from . import adapters as AD
from .checkpoint import check_resume
from .scoring import sampled_logprobs, sequences
from .spec import LockstepGPT


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


@contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """On cuda, torch's deterministic algorithms for the step (the backward's accumulating
    index ops then add in a fixed order instead of by atomics; an op that has no such version
    raises, naming itself); the previous setting comes back after. On cpu nothing changes."""
    if torch.device(device).type != "cuda":
        yield
        return
    # cuBLAS needs a fixed workspace to repeat its results; torch refuses cuBLAS calls in this
    # mode without it. Set only when the caller has not chosen one.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@dataclass
class TrainConfig:
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    micro_batch: int = 4
    seed: int = 0
    advantages: tuple[float, ...] | None = None  # per sequence; None: toy_advantages


class Trainer:
    def __init__(self, model: LockstepGPT, trace: Trace, config: TrainConfig):
        self.model, self.trace, self.config = model, trace, config
        self.device = next(model.parameters()).device  # the backbone's: cpu or cuda
        if not AD.adapter_parameters(model):
            AD.attach(model, config.rank, config.alpha, seed=config.seed)
            model.to(self.device)  # fresh adapters are drawn on cpu; the optimizer follows
        self.params = AD.adapter_parameters(model)
        backbone = [
            p
            for p in model.parameters()
            if p.requires_grad and all(p is not q for q in self.params)
        ]
        if backbone:
            raise RuntimeError(
                f"{len(backbone)} backbone tensors would train; the backbone is frozen"
            )
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, foreach=False)
        self.data = torch.Generator().manual_seed(config.seed)
        self.position = 0  # micro-batches consumed
        self.seqs = sequences(trace)
        if config.advantages is None:
            self.advantages = toy_advantages(trace, model.geom.vocab)
        elif len(config.advantages) != trace.num_sequences:
            raise ValueError(
                f"{len(config.advantages)} advantages for {trace.num_sequences} trace sequences"
            )
        else:
            self.advantages = torch.tensor(config.advantages, dtype=torch.float32)

    def next_batch(self) -> torch.Tensor:
        n = len(self.seqs)
        idx = torch.randperm(n, generator=self.data)[: min(self.config.micro_batch, n)]
        self.position += 1
        return torch.sort(idx).values

    def step(self) -> float:
        self.model.train()
        idx = self.next_batch().tolist()
        with deterministic(self.device):
            lps = sampled_logprobs(self.model, [self.seqs[i] for i in idx])
            loss = grpo_token_loss(lps, self.advantages[idx])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return float(loss.detach())

    def settings(self) -> dict:
        """What a resume must continue: the trace (its sha256), every config field, and the
        advantages in use (float32 values, so their JSON floats are exact)."""
        config = {k: v for k, v in self.config.__dict__.items() if k != "advantages"}
        return {
            "trace_sha256": self.trace.sha256(),
            **config,
            "advantages": [float(a) for a in self.advantages.tolist()],
        }

    # --- what a checkpoint holds ---------------------------------------------------------------
    def named_adapter_tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if ".lora." in n}

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                out[f"{names[id(p)]}::{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        return out

    def state(self) -> dict:
        return {
            "adapters": self.named_adapter_tensors(),
            "optimizer": self.optimizer_tensors(),
            "rng": {"data": self.data.get_state(), "torch": torch.get_rng_state()},
            "position": self.position,
            "config": self.config.__dict__.copy(),
            "settings": self.settings(),
        }

    def load_state(self, state: dict, where: str = "the checkpoint") -> None:
        """Continue from ``state``; refuses (CheckpointError) one made with other settings."""
        check_resume(state.get("settings", {}), self.settings(), where)
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state["adapters"].items():
                own[n].copy_(t)
        for p in self.params:
            self.optimizer.state[p] = {}
        for key, t in state["optimizer"].items():
            n, k = key.split("::")
            # the moments live beside their parameter; AdamW keeps its step count on cpu
            where = own[n].device if t.dim() else t.device
            self.optimizer.state[own[n]][k] = t.clone().to(where)
        self.data.set_state(state["rng"]["data"])
        torch.set_rng_state(state["rng"]["torch"])
        self.position = int(state["position"])
