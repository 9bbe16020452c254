"""A burst of requests against vLLM's OpenAI server: the lane (``lockstep serve``) against
stock ``vllm.entrypoints.openai.api_server`` started as a user starts it (default compilation
and graph settings), same model, same requests, one run.

    source tools/gpu/env.sh vllm     # on the GPU machine
    python3 tools/bench/bench_server_gpu.py --arch qwen3 --burst 64 [--tokens 128]
        [--servers lane,stock] [--json FILE] [--max-model-len 1024]

Both servers are started (one after the other, each on 127.0.0.1 with its output in a log
file, ``--gpu-memory-utilization`` of the GPU each, default 0.4) and stay up; each gets one
warm-up request; then ``--rounds`` rounds (default 3), each a burst of ``--burst`` concurrent
``/v1/completions`` requests to every server in turn, the order rotated by round (token-id
prompts of ``--prompt-len`` random ids, fresh per request and round; ``--tokens`` tokens each,
temperature 1, ``ignore_eos``, request i seeded 1000 + i, ``logprobs=0``). tokens/s of a burst
= its completion tokens / its wall seconds; each server's figure is its median burst, and lane
/ stock is the median over rounds of the two bursts of a round (run back to back, so a change
in the host's speed falls on both). The log's lines after start-up that mention JIT
compilation are counted: vLLM's JIT monitor warns when a kernel compiles while serving.
Timing only; the server's bytes are checked by the tests.
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
from bench_vllm_gpu import (  # noqa: E402
    SHAPES,
    median_run,
    model_for,
    round_ratio,
    stock_extra_args,
)

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


def server_cmd(
    name: str, model: Path, port: int, max_model_len: int, memory: float, arch: str = "qwen3"
) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
              "--gpu-memory-utilization", str(memory)]  # fmt: skip
    if name == "lane":
        # `lockstep serve` (the CLI's module: tools/gpu/env.sh installs no console script);
        # --verbose sends vLLM's output to this process's log, --log /dev/null keeps the CLI
        # from writing its own lockstep-serve.log.
        return [sys.executable, "-m", "lockstep_exact.app.cli", "serve", "--model", str(model),
                "--backend", "cuda", "--verbose", "--log", os.devnull, "--", *common]  # fmt: skip
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in stock_extra_args(arch, "cuda").items()]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "bfloat16", *common, *extra]  # fmt: skip


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


class Server:
    """One server process: started, warmed up, then bursts on demand."""

    def __init__(self, name: str, args, model: Path, log: Path):
        self.name, self.args, self.log = name, args, log
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = server_cmd(
            name, model, self.port, args.max_model_len, args.gpu_memory_utilization, args.arch
        )
        self.out: dict = {"command": " ".join(cmd), "bursts": []}
        self.t0 = time.monotonic()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.served = None
        self.ready_at = 0

    def start(self, vocab: int) -> bool:
        try:
            _wait_ready(self.proc, self.base, self.t0 + self.args.start_timeout)
            self.out["startup_s"] = round(time.monotonic() - self.t0, 1)
            self.ready_at = self.log.read_text(errors="replace").count("\n")
            with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
                self.served = json.loads(r.read())["data"][0]["id"]
            self._one(0, _prompts(1, self.args.prompt_len, vocab, 1)[0], 8)  # warm-up
            return True
        except Exception as err:  # noqa: BLE001 - reported in the table, the other server runs
            self.out["error"] = f"{type(err).__name__}: {err}"
            return False

    def _one(self, i: int, prompt: list[int], tokens: int) -> int:
        body = {
            "model": self.served,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": SEED_BASE + i,
            "ignore_eos": True,
            "logprobs": 0,
        }
        return _post(self.base + "/v1/completions", body, 600)["usage"]["completion_tokens"]

    def burst(self, prompts: list[list[int]]) -> dict | None:
        if "error" in self.out:
            return None
        try:
            t1 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                done = list(
                    pool.map(
                        lambda ip: self._one(ip[0], ip[1], self.args.tokens), enumerate(prompts)
                    )
                )
            wall = time.perf_counter() - t1
        except Exception as err:  # noqa: BLE001
            self.out["error"] = f"{type(err).__name__}: {err}"
            return None
        b = {"tokens": sum(done), "wall_s": round(wall, 3), "tok_s": round(sum(done) / wall, 1)}
        self.out["bursts"].append(b)
        return b

    def finish(self) -> dict:
        out = self.out
        if out["bursts"]:
            out.update(median_run(out["bursts"]))
        after = self.log.read_text(errors="replace").splitlines()[self.ready_at :]
        out["jit_lines_after_start"] = [ln for ln in after if "JIT" in ln][:20]
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return out


def paired(lane: list[dict], stock: list[dict]) -> float | None:
    """lane / stock: the median over rounds of each round's two bursts (``round_ratio``)."""
    return round_ratio([b["tok_s"] for b in lane], [b["tok_s"] for b in stock])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(SHAPES["cuda"]), default="qwen3")
    ap.add_argument("--servers", default="lane,stock")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="bursts per server, taking turns")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.4, help="each server's share of the GPU"
    )
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument(
        "--start-together",
        action="store_true",
        help="launch both servers at once (a shorter run; each profiles its memory beside the "
        "other's start-up, so leave it off where the KV cache's size matters)",
    )
    ap.add_argument("--model-dir", default="/tmp/lockstep-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, help="folder for the servers' logs")
    args = ap.parse_args(argv)
    args.device = "cuda"
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.rounds < 1:
        ap.error(f"--rounds: {args.rounds}; give 1 or more")
    if not 0 < args.gpu_memory_utilization * len(servers) <= 0.95:
        ap.error(
            f"--gpu-memory-utilization: {len(servers)} servers at {args.gpu_memory_utilization} "
            "each is more than 0.95 of the GPU"
        )
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        ap.error(f"--servers: unknown {unknown}; known: {list(SERVERS)}")
    model, kwargs = model_for(args)
    logs = Path(args.logs or model.parent / "server-logs")
    logs.mkdir(parents=True, exist_ok=True)
    servers_up = []
    if args.start_together:  # every process launched before the first is waited for
        servers_up = [Server(name, args, model, logs / f"{name}.log") for name in servers]
    for i, name in enumerate(servers):
        if not args.start_together:
            servers_up.append(Server(name, args, model, logs / f"{name}.log"))
        srv = servers_up[i]
        ok = srv.start(kwargs["vocab"])
        shown = f"start-up {srv.out['startup_s']} s" if ok else srv.out["error"]
        print(f"{name}: {shown}", flush=True)
    for r in range(args.rounds):
        prompts = _prompts(args.burst, args.prompt_len, kwargs["vocab"], 2 + r)
        k = r % len(servers_up)
        cells = []
        for srv in servers_up[k:] + servers_up[:k]:
            b = srv.burst(prompts)
            cells.append(f"{srv.name} {b['tok_s']:,} tok/s" if b else f"{srv.name} -")
        print(
            f"round {r + 1}/{args.rounds}, burst of {args.burst}: " + ", ".join(cells), flush=True
        )
    results = {srv.name: srv.finish() for srv in servers_up}
    for name, r in results.items():
        shown = r.get("error") or (
            f"start-up {r['startup_s']} s, median burst {r['tok_s']:,} tok/s "
            f"({r['tokens']} tokens in {r['wall_s']} s), "
            f"{len(r['jit_lines_after_start'])} JIT line(s) after start-up"
        )
        print(f"{name}: {shown}", flush=True)
    if all(results.get(s, {}).get("bursts") for s in SERVERS):
        ratio = paired(results["lane"]["bursts"], results["stock"]["bursts"])
        if ratio is not None:
            results["lane_over_stock"] = round(ratio, 3)
            print(
                f"lane / stock, burst of {args.burst} (median of {args.rounds} rounds): {ratio:.3f}"
            )
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, **results}, indent=1))


if __name__ == "__main__":
    main()
