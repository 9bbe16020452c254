"""The SGLang half of the cross-engine tests, run as a script in the SGLang environment.

``python tests/sglang_support.py MODEL OUT [DECISIONS] [SEED] [CHUNK]`` starts one SGLang CPU
engine on the exact lane and writes three traces of the same 8 requests under OUT, plus
``cached.json`` (SGLang's cached prompt tokens per sequence of each, and the lane model's
forward steps per engine):

- ``batched``: all requests in one generate call, every prompt new (radix-cache misses);
- ``alone-hit``: the same requests one at a time, their prompts now in the radix cache;
- ``alone-miss``: the same, after the radix cache is flushed;
- ``chunked`` (only with CHUNK > 0): as ``batched``, from a second engine whose prefill is
  chunked every CHUNK tokens (``chunked_prefill_size``).

Between them, a request with ``top_k=5`` is sent: ``cached.json`` records the front end's
refusal and that the engine then still served a request.

The test (``test_sglang.py``, in the workspace environment where Megatron is) compares them
with each other, with vLLM's trace of the same requests, and with Megatron's replay.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    from lockstep_exact.model import ModelDir
    from lockstep_exact.tiny import default_prompts
    from lockstep_serving.sglang_capture import SglangLane

    model, out = ModelDir(argv[0]), Path(argv[1])
    decisions = int(argv[2]) if len(argv) > 2 else 8
    seed = int(argv[3]) if len(argv) > 3 else 3
    chunk = int(argv[4]) if len(argv) > 4 else 0
    prompts = tuple(default_prompts(8))
    out.mkdir(parents=True, exist_ok=True)
    cached, seconds, steps = {}, {}, {}
    t0 = time.monotonic()
    with SglangLane(model) as lane:
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
        with SglangLane(model, chunked_prefill_size=chunk) as lane:
            trace, cached["chunked"] = lane.capture(prompts, decisions, seed=seed, batch=True)
            trace.save(out / "chunked")
            steps["chunked"] = json.loads(lane.report.read_text())["steps"]
    info = {"cached": cached, "seconds": seconds, "steps": steps, **checks}
    (out / "cached.json").write_text(json.dumps(info))
    print(f"sglang traces in {out}: {json.dumps(seconds)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
