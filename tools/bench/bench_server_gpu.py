"""A burst of requests against vLLM's OpenAI server: the lane (``lockstep serve``) against
stock ``vllm.entrypoints.openai.api_server`` started as a user starts it (default compilation
and graph settings), same model, same requests, one run.

    source tools/gpu/env.sh vllm     # on the GPU machine
    python3 tools/bench/bench_server_gpu.py --arch qwen3 --burst 64 [--tokens 128]
        [--servers lane,stock] [--json FILE] [--max-model-len 1024]

Per server: start it on 127.0.0.1 (its output to a log file), wait for ``/health``, send one
warm-up request, then ``--burst`` concurrent ``/v1/completions`` requests (token-id prompts of
``--prompt-len`` random ids, fresh per request; ``--tokens`` tokens each, temperature 1,
``ignore_eos``, request i seeded 1000 + i, ``logprobs=0``); tokens/s = completion tokens of the
burst / its wall seconds. The log's lines after start-up that mention JIT compilation are
counted: vLLM's JIT monitor warns when a kernel compiles while serving. Timing only; the
server's bytes are checked by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_gpu import SHAPES, model_for  # noqa: E402

SERVERS = ("lane", "stock")
SEED_BASE = 1000
READY_LINE = "Application startup complete"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_cmd(name: str, model: Path, port: int, max_model_len: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len)]
    if name == "lane":
        # `lockstep serve` (the CLI's module: tools/gpu/env.sh installs no console script);
        # --verbose sends vLLM's output to this process's log, --log /dev/null keeps the CLI
        # from writing its own lockstep-serve.log.
        return [sys.executable, "-m", "lockstep_exact.app.cli", "serve", "--model", str(model),
                "--backend", "cuda", "--verbose", "--log", os.devnull, "--", *common]  # fmt: skip
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "bfloat16", *common]  # fmt: skip


def _wait_ready(proc, base: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError("the server did not answer /health in time")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def run_server(name: str, args, model: Path, vocab: int, log: Path) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = server_cmd(name, model, port, args.max_model_len)
    out: dict = {"command": " ".join(cmd)}
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(proc, base, t0 + args.start_timeout)
        out["startup_s"] = round(time.monotonic() - t0, 1)
        ready_at = log.read_text(errors="replace").count("\n")
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            served = json.loads(r.read())["data"][0]["id"]

        def one(i: int, prompt: list[int], tokens: int) -> int:
            body = {
                "model": served,
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 1.0,
                "seed": SEED_BASE + i,
                "ignore_eos": True,
                "logprobs": 0,
            }
            return _post(base + "/v1/completions", body, 600)["usage"]["completion_tokens"]

        one(0, _prompts(1, args.prompt_len, vocab, 1)[0], 8)  # warm-up
        prompts = _prompts(args.burst, args.prompt_len, vocab, 2)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.burst) as pool:
            done = list(pool.map(lambda ip: one(ip[0], ip[1], args.tokens), enumerate(prompts)))
        wall = time.perf_counter() - t1
        out["tokens"] = sum(done)
        out["wall_s"] = round(wall, 3)
        out["tok_s"] = round(sum(done) / wall, 1)
        after = log.read_text(errors="replace").splitlines()[ready_at:]
        out["jit_lines_after_start"] = [ln for ln in after if "JIT" in ln][:20]
    except Exception as err:  # noqa: BLE001 - reported in the table, the next server runs
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(SHAPES["cuda"]), default="qwen3")
    ap.add_argument("--servers", default="lane,stock")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--model-dir", default="/tmp/lockstep-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, help="folder for the servers' logs")
    args = ap.parse_args(argv)
    args.device = "cuda"
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        ap.error(f"--servers: unknown {unknown}; known: {list(SERVERS)}")
    model, kwargs = model_for(args)
    logs = Path(args.logs or model.parent / "server-logs")
    logs.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in servers:
        r = run_server(name, args, model, kwargs["vocab"], logs / f"{name}.log")
        results[name] = r
        shown = r.get("error") or (
            f"start-up {r['startup_s']} s, {r['tok_s']:,} tok/s "
            f"({r['tokens']} tokens in {r['wall_s']} s), "
            f"{len(r['jit_lines_after_start'])} JIT line(s) after start-up"
        )
        print(f"{name}: {shown}", flush=True)
    if all("tok_s" in results.get(s, {}) for s in SERVERS):
        ratio = results["lane"]["tok_s"] / results["stock"]["tok_s"]
        results["lane_over_stock"] = round(ratio, 3)
        print(f"lane / stock, burst of {args.burst}: {ratio:.3f}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, **results}, indent=1))


if __name__ == "__main__":
    main()
