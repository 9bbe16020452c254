"""Helpers for the trainer tests: tiny models and reference traces."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact.app.tiny import make_tiny

HIDDEN, LAYERS, VOCAB = 64, 2, 512


def make_model(out: Path, arch: str, seed: int = 0) -> Path:
    return make_tiny(out, arch=arch, seed=seed, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB)


def reference_trace(model_dir: Path, out: Path, adapter_dir: Path | None = None, seed: int = 0):
    """A trace whose logprobs come from the reference composition (the sampler's programs):
    random prompts and continuations, each sequence's decisions from one reference forward."""
    from lockstep_exact.lanes import qwen3
    from lockstep_exact.model import model_hash as dir_hash
    from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace
    from lockstep_megatron.convert import load_hf_weights

    geom = qwen3.Geometry.from_model_dir(model_dir)
    weights = load_hf_weights(model_dir)
    adapters, adapter_hash = None, None
    if adapter_dir is not None:
        from lockstep_exact.adapters import load_adapter

        adapter = load_adapter(adapter_dir, geom)
        adapters, adapter_hash = adapter.modules, adapter.sha256
    g = torch.Generator().manual_seed(seed)
    ops = qwen3.default_ops(geom)  # its invoked log is the "sampler's" contract
    prompts, sampled, lps = [], [], []
    for plen, n in ((5, 8), (11, 6), (3, 9), (17, 8), (8, 4), (2, 8), (6, 7)):
        seq = torch.randint(0, geom.vocab, (plen + n,), generator=g)
        lp = qwen3.forward_logprobs(weights, geom, seq[:-1], adapters, ops=ops)
        rows = torch.arange(plen - 1, plen + n - 1)
        prompts.append(seq[:plen])
        sampled.append(seq[plen:])
        lps.append(lp[rows, seq[plen:]].contiguous())
    trace = Trace.from_sequences(
        prompts,
        sampled,
        lps,
        contract_fingerprint=ops.invoked_contract().fingerprint,
        contract=ops.invoked_contract().to_json(),
        model_hash=dir_hash(model_dir),
        adapter_hash=adapter_hash,
        engine={"name": "reference"},
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    )
    return trace.save(out, overwrite=True)


def next_composition_trace(model_dir: Path, out: Path, plan, adapter_dir: Path | None = None):
    """A qwen3-next trace whose logprobs are the composition's (the sampler's programs, no
    engine): for each (prompt, sampled) length of ``plan``, random tokens and the decisions of
    one ``lanes.qwen3_next`` forward over prompt + sampled tokens, with the adapter if given."""
    from lockstep_exact.adapters import load_adapter
    from lockstep_exact.lanes import qwen3_next as N
    from lockstep_exact.model import ModelDir
    from lockstep_exact.model import model_hash as dir_hash
    from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace
    from lockstep_megatron.convert import load_hf_weights

    geom = N.Geometry.from_model_dir(model_dir)
    weights = load_hf_weights(model_dir)
    adapter = load_adapter(adapter_dir, ModelDir(model_dir, hybrid=True)) if adapter_dir else None
    ops = N.default_ops(geom)  # its invoked log is the "sampler's" contract
    g = torch.Generator().manual_seed(5)
    prompts, sampled, lps = [], [], []
    for plen, n in plan:
        seq = torch.randint(0, geom.vocab, (plen + n,), generator=g)
        lp = N.forward_logprobs(
            weights, geom, seq[:-1], ops=ops, adapters=adapter.modules if adapter else None
        )
        prompts.append(seq[:plen])
        sampled.append(seq[plen:])
        lps.append(lp[torch.arange(plen - 1, plen + n - 1), seq[plen:]].contiguous())
    invoked = ops.invoked_contract()
    trace = Trace.from_sequences(
        prompts,
        sampled,
        lps,
        contract_fingerprint=invoked.fingerprint,
        contract=invoked.to_json(),
        model_hash=dir_hash(model_dir),
        adapter_hash=adapter.sha256 if adapter else None,
        engine={"name": "composition"},
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    )
    return trace.save(out, overwrite=True)


def nudge_one_ulp(model_dir: Path, out: Path, name: str = "lm_head.weight") -> Path:
    """A copy of ``model_dir`` with one element of ``name`` changed by one bf16 ulp."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    w = load_file(str(out / "model.safetensors"))
    w[name].view(torch.int16).view(-1)[0] += 1
    save_file(w, str(out / "model.safetensors"))
    return out
