"""The vLLM room of the serving plugin: the exact lane inside vLLM (its general plugin, lane
models, attention backend, sampler, LoRA, patch table, capture, session, endpoint) and the
lockstep hooks of the vLLM half (``hooks``). Imports nothing from the SGLang room; inside it,
``import vllm`` is the real vLLM (imports are absolute)."""
