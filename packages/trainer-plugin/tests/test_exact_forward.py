"""The key claim: the Megatron model's logprobs are the reference forward's bytes."""

from __future__ import annotations

import pytest
import torch

from lockstep_exact.lanes import qwen3
from lockstep_megatron.convert import build, load_hf_weights


def _batch(seqs: list[torch.Tensor], pad: int) -> torch.Tensor:
    toks = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks


def _sequences(vocab: int, lengths=(9, 33, 4, 17)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def loaded(model_dir):
    model = build(model_dir).eval()
    return model, load_hf_weights(model_dir)


def test_megatron_logprobs_equal_reference_bytes_in_padded_batches(loaded):
    model, weights = loaded
    seqs = _sequences(model.geom.vocab)
    for pad in (0, model.geom.vocab - 1):  # what fills the padding must not matter
        with torch.no_grad():
            lp = model(_batch(seqs, pad))
        assert lp.dtype == torch.float32
        for i, s in enumerate(seqs):
            ref = qwen3.forward_logprobs(weights, model.geom, s)
            assert torch.equal(lp[i, : len(s)], ref), f"sequence {i} (len {len(s)}), pad {pad}"


def test_one_ulp_weight_change_is_caught(model_dir):
    model = build(model_dir).eval()
    weights = load_hf_weights(model_dir)
    seqs = _sequences(model.geom.vocab, (12, 5))
    emb = model.gpt.embedding.word_embeddings.weight
    with torch.no_grad():
        bits = emb.view(torch.int16)
        bits[int(seqs[0][0]), 0] += 1  # one bf16 ulp
        lp = model(_batch(seqs, 0))
    assert not torch.equal(lp[0, :12], qwen3.forward_logprobs(weights, model.geom, seqs[0]))


def test_training_mode_forward_has_the_same_bytes(loaded):
    model, weights = loaded
    seq = _sequences(model.geom.vocab, (10,))[0]
    model.train()
    try:
        lp = model(seq[None])
    finally:
        model.eval()
    assert torch.equal(lp[0].detach(), qwen3.forward_logprobs(weights, model.geom, seq))
    # input control: the reference with the first token's embedding row one bf16 ulp off
    moved = dict(weights)
    emb = weights["model.embed_tokens.weight"].clone()
    emb.view(torch.int16)[int(seq[0]), 0] += 1
    moved["model.embed_tokens.weight"] = emb
    assert not torch.equal(lp[0].detach(), qwen3.forward_logprobs(moved, model.geom, seq))
