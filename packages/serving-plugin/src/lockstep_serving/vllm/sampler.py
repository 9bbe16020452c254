"""The lane's sampler in vLLM: every token of a lane model is drawn by ``sample.gumbel_topp``.

Three patches (rows of ``patches.TABLE``), all inert for stock models:

- ``InputProcessor.process_inputs`` (the front end, where a request is admitted): a request to
  a lane engine whose sampling parameters would change the rule (top_k, min_p, penalties,
  logit bias, allowed tokens, bad words, min_tokens, structured output, a thinking budget,
  watermarking, a seed outside int64) is refused there, with ``VLLMValidationError`` naming
  the parameter: the request fails, the engine keeps serving. A random request (temperature >
  0) that brought no seed gets a fresh one from ``secrets`` written into its own copy of the
  parameters, so it stays random as in stock vLLM and keeps one seed for its whole life
  (preemption included); such a draw cannot be replayed, because nobody recorded the seed.
  Traces need explicit seeds: ``capture`` passes one per sequence and records them.
- ``GPUModelRunner._sample`` (the worker, which the CPU runner inherits): for a lane model the
  row of each request is ``log_softmax.tree`` of its logits, and its token is the contract's
  ``sample`` site (``sample.gumbel_topp`` of row, temperature, top_p, seed, position), with
  ``position`` the absolute position of the token being chosen (the sequence length once
  this step's tokens are in). vLLM's
  torch generators are never used, and the runner's copy of them is emptied each step, so
  vLLM's rewind of a discarded partial-prefill draw (which crashes on CPU generators) has
  nothing to rewind: seeded requests and chunked prefill mix. Reported logprobs are the raw
  rows, gathered exactly as vLLM's own sampler gathers them. Under vLLM's async scheduling
  (its default on the GPU) the step does not wait for the device: a row the rule cannot draw
  from (a NaN, no finite log-probability) comes back as -1 and is refused by name when the
  tokens reach the host (``AsyncGPUModelRunnerOutput.get_output``, the third patch), before
  vLLM hands any token of that step out (the step's logprob gathers read token 0 for such a
  row, so no out-of-range index reaches the device). Each request's rule parameters are
  read and checked once, when the sampler first sees it (``RuleRows``), not every step.
- ``AsyncGPUModelRunnerOutput.get_output``: the original, then that refusal for a lane
  step's tokens (other engines' outputs are not touched).
"""

from __future__ import annotations

import secrets

import torch

from lockstep_exact.sites import paused

from ..common.errors import LaneRefused
from ..common.sampling import _INT64, refusal_text
from . import patches
from .architectures import ARCHITECTURES
from .model import LIVE

# vLLM's own greedy threshold: a temperature below it is greedy (SamplingParams forces the
# others up to 1e-2), and the lane's rule gets temperature 0 for it.
GREEDY_BELOW = 1e-5


def request_problem(sp) -> tuple[str, object, str] | None:
    """(parameter, value, why) for the first sampling parameter the lane's rule does not
    implement, or None. ``sp`` is a vLLM SamplingParams after the engine filled it in."""

    checks = (
        ("top_k", sp.top_k, sp.top_k not in (0, -1), "top-k truncation"),
        ("min_p", sp.min_p, sp.min_p > 0, "min-p truncation"),
        ("presence_penalty", sp.presence_penalty, sp.presence_penalty != 0, "a penalty"),
        ("frequency_penalty", sp.frequency_penalty, sp.frequency_penalty != 0, "a penalty"),
        ("repetition_penalty", sp.repetition_penalty, sp.repetition_penalty != 1, "a penalty"),
        ("logit_bias", sp.logit_bias, bool(sp.logit_bias), "a logit bias"),
        ("allowed_token_ids", sp.allowed_token_ids, sp.allowed_token_ids is not None, "a mask"),
        ("bad_words", sp.bad_words, bool(sp.bad_words), "a mask"),
        (
            "min_tokens",
            sp.min_tokens,
            sp.min_tokens > 0,
            "a mask over the stop tokens (EOS included, even with ignore_eos)",
        ),
        (
            "structured_outputs",
            sp.structured_outputs,
            sp.structured_outputs is not None,
            "a grammar mask",
        ),
        (
            "thinking_token_budget",
            sp.thinking_token_budget,
            sp.thinking_token_budget is not None,
            "forced tokens",
        ),
        # vLLM 0.26 has no watermarking field (0.32 added it).
        (
            "watermarking",
            getattr(sp, "watermarking", None),
            bool(getattr(sp, "watermarking", None)),
            "a watermark bias",
        ),
        (
            "seed",
            sp.seed,
            sp.seed is not None and not _INT64[0] <= sp.seed <= _INT64[1],
            "a seed outside int64",
        ),
    )
    for name, value, bad, why in checks:
        if bad:
            return name, value, why
    return None


