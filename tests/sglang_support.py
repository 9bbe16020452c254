"""The SGLang half of the cross-engine tests, run as a script in the SGLang environment.

``python tests/sglang_support.py MODEL OUT [DECISIONS] [SEED] [CHUNK]`` starts one SGLang CPU
engine on the exact lane and writes three traces of the same 8 requests under OUT, plus
``cached.json`` (SGLang's cached prompt tokens per sequence of each, and the lane model's
forward steps per engine):

- ``batched``: all requests in one generate call, every prompt new (radix-cache misses);
- ``alone-hit``: the same requests one at a time, their prompts now in the radix cache;
- ``alone-miss``: the same, after the radix cache is flushed;
- ``alone-hit-other-seed``: as ``alone-hit`` (a radix hit), each request's seed + 1000 (the
  negative control of the hit and of the alone side: an input changed, the bytes part);
- ``chunked`` (only with CHUNK > 0): as ``batched``, from a second engine whose prefill is
  chunked every CHUNK tokens (``chunked_prefill_size``); ``chunked-other-seed`` as ``chunked``
  with seed + 1000 (its control).

Between them, a request with ``top_k=5`` is sent: ``cached.json`` records the front end's
refusal and that the engine then still served a request.

The test (``test_sglang.py``, in the workspace environment where Megatron is) compares them
with each other, with vLLM's trace of the same requests, and with Megatron's replay.

``python tests/sglang_support.py lora MODEL OUT ADAPTERS [DECISIONS] [SEED]`` starts one SGLang
CPU engine with per-request LoRA (``sglang.capture.LORA_ARGS``), loads the adapters ``A`` and
``B`` from the directory ADAPTERS, and writes under OUT:

- ``base``, ``A``, ``B``: traces of the 8 requests, one at a time, on the base model, on A,
  on B;
- ``A-batched``: the 8 requests on A in one generate call; ``A-batched-other-seed`` the same
  with seed + 1000 (its control);
- ``mixed.json``: the 8 requests in one generate call, request i on (base, A, B)[i % 3]: each
  request's tokens and logprobs; ``runs-other-seed`` the same batch with seed + 1000 (its
  control);
- ``lora.json``: what SGLang answered when asked to load each other adapter directory under
  ADAPTERS (the lane's refusal, named), and to serve a request on a refused one.

``--backend cuda`` anywhere in the arguments starts the engines on the GPU instead (SGLang
0.5.17 there; ``tests/test_sglang_gpu.py``); the default is ``cpu`` (SGLang's CPU engine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.model import ModelDir
    from lockstep_serving.sglang.capture import SglangLane

    backend = BACKEND[0]
    model, out = ModelDir(argv[0]), Path(argv[1])
    decisions = int(argv[2]) if len(argv) > 2 else 8
    seed = int(argv[3]) if len(argv) > 3 else 3
    chunk = int(argv[4]) if len(argv) > 4 else 0
    prompts = tuple(default_prompts(8))
    out.mkdir(parents=True, exist_ok=True)
    cached, seconds, steps = {}, {}, {}
    t0 = time.monotonic()
    with SglangLane(model, backend=backend) as lane:
        seconds["start"] = time.monotonic() - t0
        for name, batch, flush in (
            ("batched", True, False),
            ("alone-hit", False, False),
            ("alone-miss", False, True),
        ):
            if flush:
                lane.flush_cache()
            t = time.monotonic()
            trace, cached[name] = lane.capture(prompts, decisions, seed=seed, batch=batch)
            seconds[name] = time.monotonic() - t
            trace.save(out / name)
            if name == "batched":  # the lane model's forward steps so far
                steps["batched"] = json.loads(lane.report.read_text())["steps"]
        # the control: the cached prompts again, one at a time, with other seeds
        trace, cached["alone-hit-other-seed"] = lane.capture(
            prompts, decisions, seed=seed + OTHER_SEED, batch=False
        )
        trace.save(out / "alone-hit-other-seed")
        # A request the lane's rule cannot draw is refused at the front end; the engine serves on.
        refused = None
        try:
            lane.engine.generate(
                input_ids=[1, 2, 3],
                sampling_params={"max_new_tokens": 2, "top_k": 5},
                return_logprob=True,
            )
        except ValueError as err:
            refused = str(err)
        after, _ = lane.capture(prompts[:1], 2, seed=seed)
        checks = {"refused": refused, "decisions_after": after.num_decisions}
    if chunk > 0:
        with SglangLane(model, backend=backend, chunked_prefill_size=chunk) as lane:
            trace, cached["chunked"] = lane.capture(prompts, decisions, seed=seed, batch=True)
            trace.save(out / "chunked")
            steps["chunked"] = json.loads(lane.report.read_text())["steps"]
            trace, _ = lane.capture(prompts, decisions, seed=seed + OTHER_SEED, batch=True)
            trace.save(out / "chunked-other-seed")
    info = {"cached": cached, "seconds": seconds, "steps": steps, **checks}
    (out / "cached.json").write_text(json.dumps(info))
    print(f"sglang traces in {out}: {json.dumps(seconds)}", flush=True)
    return 0


def lora_main(argv: list[str]) -> int:
    from lockstep_exact.app.tiny import default_prompts
    from lockstep_exact.model import ModelDir
    from lockstep_serving.sglang.capture import LORA_ARGS, SglangLane, sampled, tokenize
    from lockstep_serving.vllm.patches import LaneRefused

    backend = BACKEND[0]
    model, out, adapters = ModelDir(argv[0]), Path(argv[1]), Path(argv[2])
    decisions = int(argv[3]) if len(argv) > 3 else 8
    seed = int(argv[4]) if len(argv) > 4 else 3
    prompts = tuple(default_prompts(8))
    out.mkdir(parents=True, exist_ok=True)
    seconds, refused = {}, {}
    t0 = time.monotonic()
    with SglangLane(model, backend=backend, **LORA_ARGS) as lane:
        seconds["start"] = time.monotonic() - t0
        names = {a: lane.load_adapter(adapters / a, a) for a in ("A", "B")}
        for bad in sorted(p.name for p in adapters.iterdir() if p.name not in names):
            try:
                lane.load_adapter(adapters / bad, bad)
                refused[bad] = None
            except LaneRefused as err:
                refused[bad] = str(err)
        served = None
        try:  # a request naming a refused adapter is refused too, never run on the base model
            lane.engine.generate(
                input_ids=[1, 2, 3],
                sampling_params={"max_new_tokens": 2},
                return_logprob=True,
                lora_path=sorted(refused)[0],
            )
        except ValueError as err:
            served = str(err)
        for name, adapter in (("base", None), ("A", "A"), ("B", "B")):
            t = time.monotonic()
            trace, _ = lane.capture(prompts, decisions, seed=seed, batch=False, adapter=adapter)
            seconds[name] = time.monotonic() - t
            trace.save(out / name)
        trace, _ = lane.capture(prompts, decisions, seed=seed, batch=True, adapter="A")
        trace.save(out / "A-batched")
        trace, _ = lane.capture(prompts, decisions, seed=seed + OTHER_SEED, batch=True, adapter="A")
        trace.save(out / "A-batched-other-seed")
        lane.flush_cache()
        order = [(None, "A", "B")[i % 3] for i in range(len(prompts))]
        ids = tokenize(model, prompts)
        from lockstep_serving.sglang.capture import sampling_params

        params = sampling_params(len(prompts), decisions, seed, 1.0, 1.0)
        t = time.monotonic()
        outs = lane.generate(ids, params, batch=True, adapters=order)
        seconds["mixed"] = time.monotonic() - t
        mixed = [dict(zip(("tokens", "logprobs"), sampled(o), strict=True)) for o in outs]
        params = sampling_params(len(prompts), decisions, seed + OTHER_SEED, 1.0, 1.0)
        outs = lane.generate(ids, params, batch=True, adapters=order)
        other = [dict(zip(("tokens", "logprobs"), sampled(o), strict=True)) for o in outs]
        steps = json.loads(lane.report.read_text())["steps"]
    runs = {"adapters": order, "runs": mixed, "runs-other-seed": other}
    (out / "mixed.json").write_text(json.dumps(runs))
    info = {"refused": refused, "served_refused": served, "seconds": seconds, "steps": steps}
    (out / "lora.json").write_text(json.dumps(info))
    print(f"sglang lora traces in {out}: {json.dumps(seconds)}", flush=True)
    return 0


OTHER_SEED = 1000  # the controls' seed offset: the same requests, other draws
BACKEND = ["cpu"]  # the engines' backend: --backend cuda runs them on the GPU


def _backend(argv: list[str]) -> list[str]:
    """``argv`` without ``--backend X``; X recorded in BACKEND."""
    if "--backend" in argv:
        at = argv.index("--backend")
        BACKEND[0] = argv[at + 1]
        argv = argv[:at] + argv[at + 2 :]
    return argv


if __name__ == "__main__":
    args = _backend(sys.argv[1:])
    if args[:1] == ["lora"]:
        sys.exit(lora_main(args[1:]))
    sys.exit(main(args))
