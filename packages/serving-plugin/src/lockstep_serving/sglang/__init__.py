"""The SGLang room of the serving plugin: the exact lane inside SGLang (its general plugin,
lane models, sampler, LoRA, patch table, capture, worker process) and the lockstep hooks of the
SGLang half (``hooks``). Imports nothing from the vLLM room; inside it, ``import sglang`` is
the real SGLang (imports are absolute)."""
