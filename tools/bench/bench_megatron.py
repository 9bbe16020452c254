"""Exact-lane Megatron fwd+bwd against the stock local-spec Megatron GPTModel, same tiny shapes.

Both are real megatron-core ``GPTModel``s in ``Float16Module`` (bf16) on the same geometry:
the exact lane (``lockstep_megatron.spec``: byte programs at every op site, LoRA adapters
trained, backbone frozen) and the stock ``get_gpt_layer_local_spec`` model (torch ops,
RoPE, every parameter trained). One step = forward over a right-padded micro-batch, a
token-logprob loss, backward. Prints the median time of each, the tokens/s it means and their
ratio, measured in one run. Timing only: bytes are checked by the tests.

    OMP_NUM_THREADS=1 uv run python tools/bench/bench_megatron.py [--reps 7] [--arch qwen3]
    python3 tools/bench/bench_megatron.py --device cuda --model DIR --batch 4 --seq 256
        # on the GPU machine (docs/gpu.md): a model directory of ``lockstep tiny``, say a few
        # layers of Qwen3-8B shape; the exact step under torch's deterministic algorithms, as
        # the trainer runs it on cuda

Without ``--model`` each ``--arch`` is ``lockstep tiny``'s default shape (hidden 128, 2 layers).
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


def bench(arch: str, batch: int, seq: int, reps: int, model: str | None = None,
          device: str = "cpu", rank: int = 8) -> tuple[float, float]:  # fmt: skip
    """(exact, stock) median seconds of one fwd+bwd step on ``model`` (default: the tiny
    ``arch`` model) on ``device``."""
    from lockstep_exact.app.tiny import make_tiny
    from lockstep_megatron import adapters as AD
    from lockstep_megatron.convert import build
    from lockstep_megatron.session import deterministic

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model or make_tiny(Path(tmp) / arch, arch=arch)
        exact = AD.attach(build(model_dir), rank, 2.0 * rank).to(device)
        stock = _stock_model(exact.geom).to(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, exact.geom.vocab, (batch, seq), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:, None]
    s = inputs.shape[1]  # stock attention's default mask is built on "cuda": pass one
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    positions = torch.arange(s, device=device)[None].expand(batch, s)

    def synced(step):
        def run():
            step()
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    def exact_step():
        with deterministic(torch.device(device)):
            exact(inputs).gather(-1, targets).mean().backward()

    def stock_step():
        logits = stock(input_ids=inputs, position_ids=positions, attention_mask=causal)
        torch.log_softmax(logits.float(), -1).gather(-1, targets).mean().backward()

    return _time(synced(exact_step), reps), _time(synced(stock_step), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["qwen3", "qwen3-moe"], default=None)
    ap.add_argument("--model", default=None, help="a model directory (default: lockstep tiny's)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rank", type=int, default=8, help="the exact lane's LoRA rank")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {where}, threads {torch.get_num_threads()}, ", end="")
    print(f"batch {args.batch} x seq {args.seq}, median of {args.reps}")
    print(f"{'model':<12} {'exact fwd+bwd':>14} {'stock fwd+bwd':>14} {'exact tok/s':>12} "
          f"{'stock tok/s':>12} {'ratio':>7}")  # fmt: skip
    tokens = args.batch * (args.seq - 1)
    for arch in [args.arch] if args.arch or args.model else ["qwen3", "qwen3-moe"]:
        te, ts = bench(arch, args.batch, args.seq, args.reps, args.model, args.device, args.rank)
        name = Path(args.model).name if args.model else arch
        print(f"{name:<12} {te * 1e3:>11.1f} ms {ts * 1e3:>11.1f} ms {tokens / te:>12,.0f} "
              f"{tokens / ts:>12,.0f} {te / ts:>6.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