def refusal(sp) -> str | None:
    return refusal_text(request_problem(sp))


def is_lane_config(model_config) -> bool:
    archs = getattr(model_config, "architectures", None) or getattr(
        getattr(model_config, "hf_config", None), "architectures", None
    )
    return bool(archs) and archs[0] in ARCHITECTURES


def prepare(sp) -> None:
    """Refuse (VLLMValidationError, naming the parameter) or make ready one request's own
    SamplingParams for the lane: a random request without a seed gets a fresh one."""
    message = refusal(sp)
    if message is not None:
        from vllm.exceptions import VLLMValidationError

        name = request_problem(sp)[0]
        raise VLLMValidationError(message, parameter=name, value=getattr(sp, name))
    if sp.seed is None and sp.temperature >= GREEDY_BELOW:
        sp.seed = secrets.randbits(63)


def process_inputs(self, request_id, prompt, params, *args, **kwargs):
    """InputProcessor.process_inputs: the original, then the lane's admission of the request
    (on the request's own copy of the parameters: the caller's object is never touched)."""
    original = patches.TABLE.original("InputProcessor.process_inputs")
    request = original(self, request_id, prompt, params, *args, **kwargs)
    sp = getattr(request, "sampling_params", None)
    if sp is not None and is_lane_config(self.model_config):
        prepare(sp)
    return request


def runner_model(runner):
    """The runner's model itself: vLLM wraps it (CUDAGraphWrapper) when it captures CUDA
    graphs, and a wrapper is not the lane model (the sampler would miss the lane)."""
    get = getattr(runner, "get_model", None)
    if callable(get):
        try:
            return get()
        except ValueError:  # "Cannot get model before model has been initialized"
            return None
    return getattr(runner, "model", None)


def _is_lane_runner(runner) -> bool:
    model = runner_model(runner)
    return model is not None and model in LIVE


def rule_of(rid, sp) -> tuple[float, float, int]:
    """(temperature, top_p, seed) of one request for the rule, or LaneRefused naming what
    keeps it out (a parameter that slipped past admission, a random request with no seed)."""
    message = refusal(sp)
    if message is not None:  # admission refuses these; a request that slipped by stops here
        raise LaneRefused(f"request {rid}: {message}")
    if sp.temperature < GREEDY_BELOW:
        return 0.0, 1.0, 0
    if sp.seed is None:
        raise LaneRefused(
            f"request {rid} reached the lane's sampler without a seed (admission gives every "
            "random request one; was the plugin's InputProcessor patch bypassed?)"
        )
    return float(sp.temperature), float(sp.top_p), int(sp.seed)


class RuleRows:
    """Each live request's rule parameters, worked out the first step the sampler sees it
    (a request's SamplingParams do not change over its life) and dropped once it leaves the
    batch: the step's host work is a lookup per row, not the parameter checks."""

    def __init__(self):
        self._by_id: dict[str, tuple[object, tuple[float, float, int]]] = {}

    def rows(self, runner, n: int):
        temps, tops, seeds = [], [], []
        req_ids = runner.input_batch.req_ids[:n]
        for rid in req_ids:
            sp = runner.requests[rid].sampling_params
            got = self._by_id.get(rid)
            if got is None or got[0] is not sp:  # a new request (or an id used again)
                got = (sp, rule_of(rid, sp))
                self._by_id[rid] = got
            t, p, seed = got[1]
            temps.append(t)
            tops.append(p)
            seeds.append(seed)
        if len(self._by_id) > 2 * n + 64:  # forget the requests that left
            keep = set(req_ids)
            self._by_id = {k: v for k, v in self._by_id.items() if k in keep}
        return temps, tops, seeds


