"""The offline API: engine arguments that activate the exact lane, its fingerprint, capture.

from vllm import LLM
from lockstep_serving.vllm.offline import engine_args, lane_fingerprint
llm = LLM(**engine_args("path/to/model"))
lane_fingerprint(llm)  # "sha256:..." of the contract the running lane executes
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from lockstep_exact.contract import contract_from_json
from lockstep_exact.lanes.ops import check_invoked, check_kernels

from ..common.errors import LaneRefused
from ..common.lane import CONTRACT_OVERRIDE
from .architectures import LANE_OF_HF


def isolate(root: Path, *, override: bool = False, tmp: bool = False) -> None:
    """Environment for an in-process vLLM engine whose caches all live under ``root``.

    Set before vLLM is imported (it reads these at import): in-process engine core, 1 GiB KV
    cache, offline hub, WARNING logs. ``override`` replaces values already set; ``tmp`` also
    points TMPDIR (and Python's tempfile) into ``root``.
    """
    values = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "HF_HOME": str(root / "hf"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if tmp:
        values["TMPDIR"] = str(root / "tmp")
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        tempfile.tempdir = values["TMPDIR"]
    for key, value in values.items():
        if override:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)


def engine_args(
    model_dir, *, contract: str | None = None, cuda_graphs: bool = False, **overrides
) -> dict:
    """Keyword arguments for ``vllm.LLM`` that serve ``model_dir`` on the exact lane.

    ``contract``: a fingerprint the lane must match, or the engine refuses to start.
    ``cuda_graphs``: capture the lane's one-token decode steps in CUDA graphs (a GPU engine;
    no compilation, full graphs for decode batches, every other step eager). Default: eager.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in LANE_OF_HF:
        raise LaneRefused(
            f"Lockstep exact lane refused to start: architecture {arch!r} has no exact lane; "
            f"supported: {sorted(LANE_OF_HF)}"
        )
    hf_overrides = {"architectures": [LANE_OF_HF[arch]]}
    if contract is not None:
        hf_overrides[CONTRACT_OVERRIDE] = contract
    args = {
        "model": str(model_dir),
        "hf_overrides": hf_overrides,
        "dtype": "bfloat16",
        "logprobs_mode": "raw_logprobs",
        "enforce_eager": True,
        "seed": 0,
    }
    if arch == "Qwen3NextForCausalLM":
        # The hybrid lane refuses vLLM's prefix caching (next.py), which vLLM turns on
        # for it by default.
        args["enable_prefix_caching"] = False
    if cuda_graphs:
        args["enforce_eager"] = False
        args["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    args.update(overrides)
    return args


# Functions the engine's workers run (``LLM.apply_model``): module-level, so they pickle to
# worker processes (tensor parallelism) as well as run in process.
def _fingerprint(model) -> str:
    return model.contract.fingerprint


def _invoked_json(model) -> str:
    return json.dumps(model.ops.invoked_contract().to_json(), sort_keys=True)


def python_decode_steps(model) -> int:
    """One-token decode steps the lane's Python forward has run (a step replayed from a CUDA
    graph runs none): how a test sees that graphs were used."""
    return int(getattr(model, "decode_steps", 0))


def _declared_json(model) -> str:
    return json.dumps(model.contract.to_json(), sort_keys=True)


def lane_fingerprint(llm) -> str:
    """The contract fingerprint of the lane the engine runs (asked of the model itself, on
    every worker: tensor-parallel ranks must run one contract)."""
    found = set(llm.apply_model(_fingerprint))
    if len(found) != 1:
        raise RuntimeError(f"workers disagree on the lane contract: {sorted(found)}")
    return found.pop()


def invoked_contract(llm):
    """The contract of what the engine's lane actually ran so far (``Ops.invoked_contract``),
    checked against the contract it was started with: a site run with another program than
    the contract names, or a site the contract lacks, is refused here, naming the site.
    Every worker must have run the same."""
    found = set(llm.apply_model(_invoked_json))
    if len(found) != 1:
        raise RuntimeError(f"workers disagree on the lane's invoked contract: {len(found)} kinds")
    invoked = contract_from_json(json.loads(found.pop()))
    declared = set(llm.apply_model(_declared_json))
    check_invoked(contract_from_json(json.loads(declared.pop())), invoked, "the vLLM lane")
    check_kernels(invoked, "the vLLM lane")  # each site's kernels recorded and gated
    return invoked


def sampled_logprobs(completion) -> torch.Tensor:
    """float32 logprob of each sampled token of one vLLM CompletionOutput (exact: the engine's
    float32 values travel as Python floats, which hold them without rounding)."""
    if completion.logprobs is None:
        raise ValueError("the request did not ask for logprobs (SamplingParams(logprobs=0))")
    values = [
        lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def prompt_logprobs(output) -> torch.Tensor:
    """float32 logprob of prompt tokens 1..n-1 of one RequestOutput (prompt_logprobs=0)."""
    ids, lps = output.prompt_token_ids, output.prompt_logprobs
    if lps is None:
        raise ValueError("the request did not ask for prompt_logprobs")
    return torch.tensor(
        [lps[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64
    ).to(torch.float32)
