"""What a capture checks before any engine starts, in either room: the model directory's
tokenizer files and the adapter (its hash, recorded in the trace).
"""

from __future__ import annotations

from lockstep_exact.adapters import load_adapter
from lockstep_exact.model import ModelDir

TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them


def adapter_hash(adapter_dir, model_dir, backend: str = "cpu") -> str:
    """Validate a PEFT adapter for this lane (AdapterError naming the problem); its hash.

    The hash covers the factors and the adapter config's numeric fields; a Lockstep export
    must be bound to this base model, a foreign (peft-made) adapter is recorded beside the
    model hash in the trace. An export names the lane contract it was made for: the
    ``backend``'s (cuda adapters for a cuda engine)."""
    base = model_dir if isinstance(model_dir, ModelDir) else ModelDir(model_dir, hybrid=True)
    return load_adapter(adapter_dir, base, contract=base.contract(backend).fingerprint).sha256
