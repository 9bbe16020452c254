"""Lockstep serving plugins (vLLM)."""

__version__ = "0.1.0"
