"""Cross-package tests: real vLLM (in-process, CPU) against real megatron-core.

vLLM reads its environment at import: everything is pointed into one temporary directory,
offline, with a 1 GiB KV cache, before any test imports it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(tempfile.mkdtemp(prefix="lockstep-cross-"))
try:
    from lockstep_serving.vllm.offline import isolate
except ImportError:  # a machine without the serving plugin (the GPU box) runs only -m gpu
    pass
else:
    isolate(ROOT)
