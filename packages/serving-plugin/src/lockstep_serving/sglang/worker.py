"""The SGLang sampler as a process: ``lockstep qualify --sampler sglang``'s sampler half.

SGLang and Megatron live in different environments (docs/sglang.md), so the ladder's trainer
stages run in the workspace's python and its sampler stages here, in the SGLang environment's:
``python -m lockstep_serving.sglang.worker``, started and driven by
``lockstep_exact.app.sampler_process``. One request per line on stdin, one JSON answer per line
on the protocol stream (the process's original stdout; everything else it or SGLang prints goes
to stderr, the caller's engine log):

- ``{"op": "info"}``: the sampler's engine, its version, the plugin's, torch's;
- ``{"op": "contract", "model_dir", "backend"}``: the lane contract this side computes;
- ``{"op": "capture", "request": {CaptureRequest fields}}``: one capture, its trace written to
  ``out_dir``; answers ``{"out": ..., "decisions": ...}``.

Every answer carries ``"ok"``; a refusal or an error answers ``ok: false`` with its text, and
the process serves on. One engine serves every capture of a model and contract (adapters are
loaded into it as they are asked for, through the lane's checks), so a ladder pays SGLang's
start once instead of once per capture; the radix cache is kept between captures (a prompt
captured again is a cache hit, which gives the bytes of a miss).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from lockstep_exact.model import ModelDir
from lockstep_exact.requests import CaptureRequest

from .hooks import lockstep_engine_info


class Worker:
    def __init__(self):
        self.lane = None
        self.key = None
        self.names: dict[str, str] = {}  # adapter directory -> its name in the engine

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        self.lane, self.key, self.names = None, None, {}

    def info(self) -> dict:
        info = lockstep_engine_info()
        if info is None:
            raise RuntimeError(f"SGLang is not installed for {sys.executable}")
        return {"engine": {**vars(info), "torch_version": torch.__version__}}

    def contract(self, model_dir: str, backend: str) -> dict:
        return {"contract": ModelDir(model_dir).contract(backend).to_json()}

    def capture(self, fields: dict) -> dict:
        from .capture import LORA_ARGS, SglangLane, preflight

        request = CaptureRequest(**decode(fields))
        model = preflight(request)
        options = json.dumps(request.options, sort_keys=True)
        key = (str(model.path), request.contract, request.backend, options)
        if key != self.key:
            self.close()
            options = {**LORA_ARGS, **request.options}
            self.lane = SglangLane(
                model, contract=request.contract, backend=request.backend, **options
            )
            self.key = key
        adapter = None
        if request.adapter_dir is not None:
            path = str(Path(request.adapter_dir).resolve())
            if path not in self.names:
                self.names[path] = self.lane.load_adapter(path, f"adapter-{len(self.names)}")
            adapter = self.names[path]
        trace, _ = self.lane.capture(
            request.prompts,
            request.decisions,
            seed=request.seed,
            temperature=request.temperature,
            top_p=request.top_p,
            batch=request.batch,
            adapter=adapter,
        )
        trace.save(request.out_dir)
        return {"out": str(request.out_dir), "decisions": trace.num_decisions}

    def handle(self, message: dict) -> dict:
        op = message.get("op")
        if op == "info":
            return self.info()
        if op == "contract":
            return self.contract(message["model_dir"], message.get("backend", "cpu"))
        if op == "capture":
            return self.capture(message["request"])
        raise ValueError(f"unknown request {op!r} (info, contract, capture)")


def decode(fields: dict) -> dict:
    """CaptureRequest fields from JSON: paths and the prompt tuple restored."""
    out = dict(fields)
    for name in ("model_dir", "out_dir", "adapter_dir"):
        if out.get(name) is not None:
            out[name] = Path(out[name])
    out["prompts"] = tuple(out["prompts"])
    return out


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # SGLang's output and its processes' go to stderr, never into the protocol
    sys.stdout = sys.stderr
    worker = Worker()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                answer = {"ok": True, **worker.handle(json.loads(line))}
            except Exception as err:  # the ladder reports it as a failed gate, by name
                answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            protocol.write(json.dumps(answer) + "\n")
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
