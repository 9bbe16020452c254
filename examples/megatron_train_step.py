"""Train the lane's Megatron model from your own script: provider, forward_step, optimizer.

    python examples/megatron_train_step.py --model DIR --steps 3 [--backend cpu]
        [--dump-rollouts FILE] [--adapter-out DIR]

DIR is an HF Qwen3 / Qwen3-MoE directory (``lockstep tiny --out DIR`` makes a small one). The
script has the usual Megatron shape: a ``model_provider(pre_process, post_process)`` (here
``lane_model_provider``: megatron-core's ``GPTModel`` built from the lane's spec, HF weights
loaded, backbone frozen, fresh LoRA attached), a ``forward_step`` that returns the output and
its loss function, and a loop of forward, backward and optimizer step. The optimizer is plain
torch AdamW over the LoRA masters, as ``lockstep train`` does. The loss is the mean negative
log-likelihood of each sequence's completion tokens, computed from the lane's log-probabilities:
the same bytes a lane sampler reports for those tokens.

Megatron's own schedule (``get_forward_backward_func``) is not used: on a machine without a GPU
it allocates on "cuda", and it looks for a ``config`` on the model, which the lane's wrapper
does not expose. ``train_step`` below runs what it runs for one micro-batch.

``--dump-rollouts FILE`` writes, after the last step, the trained model's log-probabilities of
the batch as a rollout JSONL (what a sampler serving the exported adapter would report);
``--adapter-out DIR`` exports the adapter (PEFT). ``examples/check_rollout.py`` checks the two
against each other.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch

from lockstep_megatron.integration import (
    Rollout,
    export_lane_adapter,
    init_single_process,
    lane_logprobs,
    lane_model_provider,
    lane_trainable_parameters,
    write_rollouts,
)


def get_batch(vocab: int, size: int, seq_len: int, prompt_len: int, seed: int):
    """``size`` random token sequences of different lengths (the lane right-pads them; padding
    changes no byte of a real row), each with a prompt of ``prompt_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (seq_len - i,), generator=g) for i in range(size)]
    return seqs, [prompt_len] * size


def loss_func(logprobs: list[torch.Tensor]):
    """Mean negative log-likelihood of the completion tokens (Megatron's (loss, logs) pair)."""
    loss = -torch.cat(logprobs).mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(batch, model):
    """Megatron's forward_step shape: the output and the function that makes it a loss."""
    seqs, prompt_lens = batch
    logprobs = lane_logprobs(model, seqs, prompt_lens)  # per sequence, fp32, differentiable
    return logprobs, partial(loss_func)


def train_step(batch, model, optimizer) -> float:
    """One micro-batch: forward, loss, backward, optimizer step."""
    model.train()
    output, loss_fn = forward_step(batch, model)
    loss, _ = loss_fn(output)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF Qwen3 / Qwen3-MoE model directory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump-rollouts", help="write the trained model's logprobs (JSONL) here")
    ap.add_argument("--adapter-out", help="export the trained adapter (PEFT) here")
    args = ap.parse_args(argv)

    # torch.distributed + Megatron's parallel state (+ the CPU patches without a GPU), seeded.
    init_single_process(args.backend, seed=args.seed)
    model_provider = lane_model_provider(
        args.model,
        backend=args.backend,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        seed=args.seed,
    )
    model = model_provider(pre_process=True, post_process=True)
    optimizer = torch.optim.AdamW(lane_trainable_parameters(model), lr=args.lr, foreach=False)

    batch = get_batch(model.geom.vocab, args.batch, args.seq_len, args.prompt_len, args.seed)
    for step in range(1, args.steps + 1):
        loss = train_step(batch, model, optimizer)
        print(f"step {step} loss {loss:.6f}", flush=True)
        if not math.isfinite(loss):
            print(f"step {step}: the loss is not finite", file=sys.stderr)
            return 1

    if args.dump_rollouts:
        model.eval()
        seqs, prompt_lens = batch
        with torch.no_grad():
            logprobs = lane_logprobs(model, seqs, prompt_lens)
        rollouts = [
            Rollout(tuple(s.tolist()), p, lp)
            for s, p, lp in zip(seqs, prompt_lens, logprobs, strict=True)
        ]
        print(f"rollouts: {write_rollouts(args.dump_rollouts, rollouts)}")
    if args.adapter_out:
        print(f"adapter: {export_lane_adapter(model, args.adapter_out, args.model, args.backend)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
