"""The hybrid lane's Megatron model (Qwen3-Next) run whole on cuda.

The tiny qwen3-next (``make_tiny``), built by ``lockstep_megatron.convert.build`` and moved to
the GPU: its caches (GdnState, conv window, attention K/V) are made on the GPU
(``NextCache.empty(geom, device)``), every program runs on the cuda backend (the hybrid ones are
the cpu code on CUDA tensors, ``programs.cuda.hybrid``). Claims, byte for byte: a sequence
scored alone == scored inside a right-padded batch; scoring is repeatable; the Megatron model
== the composition (``lanes.qwen3_next.forward_logprobs``) on the same cuda weights; a one-ulp
change of one weight moves the bytes. The GPU tests run with ``pytest -m gpu``; the cpu test
below checks the cache placement that makes them possible.
"""

from __future__ import annotations

import pytest
import torch

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3_next as N

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("next-gpu") / "m", arch="qwen3-next")


def _model(next_dir, dev):
    from lockstep_megatron.convert import build

    return build(next_dir).to(dev).eval()


def _sequences(vocab: int, lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _batch(seqs, pad: int) -> torch.Tensor:
    toks = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    return toks


# Longer and shorter than the 64-token GDN chunk, and on its boundary.
LENGTHS = (150, 70, 9, 64, 65, 1)


@gpu
def test_megatron_hybrid_on_cuda_alone_equals_in_batch_and_repeats(next_dir, dev):
    model = _model(next_dir, dev)
    seqs = _sequences(model.geom.vocab, LENGTHS)
    with torch.no_grad():
        batch = model(_batch(seqs, 0).to(dev))
        again = model(_batch(seqs, 0).to(dev))
        other_pad = model(_batch(seqs, model.geom.vocab - 1).to(dev))
    assert batch.device.type == "cuda" and batch.dtype == torch.float32
    assert torch.equal(batch.view(torch.int32), again.view(torch.int32)), "not repeatable"
    for i, s in enumerate(seqs):
        with torch.no_grad():
            alone = model(s[None].to(dev))[0]
        n = len(s)
        assert torch.equal(batch[i, :n].view(torch.int32), alone.view(torch.int32)), (
            f"sequence {i} (len {n}): alone != in the batch"
        )
        assert torch.equal(other_pad[i, :n].view(torch.int32), alone.view(torch.int32)), i
    invoked = model.invoked_contract(dev)
    assert invoked.backend == "cuda"
    names = {p.name for p in invoked.sites.values()}
    assert {"gdn.chunked", "conv1d.causal", "rope.partial", "moe.shared_gate"} <= names


@gpu
def test_megatron_hybrid_on_cuda_is_the_composition_on_cuda(next_dir, dev):
    from lockstep_megatron.convert import load_hf_weights

    model = _model(next_dir, dev)
    weights = {k: v.to(dev) for k, v in load_hf_weights(next_dir).items()}
    for s in _sequences(model.geom.vocab, (150, 9)):
        with torch.no_grad():
            lp = model(s[None].to(dev))[0]
        ref = N.forward_logprobs(weights, model.geom, s.to(dev))
        assert ref.device.type == "cuda"
        assert torch.equal(lp.view(torch.int32), ref.view(torch.int32)), f"len {len(s)}"


@gpu
@pytest.mark.parametrize("where", ["in_proj", "A_log", "conv1d", "embedding"])
def test_one_ulp_weight_change_moves_the_cuda_bytes(next_dir, dev, where):
    model = _model(next_dir, dev)
    seq = _sequences(model.geom.vocab, (80,))[0].to(dev)
    with torch.no_grad():
        ref = model(seq[None])[0]
    i = model.geom.layer_types.index(N.LINEAR)
    mixer = model.gpt.decoder.layers[i].self_attention
    t = {
        "in_proj": (mixer.in_proj.weight, 0),
        "A_log": (mixer.A_log, 0),
        "conv1d": (mixer.conv1d.weight, 0),
        # the embedding row of the sequence's first token
        "embedding": (
            model.gpt.embedding.word_embeddings.weight,
            int(seq[0]) * model.geom.hidden,
        ),
    }[where]
    with torch.no_grad():
        w, idx = t
        bits = w.view(torch.int16) if w.dtype == torch.bfloat16 else w.view(torch.int32)
        bits.view(-1)[idx] += 1  # one ulp
        moved = model(seq[None])[0]
    assert not torch.equal(moved.view(torch.int32), ref.view(torch.int32)), where


def test_megatron_batch_caches_are_made_on_the_rows_device():
    """The per-batch-column caches ``_sequence_rows`` hands the composition are on the device
    of Megatron's hidden states (meta here: no cpu tensor among them)."""
    from types import SimpleNamespace

    from lockstep_exact.app.tiny import tiny_config
    from lockstep_megatron.gdn.spec import _sequence_rows

    geom = N.Geometry.from_hf_config(tiny_config("qwen3-next"))
    x = torch.empty(5, 2, geom.hidden, dtype=torch.bfloat16, device="meta")
    rows, segs, positions = _sequence_rows(SimpleNamespace(geom=geom), x)
    assert rows.shape == (10, geom.hidden) and positions.device.type == "meta"
    for _, _, cache in segs:
        tensors = [*cache.conv.values(), *cache.keys.values(), *cache.values.values()]
        tensors += [t for st in cache.gdn.values() for t in (st.s, st.k, st.v, st.g, st.beta)]
        assert tensors and {t.device.type for t in tensors} == {"meta"}
