"""Exact-lane Megatron fwd+bwd against the stock local-spec Megatron GPTModel, same tiny shapes.

Both are real megatron-core ``GPTModel``s in ``Float16Module`` (bf16) on the same geometry:
the exact lane (``lockstep_megatron.spec``: byte programs at every op site, LoRA adapters
trained, backbone frozen) and the stock ``get_gpt_layer_local_spec`` model (torch ops,
RoPE, every parameter trained). One step = forward over a right-padded micro-batch, a
token-logprob loss, backward. Prints the median time of each and their ratio, measured in one
run. Timing only: bytes are checked by the tests.

    OMP_NUM_THREADS=1 uv run python tools/bench/bench_megatron.py [--reps 7] [--arch qwen3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def _stock_model(geom):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from lockstep_megatron.spec import transformer_config

    config = transformer_config(geom)
    if geom.is_moe:
        config.num_moe_experts = geom.experts
        config.moe_router_topk = geom.topk
        config.moe_token_dispatcher_type = "allgather"
        config.moe_ffn_hidden_size = geom.moe_intermediate
    spec = get_gpt_layer_local_spec(
        num_experts=geom.experts or None, moe_grouped_gemm=False, qk_layernorm=True
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=geom.vocab,
        max_sequence_length=4096,
        position_embedding_type="rope",
        rotary_base=int(geom.rope_theta),
    )
    return Float16Module(config, gpt)


def _time(step, reps: int) -> float:
    step()  # warmup
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(arch: str, batch: int, seq: int, reps: int) -> tuple[float, float]:
    """(exact, stock) median seconds of one fwd+bwd step on the tiny ``arch`` model."""
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_megatron import adapters as AD
    from lockstep_megatron.convert import build

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(Path(tmp) / arch, arch=arch)  # hidden 128, 2 layers, V 1024
        exact = AD.attach(build(model_dir), 8, 16.0)
        stock = _stock_model(exact.geom)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, exact.geom.vocab, (batch, seq), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:, None]
    s = inputs.shape[1]  # stock attention's default mask is built on "cuda": pass one
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(s)[None].expand(batch, s)

    def exact_step():
        exact(inputs).gather(-1, targets).mean().backward()

    def stock_step():
        logits = stock(input_ids=inputs, position_ids=positions, attention_mask=causal)
        torch.log_softmax(logits.float(), -1).gather(-1, targets).mean().backward()

    return _time(exact_step, reps), _time(stock_step, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["qwen3", "qwen3-moe"], default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, ", end="")
    print(f"batch {args.batch} x seq {args.seq}, median of {args.reps}")
    print(f"{'lane':<10} {'exact fwd+bwd':>14} {'stock fwd+bwd':>14} {'ratio':>8}")
    for arch in [args.arch] if args.arch else ["qwen3", "qwen3-moe"]:
        te, ts = bench(arch, args.batch, args.seq, args.reps)
        print(f"{arch:<10} {te * 1e3:>11.1f} ms {ts * 1e3:>11.1f} ms {te / ts:>7.1f}x")


if __name__ == "__main__":
    main()
