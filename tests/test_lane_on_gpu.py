"""The exact lane on the GPU, both halves (issue 6): the serving-side composition samples on
CUDA (prefill, then decode over a growing KV cache, sequences batched together as vLLM batches
them), and the real megatron-core model replays every decision byte for byte.

vLLM itself is not installed on the GPU machine, so the sampler here is the lane composition
that the vLLM plugin's model runs, driven directly. See docs/gpu.md for a recorded run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _sample(weights, geom, prompts, per_prompt, seed):
    """Batched incremental decoding with the lane composition on CUDA; raw fp32 logprobs.

    Returns (sampled, logprobs, ops): ``ops`` logged what the composition ran."""
    from lockstep_exact.lanes import qwen3

    ops = qwen3.default_ops(geom, "cuda")
    caches = [[[None, None] for _ in range(geom.layers)] for _ in prompts]

    class CacheSlots(qwen3.DictSlots):
        """Each sequence's K/V appended to its own contiguous cache (a paged cache's bytes)."""

        bounds: list[int] = []

        def attend(self, li, q, k, v, positions, core):
            outs = []
            for j in range(len(prompts)):
                a, b = self.bounds[j], self.bounds[j + 1]
                ck, cv = caches[j][li]
                ck = k[a:b] if ck is None else torch.cat([ck, k[a:b]])
                cv = v[a:b] if cv is None else torch.cat([cv, v[a:b]])
                caches[j][li] = [ck, cv]
                outs.append(core(q[a:b], ck, cv, positions[a:b]))
            return torch.cat(outs)

    slots = CacheSlots(weights, geom)
    gen = torch.Generator().manual_seed(seed)
    new = [torch.as_tensor(p) for p in prompts]
    starts = [0] * len(prompts)
    sampled = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    for _ in range(per_prompt):
        tokens = torch.cat(new).cuda()
        positions = torch.cat(
            [torch.arange(s, s + len(n)) for s, n in zip(starts, new, strict=True)]
        ).cuda()
        slots.bounds = torch.tensor([0] + [len(n) for n in new]).cumsum(0).tolist()
        h = qwen3.layers(ops, geom, slots, qwen3.embed(ops, slots, tokens), positions)
        last = torch.tensor(slots.bounds[1:]) - 1
        lp = qwen3.logprobs(ops, qwen3.final_logits(ops, geom, slots, h[last.cuda()])).cpu()
        nxt = torch.multinomial(lp.double().exp(), 1, generator=gen)[:, 0]
        for j in range(len(prompts)):
            sampled[j].append(int(nxt[j]))
            logprobs[j].append(lp[j, nxt[j]])
            starts[j] += len(new[j])
        new = [nxt[j : j + 1] for j in range(len(prompts))]
    return sampled, [torch.stack(x) for x in logprobs], ops


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_megatron_on_gpu_replays_a_gpu_trace_byte_for_byte(arch, tmp_path):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from lockstep_exact.app.tiny import default_prompts, make_tiny
    from lockstep_exact.k3 import compare
    from lockstep_exact.lanes import qwen3
    from lockstep_exact.model import model_hash as dir_hash
    from lockstep_exact.testing import nudge_ulp
    from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace
    from lockstep_megatron.convert import build
    from lockstep_megatron.replay import score

    model_dir = make_tiny(tmp_path / arch, arch=arch)
    geom = qwen3.Geometry.from_model_dir(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in default_prompts(8)]
    weights = {k: v.cuda() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    sampled, lps, ops = _sample(weights, geom, prompts, 8, seed=7)
    trace = Trace.from_sequences(
        prompts,
        sampled,
        lps,
        contract_fingerprint=ops.invoked_contract().fingerprint,
        contract=ops.invoked_contract().to_json(),
        model_hash=dir_hash(model_dir),
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    )

    # decode over the cache == a one-shot prefill of the whole sequence (full model, GPU)
    for j in range(len(prompts)):
        seq = torch.tensor(prompts[j] + sampled[j]).cuda()
        ref = qwen3.forward_logprobs(weights, geom, seq).cpu()
        rows = torch.arange(len(prompts[j]) - 1, len(seq) - 1)
        assert compare(lps[j], ref[rows, torch.tensor(sampled[j])]).exact, f"sequence {j}"

    model = build(model_dir).cuda().eval()
    got = score(model, trace, micro_batch=3)
    assert model.invoked_contract("cuda").fingerprint == trace.contract_fingerprint
    cmp = compare(trace.logprobs, got)
    print(f"{arch}: {cmp}")
    assert cmp.exact and cmp.k3_max == 0.0 and cmp.n == 64

    # control: one weight one ulp off in the trainer is caught
    w = model.gpt.decoder.final_layernorm.weight
    with torch.no_grad():
        w.copy_(nudge_ulp(w, 3))
    assert not compare(trace.logprobs, score(model, trace, micro_batch=3)).exact
