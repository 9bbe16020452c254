"""Layout invariance on GPUs: tensor- and expert-parallel ranks (real processes, one GPU each,
NCCL, the cuda programs) give the bytes of the one-device cuda forward.

The cuda twin of test_layout.py. Run on a machine with two or more CUDA devices with
``pytest -m gpu``; skipped elsewhere (the repository conftest skips every gpu test without a
CUDA device; this module also needs a second one). cuda bytes are compared with cuda bytes
only, each check with a negative control: one ulp in one rank's shard is caught.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes.qwen3 import default_ops, forward_logprobs
from lockstep_exact.layout import Layout
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import reference_logprobs

GPUS = torch.cuda.device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, {GPUS} here"),
]

TOKENS = [5, 17, 200, 3, 999, 42, 7, 7, 610, 12, 88, 300, 1, 2, 450, 9, 77, 31]

needs_4 = pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA devices for tp 2 x ep 2, {GPUS} here")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout_gpu")
    return {
        "qwen3": make_tiny(root / "dense", arch="qwen3", seed=0),
        "qwen3-moe": make_tiny(root / "moe", arch="qwen3-moe", seed=0),
    }


@pytest.fixture(scope="module")
def one_device(models):
    """The one-device cuda forward of each model (weights and tokens on cuda:0, the cuda
    programs), brought back to the cpu."""
    out = {}
    for arch, model in models.items():
        md = ModelDir(model)
        w = load_file(str(model / "model.safetensors"), device="cuda:0")
        lp = forward_logprobs(
            w,
            md.geometry,
            torch.tensor(TOKENS, device="cuda:0"),
            ops=default_ops(md.geometry, "cuda"),
        )
        out[arch] = lp.cpu()
    return out


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("qwen3", Layout(tp=2)),
        ("qwen3-moe", Layout(tp=2)),
        ("qwen3-moe", Layout(ep=2)),
        pytest.param("qwen3-moe", Layout(tp=2, ep=2), marks=needs_4),
    ],
    ids=["dense-tp2", "moe-tp2", "moe-ep2", "moe-tp2ep2"],
)
def test_every_rank_of_a_layout_has_the_bytes_of_one_gpu(models, one_device, arch, layout):
    ref = one_device[arch]
    outs = reference_logprobs(models[arch], layout, TOKENS, device="cuda")
    assert len(outs) == layout.world
    for rank, lp in enumerate(outs):
        assert same_bytes(lp, ref), (layout, rank)


@pytest.mark.parametrize(
    ("arch", "layout", "weight"),
    [
        ("qwen3", Layout(tp=2), "every:model.layers.0.self_attn.o_proj.weight"),
        (
            "qwen3-moe",
            Layout(tp=2),
            [f"every:model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(8)],
        ),
        (
            "qwen3-moe",
            Layout(ep=2),
            [f"every:model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)],
        ),
    ],
    ids=["dense-tp2-row-shard", "moe-tp2-expert-row-shard", "moe-ep2-experts-of-rank-0"],
)
def test_control_one_ulp_in_one_ranks_shard_is_caught(models, one_device, arch, layout, weight):
    """Rank 0's copy of the weights one ulp up at every element (the cpu test moves element 0
    only: its bytes are known to carry that through; the cuda bytes are not known here, and one
    element's ulp can vanish in a bf16 rounding), so the control cannot pass by luck. The
    tp cases move rank 0's K share of a row-parallel site (every expert's, whatever the
    routing); the ep case the experts rank 0 owns."""
    ref = one_device[arch]
    outs = reference_logprobs(models[arch], layout, TOKENS, nudge=(0, weight), device="cuda")
    assert len(outs) == layout.world
    assert not any(same_bytes(lp, ref) for lp in outs)
