"""vLLM's OpenAI-compatible server on the exact lane, with the flags the lane needs.

The command that starts it, for ``lockstep serve`` (the CLI's one parser; it reaches this
module through the ``lockstep_serve_command`` hook):

    lockstep serve --model DIR [--backend cuda|cpu] [--print] [-- vLLM's own flags]

The command line is vLLM's own ``vllm.entrypoints.openai.api_server``; this module only adds
what activates the lane (the same settings as ``offline.engine_args``): the lane's
architecture through ``--hf-overrides``, bf16, raw logprobs, and on cuda no compilation with
CUDA graphs for decode steps (``FULL_DECODE_ONLY``); on cpu eager, with a 1 GiB KV cache unless
``VLLM_CPU_KVCACHE_SPACE`` is set. Flags that would take the lane's place (another
architecture override, dtype, compilation or logprobs mode) are refused by name rather than
passed on: a server that silently left the lane would serve inexact log-probabilities.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .offline import engine_args

# vLLM flags the lane sets itself; a user's value for one is refused (argparse's last-wins
# would otherwise let it replace the lane's).
OWNED_FLAGS = {
    "--model": "give the model with --model before '--'",
    "--hf-overrides": "the lane sets the architecture override",
    "--dtype": "the lane serves bf16 only",
    "--logprobs-mode": "the lane reports raw_logprobs",
    "--compilation-config": "the lane sets its graph mode (no compilation)",
    "-cc": "the lane sets its graph mode (no compilation)",
    "-O": "the lane sets its graph mode (no compilation)",
    "--enable-prefix-caching": "prefix caching is the lane's choice per model",
}


class ServeArgumentError(ValueError):
    """A serve command line that cannot start the lane; the message says what to change."""


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def check_extra(extra: list[str]) -> None:
    """Refuse vLLM flags the lane owns, naming the flag and why."""
    for arg in extra:
        name = _flag_name(arg)
        if name in OWNED_FLAGS or (name.startswith("-O") and name[2:].isdigit()):
            why = OWNED_FLAGS.get(name, OWNED_FLAGS["-O"])
            raise ServeArgumentError(f"{name} is set by the lane ({why})")


def server_argv(
    model_dir: str | Path,
    *,
    backend: str,
    extra: list[str] = (),
    contract: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command that starts vLLM's OpenAI server on the lane for ``model_dir``."""
    if backend not in ("cpu", "cuda"):
        raise ServeArgumentError(f"unknown backend {backend!r} (cpu or cuda)")
    extra = list(extra)
    check_extra(extra)
    args = engine_args(model_dir, contract=contract, cuda_graphs=backend == "cuda")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", args["model"]]
    argv += ["--hf-overrides", json.dumps(args["hf_overrides"], sort_keys=True)]
    argv += ["--dtype", args["dtype"], "--logprobs-mode", args["logprobs_mode"]]
    argv += ["--seed", str(args["seed"])]
    if args.get("enforce_eager"):
        argv.append("--enforce-eager")
    if "compilation_config" in args:
        argv += ["--compilation-config", json.dumps(args["compilation_config"], sort_keys=True)]
    if args.get("enable_prefix_caching") is False:
        argv.append("--no-enable-prefix-caching")
    return argv + extra


def server_env(backend: str, base: dict | None = None) -> dict:
    """The server's environment: the V1 model runner the lane runs in, the lane's plugins; on
    cpu a 1 GiB KV cache unless one is set (vLLM's CPU default takes most of the machine's
    memory)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # vLLM loads the lane's endpoint (GET /lockstep/contract, the contract header) only when
    # VLLM_PLUGINS names it; a caller's own list is kept.
    env.setdefault("VLLM_PLUGINS", "lockstep")
    if backend == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env
