"""Helpers for the serving tests: real vLLM, in-process, on tiny models.

The environment is set before vLLM is imported: in-process engine core (no spawn), 1 GiB KV
cache, offline hub, and every cache and temporary file under one directory of this session.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

from lockstep_serving.vllm.offline import isolate

_ROOT = Path(tempfile.mkdtemp(prefix="lockstep-serving-"))
isolate(_ROOT, override=True, tmp=True)

FAMILIES = {"qwen3": "LockstepQwen3ForCausalLM", "qwen3-moe": "LockstepQwen3MoeForCausalLM"}


def start_engine(model_dir, **overrides):
    from vllm import LLM

    from lockstep_serving.vllm.offline import engine_args

    args = engine_args(model_dir, **overrides)
    args.setdefault("max_model_len", 512)
    args.setdefault("block_size", 32)
    return LLM(**args)


def stop_engine(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def rule_params(max_tokens: int, *, greedy: bool = False, seed: int = 7):
    """SamplingParams inside the lane's rule: greedy, or temperature 1 and top_p 1 with a seed;
    the sampled token's logprob returned, EOS ignored."""
    from vllm import SamplingParams

    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    return SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0, seed=seed, ignore_eos=True
    )


def decisions_of(out):
    """(token ids, fp32 logprob of each) of a request output's first completion."""
    from lockstep_serving.vllm.offline import sampled_logprobs

    c = out.outputs[0]
    return list(c.token_ids), sampled_logprobs(c)


def flip_lowest_bit(t):
    """A copy of the float32 tensor ``t`` whose element 0 is one ulp away."""
    out = t.clone()
    out.view(__import__("torch").int32)[0] ^= 1
    return out


def assert_same_bytes_and_comparator(a, b, what: str) -> None:
    """a and b are byte-identical, and the comparator sees a one-ulp change of b.

    Only the comparator's check: it is no negative control (a check built from the thing it
    checks cannot fail). Each test pairs it with a control that changes an input (a weight, an
    adapter factor, a seed, a cache entry) and shows the compared result moves."""
    from lockstep_exact.parity import same_bytes
    from lockstep_exact.testing import assert_same_bytes

    assert_same_bytes(a, b, what)
    assert not same_bytes(a, flip_lowest_bit(b)), f"{what}: the check misses a one-ulp change"


def nudged_weights(weights: dict, key: str, index: int = 0) -> dict:
    """``weights`` with element ``index`` of ``key`` one bf16 ulp away (a reference forward's
    input control: the model the engine did not run)."""
    from lockstep_exact.testing import nudge_ulp

    return {**weights, key: nudge_ulp(weights[key], index)}


def embedding_nudged(weights: dict, token: int) -> dict:
    """``weights`` with element 0 of ``token``'s embedding row one bf16 ulp away (the hybrid
    lane's norms scale by 1 + w: one ulp of a norm weight near 0 is absorbed)."""
    key = "model.embed_tokens.weight"
    return nudged_weights(weights, key, token * weights[key].shape[1])


def next_composition(
    weights: dict, geom, prompt: list, tokens: list, adapters=None, backend: str = "cpu"
):
    """fp32 [len(tokens)] on the host: the qwen3-next composition's logprob of each of
    ``tokens`` after ``prompt``, run as one forward over prompt + tokens (its log_softmax
    included) with ``backend``'s programs (the lane's contract on that backend; cuda moves
    the weights and tokens there)."""
    import torch

    from lockstep_exact.lanes import qwen3_next as N

    ids = torch.tensor(prompt + tokens)
    if backend != "cpu":
        weights = {k: v.to(backend) for k, v in weights.items()}
        ids = ids.to(backend)
    ops = N.default_ops(geom, backend)
    ref = N.forward_logprobs(weights, geom, ids, ops=ops, adapters=adapters).cpu()
    return torch.stack([ref[len(prompt) - 1 + j, t] for j, t in enumerate(tokens)])


def assert_equals_composition(outs, prompts, weights: dict, geom, what: str, backend="cpu"):
    """Each completion of ``outs`` (prompts ``prompts``) carries the qwen3-next composition's
    bytes on ``backend`` for its decisions; control: the composition on the model with the
    first prompt token's embedding one ulp off parts from the first completion's bytes."""
    from lockstep_exact.parity import same_bytes

    for out, prompt in zip(outs, prompts, strict=True):
        tokens, got = decisions_of(out)
        want = next_composition(weights, geom, prompt, tokens, backend=backend)
        assert_same_bytes_and_comparator(want, got, f"prompt of {len(prompt)} tokens: {what}")
    tokens, got = decisions_of(outs[0])
    moved = embedding_nudged(weights, prompts[0][0])
    want_moved = next_composition(moved, geom, prompts[0], tokens, backend=backend)
    assert not same_bytes(want_moved, got), f"{what}: the check misses a one-ulp model change"


def assert_decode_equals_prefill(decoded, prompt_lps, moved_lps, n: int, decisions: int, what):
    """The decisions of an ``n``-token prompt's completion ``decoded`` are the bytes of one
    prefill of prompt + decisions (``prompt_lps``: its prompt logprobs, entry j the logprob of
    token j + 1, so decision i at position n + i is entry n - 1 + i); control: the prefill of
    the prompt with its last token changed (``moved_lps``) parts from the decode."""
    from lockstep_exact.parity import same_bytes

    _, decode = decisions_of(decoded)
    prefill = prompt_lps[n - 1 : n - 1 + decisions]
    assert_same_bytes_and_comparator(decode, prefill, what)
    assert not same_bytes(decode, moved_lps[n - 1 : n - 1 + decisions])


def assert_alone_equals_batched(alone, batched, other_seed, what: str) -> None:
    """A request served alone has the tokens and bytes it has inside a batch; control (where
    ``other_seed`` is given; a test checking several requests gives it for one): the same
    request alone with another seed parts from the batched one."""
    from lockstep_exact.parity import same_bytes

    alone_tokens, alone_lps = decisions_of(alone)
    batch_tokens, batch_lps = decisions_of(batched)
    assert alone_tokens == batch_tokens, what
    assert_same_bytes_and_comparator(alone_lps, batch_lps, what)
    if other_seed is not None:
        seed_tokens, seed_lps = decisions_of(other_seed)
        assert seed_tokens != batch_tokens or not same_bytes(seed_lps, batch_lps)


def nudge_engine_weight(name: str = "model.norm.weight", index: int = 0):
    """For ``llm.apply_model``: in the running lane model, element ``index`` of weight ``name``
    one bf16 ulp up, in place (an input control without a second engine start: every later
    request of that engine runs the moved model, so it goes last)."""

    def nudge(model) -> None:
        import torch

        bits = model.weights[name].view(torch.int16).view(-1)
        bits[index] += 1

    return nudge


def nudge_every_page(model) -> None:
    """For ``llm.apply_model``: in every attention layer's cache, K element 0 of kv head 0 at
    slot 0 of every page one bf16 ulp away, in place: what a prefix-cache hit reads back (the
    input control of a hit)."""
    import torch

    for a in model.attn:
        entry = a.kv_cache[:, 0, 0, 0]
        entry.copy_((entry.view(torch.int16) + 1).view(torch.bfloat16))
