"""Check a sampler's log-probabilities against the trainer, byte for byte.

    python examples/check_rollout.py --model DIR --rollouts FILE [--adapter DIR] [--backend cpu]

FILE is a JSONL, one sampled sequence per line:
``{"tokens": [prompt + completion ids], "prompt_len": int, "logprobs": [one per completion
token]}``, the logprobs as the sampler reported them (float32 values written as JSON numbers).
The trainer (the lane's Megatron model of DIR, with the adapter the sampler served) recomputes
every completion token's log-probability and compares the float32 bytes.

Exit status: 0 every decision byte-equal, 1 a difference (the first one is printed: sequence,
token position, both values), 2 a file that is not such a JSONL (the line and the problem).
"""

from __future__ import annotations

import argparse
import sys

from lockstep_megatron.integration import (
    RolloutFormatError,
    check_rollout,
    init_single_process,
    lane_model_provider,
    read_rollouts,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the HF model directory the sampler served")
    ap.add_argument("--rollouts", required=True, help="JSONL of tokens, prompt_len, logprobs")
    ap.add_argument("--adapter", help="the PEFT adapter the sampler served, if any")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args(argv)

    try:  # read (and refuse) the file before a model is built
        rollouts = read_rollouts(args.rollouts)
    except RolloutFormatError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    init_single_process(args.backend)
    model = lane_model_provider(args.model, backend=args.backend, adapter=args.adapter)()
    try:
        report = check_rollout(model.eval(), rollouts, micro_batch=args.micro_batch)
    except RolloutFormatError as err:  # token ids outside this model's vocabulary
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.equal else 1


if __name__ == "__main__":
    sys.exit(main())
