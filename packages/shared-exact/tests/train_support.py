"""Fake engine sessions for ``lockstep train``'s loop (no vLLM, no Megatron), shared by
test_train_report_plots.py and tests/test_train.py, and the loop's stop control (a moved
adapter factor in the trainer), shared by tests/test_train.py and tests/test_train_gpu.py."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact import hookimpl
from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace


class FakeSampler:
    """A sampler session: every prompt's two sampled tokens [3, 4] after prompt [1, 2], with
    log-probabilities -0.5 and -0.25."""

    adapter_id, starts = 1, 1

    def sample(self, prompts, decisions, seed, adapter, temperature):
        n = len(prompts)
        lps = [torch.tensor([-0.5, -0.25], dtype=torch.float32)] * n
        return Trace.from_sequences(
            [[1, 2]] * n,
            [[3, 4]] * n,
            lps,
            contract_fingerprint="c" * 64,
            model_hash="m" * 64,
            sampling=SamplingSettings(rule=TEACHER_FORCED),
        )

    def decode(self, ids):
        return "x"

    def close(self):
        pass


class FakePolicy:
    """A trainer session that recomputes the sampler's bytes exactly and trains nothing."""

    def logprobs(self, trace):
        return trace.logprobs

    def update(self, seqs, old, loss, inner, micro):
        return [0.5]

    def export(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        return path, "h"

    def state_files(self):
        return {"state.bin": b"x"}

    def load_state_files(self, files, adapter):
        pass

    def close(self):
        pass


class AdapterMoved:
    """A trainer wrapper that moves one element of the policy's last LoRA B factor by 2^-9 in
    place before the ``at``-th trace it scores: an input of the trainer's forward (the adapter
    the sampler was not given), not the log-probabilities the loop compares. The move is in
    the trainer's memory only: the exported adapter files, which bisect reads, are unchanged."""

    def __init__(self, at: int):
        self.at = at

    @hookimpl(wrapper=True)
    def lockstep_trainer_session(self, request):
        session = yield
        if request.role != "policy":
            return session
        at, real = self.at, session.logprobs
        calls = []

        def logprobs(trace):
            calls.append(1)
            if len(calls) == at:
                named = session.model.named_parameters()
                b = [p for n, p in named if ".lora." in n and n.endswith(".B")][-1]
                with torch.no_grad():
                    b.view(-1)[0] += 2.0**-9
            return real(trace)

        session.logprobs = logprobs
        return session
