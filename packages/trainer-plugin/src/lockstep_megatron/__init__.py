"""Lockstep trainer plugin for megatron-core."""

__version__ = "0.1.0"
