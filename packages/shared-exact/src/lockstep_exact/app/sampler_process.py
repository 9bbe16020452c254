"""A sampler that lives in another environment, driven as a subprocess (``qualify --sampler``).

SGLang cannot share an environment with vLLM, nor, here, with Megatron's (docs/sglang.md): the
ladder's trainer stages run in this python and its sampler stages in the SGLang environment's,
through ``SamplerProcess``. It starts the engine's worker module there
(``python -m lockstep_serving.<engine>.worker``: a module run by name, nothing imported here),
sends it one JSON request per line and reads one answer per line. A refusal on the far side
comes back as ``SamplerRefused`` with its text; a worker that died as ``SamplerRefused``
naming its exit status. The worker's own output (the engine's logs) goes to this process's
stderr, which the CLI sends to the engine log.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

from ..contract import contract_from_json
from ..requests import CaptureRequest
from ..trace import Trace

ENGINES = ("vllm", "sglang")
PYTHON_ENV = {"sglang": "LOCKSTEP_SGLANG_PYTHON"}
DEFAULT_VENV = {"sglang": ".venv-sglang"}


class SamplerRefused(RuntimeError):
    """The sampler process refused a request, or is gone; the text says which and why."""


def sampler_python(engine: str, given: str | None = None) -> Path:
    """The python of ``engine``'s environment: ``given`` (``--sampler-python``), else
    ``$LOCKSTEP_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` here; refused, naming all
    three, when none is a file."""
    env = PYTHON_ENV[engine]
    candidate = given or os.environ.get(env) or str(Path(DEFAULT_VENV[engine]) / "bin" / "python")
    path = Path(candidate)
    if not path.is_file():
        raise SamplerRefused(
            f"--sampler {engine}: no python of an {engine} environment at {path} (pass "
            f"--sampler-python, set {env}, or build {DEFAULT_VENV[engine]}: docs/{engine}.md)"
        )
    return path


def encode(request: CaptureRequest) -> dict:
    """A CaptureRequest as JSON fields (paths as strings)."""
    fields = asdict(request)
    for name in ("model_dir", "out_dir", "adapter_dir"):
        if fields[name] is not None:
            fields[name] = str(fields[name])
    fields["prompts"] = list(fields["prompts"])
    return fields


class SamplerProcess:
    """One worker process of ``engine`` in the environment of ``python``; ``capture`` has the
    signature of the ``lockstep_capture`` hook, so the ladder calls it in the hook's place."""

    def __init__(self, engine: str, python: Path, *, env: dict | None = None):
        if engine not in PYTHON_ENV:
            raise SamplerRefused(
                f"--sampler {engine}: no sampler process for it (in-process: vllm; as a "
                f"process: {', '.join(PYTHON_ENV)})"
            )
        self.engine = engine
        self.python = Path(python)
        self.proc = subprocess.Popen(
            [str(self.python), "-m", f"lockstep_serving.{engine}.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._info: dict | None = None

    def call(self, op: str, **fields) -> dict:
        if self.proc.poll() is not None:
            raise SamplerRefused(self._gone())
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise SamplerRefused(self._gone())
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise SamplerRefused(f"{self.engine} sampler: {answer['error']}")
        return answer

    def _gone(self) -> str:
        return (
            f"the {self.engine} sampler process ({self.python}) exited with status "
            f"{self.proc.returncode}; its output is in the engine log"
        )

    def info(self) -> dict:
        """The sampler's EngineInfo fields (engine, engine_version, plugin_version, ...)."""
        if self._info is None:
            self._info = self.call("info")["engine"]
        return self._info

    def contract(self, model_dir, backend: str = "cpu"):
        body = self.call("contract", model_dir=str(model_dir), backend=backend)["contract"]
        return contract_from_json(body)

    def capture(self, request: CaptureRequest) -> Trace:
        if request.out_dir is None:
            raise SamplerRefused("a capture through a sampler process needs an out_dir")
        out = self.call("capture", request=encode(request))["out"]
        return Trace.load(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
