"""Fake engine sessions for ``lockstep train``'s loop (no vLLM, no Megatron), shared by
test_train_report_plots.py and tests/test_train.py."""

from __future__ import annotations

from pathlib import Path

import torch

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
