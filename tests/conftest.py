"""Cross-package tests: real vLLM (in-process, CPU) against real megatron-core.

vLLM reads its environment at import: everything is pointed into one temporary directory,
offline, with a 1 GiB KV cache, before any test imports it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ROOT = Path(tempfile.mkdtemp(prefix="lockstep-cross-"))
for key, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CACHE_ROOT": str(ROOT / "vllm-cache"),
    "TORCHINDUCTOR_CACHE_DIR": str(ROOT / "inductor"),
    "HF_HOME": str(ROOT / "hf"),
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(key, value)
