"""Lockstep serving plugins: the vLLM room (``vllm``), the SGLang room (``sglang``) and what
both use (``common``)."""

__version__ = "0.1.0"
