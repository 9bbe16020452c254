"""The lane's sampler in SGLang: every token of a lane model is drawn by ``sample.gumbel_topp``.

SGLang's CPU platform forces ``sampling_backend="pytorch"`` whatever the engine was started
with, so the lane's sampler is registered under that name (``plugin.register``): SGLang's
``create_sampler`` looks registered factories up before its built-in names. A cuda engine must
be started with ``sampling_backend="pytorch"`` (``capture.engine_args`` does; the lane
model refuses another). The rule runs on the logits' device: the cuda programs on a cuda
engine. ``LaneSampler`` draws with the lane's rule only while a lane model lives in the
process; for any other model it is SGLang's own ``Sampler``, unchanged. That it really is the
sampler in use is checked at run time: the lane model refuses to start unless a
``LaneSampler`` was built in its process (SGLang builds the sampler just before the model),
and refuses a forward step whose previous logits no ``LaneSampler`` consumed
(``model``).

Per row: ``log_softmax.tree`` of the lane's fp32 logits (the raw row, what SGLang reports as
the token's logprob), then the contract's ``sample`` site with the request's temperature,
top_p, seed and the absolute position of the token being chosen. SGLang turns a temperature
below its epsilon into ``top_k=1`` (greedy): the rule gets temperature 0 for those rows.
Seeds: ``SamplingBatchInfo.from_schedule_batch`` is patched (inert without a lane model) to
carry every request's ``sampling_seed``; a random request without one gets a fresh seed from
``secrets``, written into its own parameters, so it keeps one seed for its whole life (such a
draw cannot be replayed: nobody recorded the seed; captures pass explicit seeds).

Anything else that would change the token distribution (top_k, min_p, penalties, min_new_tokens,
a logit bias, a grammar, a custom logit processor) is refused, naming the parameter: in SGLang's
front end first (``TokenizerManager._create_tokenized_object`` is patched: a ``ValueError``
fails that request and the engine serves on), and again in the scheduler, where a request
that slipped by stops the engine (fail-closed).
"""

from __future__ import annotations

import secrets

import torch

from lockstep_exact import programs as P
from lockstep_exact.sites import paused

from ..common.errors import LaneRefused
from ..common.lane import FAMILY_OF
from ..common.sampling import _INT64, refusal_text
from . import patches
from .model import LIVE, SAMPLERS

RULE = P.Program.of("sample.gumbel_topp")
TOP_K_ALL = 1 << 30  # sglang.srt.sampling.sampling_params.TOP_K_ALL: no top-k truncation


def _lane_model():
    return next(iter(LIVE), None)


def request_problem(sp) -> tuple[str, object, str] | None:
    """(parameter, value, why) for the first parameter of an SGLang SamplingParams the lane's
    rule does not implement, or None."""
    checks = (
        ("min_p", sp.min_p, sp.min_p > 0, "min-p truncation"),
        ("frequency_penalty", sp.frequency_penalty, sp.frequency_penalty != 0, "a penalty"),
        ("presence_penalty", sp.presence_penalty, sp.presence_penalty != 0, "a penalty"),
        ("repetition_penalty", sp.repetition_penalty, sp.repetition_penalty != 1, "a penalty"),
        ("min_new_tokens", sp.min_new_tokens, sp.min_new_tokens > 0, "a mask over stop tokens"),
        ("logit_bias", sp.logit_bias, bool(sp.logit_bias), "a logit bias"),
        ("json_schema", sp.json_schema, sp.json_schema is not None, "a grammar mask"),
        ("regex", sp.regex, sp.regex is not None, "a grammar mask"),
        ("ebnf", sp.ebnf, sp.ebnf is not None, "a grammar mask"),
        ("structural_tag", sp.structural_tag, sp.structural_tag is not None, "a grammar mask"),
        (
            "sampling_seed",
            sp.sampling_seed,
            sp.sampling_seed is not None and not _INT64[0] <= sp.sampling_seed <= _INT64[1],
            "a seed outside int64",
        ),
    )
    for name, value, bad, why in checks:
        if bad:
            return name, value, why
    # top_k == 1 is SGLang's greedy (it sets it for temperature 0); anything else truncates.
    if sp.top_k not in (1, TOP_K_ALL, -1):
        return "top_k", sp.top_k, "top-k truncation"
    return None


def refusal(sp) -> str | None:
    return refusal_text(request_problem(sp))


def from_schedule_batch(cls, batch, vocab_size):
    """SamplingBatchInfo.from_schedule_batch: the original; on a lane engine, every request
    refused or given a seed first, and the batch's ``sampling_seed`` always filled in."""

    original = patches.TABLE.original("SamplingBatchInfo.from_schedule_batch")
    if _lane_model() is None:
        return original(batch, vocab_size)
    seeds = []
    for req in batch.reqs:
        sp = req.sampling_params
        message = refusal(sp)
        if message is not None:
            raise LaneRefused(f"request {req.rid}: {message}")
        greedy = sp.top_k == 1
        if sp.sampling_seed is None and not greedy:
            sp.sampling_seed = secrets.randbits(63)
        seeds.append(0 if sp.sampling_seed is None else int(sp.sampling_seed))
    info = original(batch, vocab_size)
    info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.temperatures.device)
    return info


def is_lane_config(model_config) -> bool:
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None)
    return bool(archs) and archs[0] in FAMILY_OF