def rows_of(runner, n: int):
    """(temperature, top_p, seed, position) per row of the runner's batch, for the rule."""
    cache = runner.__dict__.get("_lockstep_rule_rows")
    if cache is None:
        cache = runner.__dict__["_lockstep_rule_rows"] = RuleRows()
    temps, tops, seeds = cache.rows(runner, n)
    # The token being chosen sits right after this step's tokens: its absolute position is the
    # sequence length once they are computed.
    positions = runner.optimistic_seq_lens_cpu[:n].to(torch.int64)
    return temps, tops, seeds, positions


# The attribute a lane step's sampled-token tensor carries when its -1 rows (rows the rule
# could not draw from) are left for ``checked_output`` to refuse: the step's request ids.
UNCHECKED = "_lockstep_unchecked_rows"


def refuse_undrawn(tokens_cpu: torch.Tensor, req_ids) -> None:
    """LaneRefused naming the first request whose token is -1 (its row held a NaN or no
    finite log-probability, so the rule drew nothing), if any."""
    flat = tokens_cpu.reshape(-1)
    if flat.numel() and int(flat.min()) < 0:
        i = int((flat < 0).nonzero()[0, 0])
        rid = req_ids[i] if i < len(req_ids) else f"row {i}"
        raise LaneRefused(
            f"request {rid}: sample.gumbel_topp drew no token: its log-probability row holds "
            "a NaN or no finite value (the logits of this step are not usable)"
        )


def checked_output(self):
    """AsyncGPUModelRunnerOutput.get_output: the original (it waits for the copy of the
    tokens), then a lane step's deferred refusal of a row the rule could not draw from."""
    rows = getattr(getattr(self, "_sampled_token_ids", None), UNCHECKED, None)
    out = patches.TABLE.original("AsyncGPUModelRunnerOutput.get_output")(self)
    if rows is not None:
        refuse_undrawn(self.sampled_token_ids_cpu, rows)
    return out


def lane_sample(self, logits, spec_decode_metadata):
    """GPUModelRunner._sample: the rule for lane models, vLLM's sampler for every other."""
    if not _is_lane_runner(self):
        return patches.TABLE.original("GPUModelRunner._sample")(self, logits, spec_decode_metadata)
    from vllm.v1.outputs import LogprobsTensors, SamplerOutput

    if spec_decode_metadata is not None:
        raise LaneRefused("speculative decoding reached the lane's sampler; it is not exact")
    md = self.input_batch.sampling_metadata
    n = self.input_batch.num_reqs
    if logits.shape[0] != n:
        raise LaneRefused(f"the lane's sampler got {logits.shape[0]} logit rows for {n} requests")
    # Lane requests never draw from torch generators (see the module docstring).
    self.input_batch.generators.clear()
    # The raw rows, from the lane's logprobs site (what Sampler.compute_logprobs gives too).
    ops = runner_model(self).ops
    with paused():  # bisect records the logprobs site from the model's forward, every row
        raw = ops.log_softmax("logprobs", logits.to(torch.float32))
    temps, tops, seeds, positions = rows_of(self, n)
    # vLLM's async scheduling prepares the next step while this one runs: the check of the
    # tokens waits for them on the host (checked_output), not here.
    deferred = bool(getattr(self, "use_async_scheduling", False)) and raw.is_cuda
    tokens = ops.sample(
        "sample", raw, temperature=temps, top_p=tops, seeds=seeds, positions=positions,
        check=not deferred,
    )  # fmt: skip

    # The logprob gathers index the rows by token: a -1 left for the host check would be an
    # out-of-range index on the device (a CUDA assert, not the refusal's words), so they read
    # token 0 there; that step is refused before its tokens or logprobs are handed out.
    drawn = tokens.clamp_min(0) if deferred else tokens
    num_logprobs = md.max_num_logprobs
    specific = None
    if md.logprob_token_ids:
        specific = self.sampler.gather_specific_token_logprobs(raw, md.logprob_token_ids, drawn)
    if num_logprobs is None:
        logprobs_tensors = specific
    elif num_logprobs == -1:
        logprobs_tensors = LogprobsTensors(torch.empty(0), raw, torch.empty(0))
    else:
        logprobs_tensors = self.sampler.gather_logprobs(raw, num_logprobs, token_ids=drawn)
    if specific is not None and num_logprobs is not None:
        logprobs_tensors = specific
    sampled = tokens.to(torch.int32).unsqueeze(-1)
    if deferred:
        setattr(sampled, UNCHECKED, list(self.input_batch.req_ids[:n]))
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=logprobs_tensors,
    )
