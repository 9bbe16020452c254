"""Megatron at tp 2 with a vocab-parallel LM head: each rank computes the logits of its
vocabulary rows and log_softmax.tree on its shard (the unsharded bytes), and the forward
returns the whole [b, s, V] row, byte-equal to one device; an odd vocabulary is padded to equal
shards and the padding cut; a tied head uses the embedding's own shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import same_bytes
from lockstep_megatron.convert import load_hf_weights
from lockstep_megatron.spec import vocab_rows, vocab_shard

pytestmark = pytest.mark.slow

TOKENS = [[5, 17, 200, 3, 99, 42, 7, 7, 61], [12, 88, 30, 1, 2, 45, 9, 77, 31]]


def _rank(rank: int, store: str, model_dirs: list[str], out: str) -> None:
    """One tp rank: for each model, its logits shard and the whole logprobs; for the first,
    also the logprobs with rank 1's first lm_head row one bf16 ulp up (the control)."""
    import torch.distributed as dist

    from lockstep_megatron.cpu import ensure_cpu_megatron

    ensure_cpu_megatron()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=2, rank=rank)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        from lockstep_megatron.convert import build

        parallel_state.initialize_model_parallel(2, 1)
        mrandom.model_parallel_cuda_manual_seed(0)
        tokens = torch.tensor(TOKENS)
        results = []
        for i, model_dir in enumerate(model_dirs):
            model = build(model_dir, 2).eval()
            with torch.no_grad():
                logits = model.model(input_ids=tokens, position_ids=None, attention_mask=None)
                res = {"logits": logits, "logprobs": model(tokens)}
                res["contract"] = model.invoked_contract().fingerprint
                if i == 0:
                    w = model.gpt.output_layer.weight
                    if rank == 1:
                        w[0, 0] = (w[0, 0].view(torch.int16) + 1).view(w.dtype)
                    res["control"] = model(tokens)
            results.append(res)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _one_device(model_dir: Path):
    """The reference composition (the sampler's programs): [b, s, V] logits and logprobs,
    and the fingerprint of the contract it invoked."""
    geom = qwen3.Geometry.from_model_dir(model_dir)
    weights = load_hf_weights(model_dir)
    slots = qwen3.DictSlots(weights, geom)
    ops = qwen3.default_ops(geom)
    logits, lps = [], []
    for seq in TOKENS:
        t = torch.tensor(seq)
        h = qwen3.layers(ops, geom, slots, qwen3.embed(ops, slots, t), torch.arange(len(t)))
        lg = qwen3.final_logits(ops, geom, slots, h)
        logits.append(lg)
        lps.append(qwen3.logprobs(ops, lg))
    return torch.stack(logits), torch.stack(lps), ops.invoked_contract().fingerprint


CASES = {"even-untied": (512, False), "odd-tied": (501, True)}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Both models at tp 2 in one pair of gloo processes: {case: (model dir, [rank results])}."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("vocab-parallel")
    models = {
        case: make_tiny(
            tmp / case, arch="qwen3", seed=0, hidden=64, layers=2, vocab=v, tie_embeddings=tied
        )
        for case, (v, tied) in CASES.items()
    }
    dirs = [str(m) for m in models.values()]
    mp.start_processes(
        _rank, args=(str(tmp / "store"), dirs, str(tmp / "out")), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp / f"out.{r}") for r in range(2)]
    return {case: (m, [r[i] for r in ranks]) for i, (case, m) in enumerate(models.items())}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_tp2_vocab_parallel_head_has_the_bytes_of_one_device(tp2, case):
    vocab = CASES[case][0]
    model, outs = tp2[case]
    ref_logits, ref_lp, ref_contract = _one_device(model)
    for rank, out in enumerate(outs):
        assert out["contract"] == ref_contract  # the same programs invoked at every site
        start, rows = vocab_shard(vocab, 2, rank)
        real = min(rows, vocab - start)
        assert out["logits"].shape[-1] == rows  # this rank's (padded) vocabulary shard
        assert same_bytes(out["logits"][..., :real], ref_logits[..., start : start + real])
        assert out["logprobs"].shape == ref_lp.shape
        assert same_bytes(out["logprobs"], ref_lp), rank


def test_control_one_ulp_in_one_ranks_head_rows_is_caught(tp2):
    """Rank 1's first lm_head row one bf16 ulp up: both ranks' whole rows move."""
    model, outs = tp2["even-untied"]
    _, ref_lp, _ = _one_device(model)
    for out in outs:
        assert same_bytes(out["logprobs"], ref_lp)
        assert not same_bytes(out["control"], ref_lp)


def test_vocab_shards_are_equal_padded_and_cover_the_vocabulary():
    assert vocab_shard(501, 2, 0) == (0, 251) and vocab_shard(501, 2, 1) == (251, 251)
    assert vocab_shard(512, 1, 0) == (0, 512)  # tp 1: the whole head, as before
    t = torch.arange(5 * 2).view(5, 2)
    assert vocab_rows(t, 2, 1).tolist() == [[6, 7], [8, 9], [0, 0]]