def admission_problem(obj, sp) -> str | None:
    """Why the lane refuses one request at SGLang's front end, or None."""
    message = refusal(sp)
    if message is not None:
        return message
    start = getattr(obj, "logprob_start_len", None)
    if getattr(obj, "return_logprob", False) is True and isinstance(start, int) and start >= 0:
        return (
            f"Lockstep exact lane: logprob_start_len={start} asks for prompt logprobs; the "
            "SGLang lane reports sampled-token logprobs only"
        )
    return None


def create_tokenized_object(self, obj, *args, **kwargs):
    """TokenizerManager._create_tokenized_object: the original, then the lane's admission of
    the request, in SGLang's front end (a ValueError: the request fails, the engine serves on)."""

    original = patches.TABLE.original("TokenizerManager._create_tokenized_object")
    out = original(self, obj, *args, **kwargs)
    sp = getattr(out, "sampling_params", None)
    if sp is not None and is_lane_config(self.model_config):
        message = admission_problem(obj, sp)
        if message is not None:
            raise ValueError(message)
    return out


def _rows(sampling_info, n: int):
    """(temperature, top_p, seed) per row, for the rule; refuses what the rule lacks."""
    si = sampling_info
    if si.has_custom_logit_processor:
        raise LaneRefused("Lockstep exact lane: a custom logit processor changes the logits")
    if si.logit_bias is not None:
        raise LaneRefused("Lockstep exact lane: a logit bias changes the logits")
    if si.grammars is not None and any(g is not None for g in si.grammars):
        raise LaneRefused("Lockstep exact lane: a grammar masks the logits")
    orchestrator = si.penalizer_orchestrator
    if orchestrator is not None and orchestrator.is_required():
        raise LaneRefused("Lockstep exact lane: a penalty (or min_new_tokens) changes the logits")
    if si.sampling_seed is None or si.sampling_seed.shape[0] != n:
        raise LaneRefused(
            "Lockstep exact lane: the batch carries no seed per request (was the plugin's "
            "SamplingBatchInfo.from_schedule_batch patch bypassed?)"
        )
    top_ks = si.top_ks.tolist()
    min_ps = si.min_ps.tolist()
    temps_in = si.temperatures.reshape(-1).tolist()
    tops_in = si.top_ps.tolist()
    seeds_in = si.sampling_seed.tolist()
    temps, tops, seeds = [], [], []
    for r in range(n):
        if min_ps[r] > 0 or top_ks[r] not in (1, TOP_K_ALL):
            raise LaneRefused(
                f"Lockstep exact lane: row {r} asks for top_k={top_ks[r]}, min_p={min_ps[r]}; "
                f"the lane draws with {RULE.ident} (temperature and top_p only)"
            )
        if top_ks[r] == 1:  # SGLang's greedy
            temps.append(0.0)
            tops.append(1.0)
            seeds.append(0)
        else:
            temps.append(float(temps_in[r]))
            tops.append(float(tops_in[r]))
            seeds.append(int(seeds_in[r]))
    return temps, tops, seeds


def _stock_sampler_base():
    from sglang.srt.layers.sampler import Sampler

    return Sampler


def lane_sampler_class():
    """``LaneSampler``, a subclass of SGLang's Sampler (built on first use: imports SGLang)."""
    if "cls" in _CLASS:
        return _CLASS["cls"]
    Sampler = _stock_sampler_base()

    class LaneSampler(Sampler):
        """SGLang's Sampler, with the lane's rule while a lane model lives in the process."""

        def __init__(self):
            super().__init__()
            SAMPLERS.add(self)

        def forward(
            self,
            logits_output,
            sampling_info,
            return_logprob,
            top_logprobs_nums,
            token_ids_logprobs,
            positions,
        ):
            model = _lane_model()
            if model is None:
                return super().forward(
                    logits_output,
                    sampling_info,
                    return_logprob,
                    top_logprobs_nums,
                    token_ids_logprobs,
                    positions,
                )
            return lane_forward(
                self,
                model,
                logits_output,
                sampling_info,
                return_logprob,
                top_logprobs_nums,
                token_ids_logprobs,
                positions,
            )

    _CLASS["cls"] = LaneSampler
    return LaneSampler


_CLASS: dict[str, type] = {}


def lane_forward(
    sampler,
    model,
    logits_output,
    sampling_info,
    return_logprob,
    top_logprobs_nums,
    token_ids_logprobs,
    positions,
):
    logits = logits_output.next_token_logits
    n = logits.shape[0]
    if logits.dtype != torch.float32:
        raise LaneRefused(
            f"Lockstep exact lane: the sampler got {logits.dtype} logits; the lane's are fp32 "
            "(was the lane model's LogitsProcessorOutput replaced?)"
        )
    temps, tops, seeds = _rows(sampling_info, n)
    ops = model.ops
    with paused():  # bisect records the logprobs site from the model's forward, every row
        raw = ops.log_softmax("logprobs", logits)
    # SGLang hands the position of the last input token; the token being chosen sits after it.
    chosen = positions.to(torch.int64).reshape(-1) + 1
    if chosen.shape[0] != n:
        raise LaneRefused(f"the lane's sampler got {chosen.shape[0]} positions for {n} rows")
    tokens = ops.sample("sample", raw, temperature=temps, top_p=tops, seeds=seeds, positions=chosen)
    model.sampled()
    if return_logprob:
        # SGLang's own gathering (sampled token, top-k, requested ids) from the raw rows; it
        # clamps -inf to the dtype's minimum in place, so it gets a copy.
        result = sampler.output_logprob_processor.compute_logprobs(
            raw.clone(), top_logprobs_nums, token_ids_logprobs, tokens
        )
        result.write_output_to(logits_output)
    return tokens.to(torch.int32)  # what SGLang's own sampling path returns
