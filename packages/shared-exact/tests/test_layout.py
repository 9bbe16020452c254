"""Layout invariance of the lane composition: tensor- and expert-parallel ranks (real
processes over gloo) give the bytes of one device, and a layout that does not divide the
contract's partitions is refused naming both numbers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.contract import LayoutRefused, check_layout
from lockstep_exact.lanes.qwen3 import forward_logprobs, k_parts
from lockstep_exact.layout import Layout
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import Program
from lockstep_exact.testing import nudge_ulp, reference_logprobs

# The contract's program parameters (programs.CATALOG), never restated here.
BK = Program.of("gemm.kblock").param("bk")
KPART_BK = Program.of("gemm.kpart").param("bk")

pytestmark = pytest.mark.slow

TOKENS = [5, 17, 200, 3, 999, 42, 7, 7, 610, 12, 88, 300, 1, 2, 450, 9, 77, 31]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    return {
        "qwen3": make_tiny(root / "dense", arch="qwen3", seed=0),
        "qwen3-moe": make_tiny(root / "moe", arch="qwen3-moe", seed=0),
    }


def _one_device(model):
    md = ModelDir(model)
    w = load_file(str(model / "model.safetensors"))
    return forward_logprobs(w, md.geometry, torch.tensor(TOKENS))


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("qwen3", Layout(tp=2)),
        ("qwen3-moe", Layout(tp=2)),
        ("qwen3-moe", Layout(ep=2)),
        ("qwen3-moe", Layout(tp=2, ep=2)),
    ],
    ids=["dense-tp2", "moe-tp2", "moe-ep2", "moe-tp2ep2"],
)
def test_every_rank_of_a_layout_has_the_bytes_of_one_device(models, arch, layout):
    ref = _one_device(models[arch])
    outs = reference_logprobs(models[arch], layout, TOKENS)
    assert len(outs) == layout.world
    for rank, lp in enumerate(outs):
        assert same_bytes(lp, ref), (layout, rank)


@pytest.mark.parametrize(
    ("arch", "layout", "weight"),
    [
        ("qwen3", Layout(tp=2), "model.layers.0.self_attn.o_proj.weight"),
        (
            "qwen3-moe",
            Layout(ep=2),
            [f"every:model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)],
        ),
    ],
    ids=["dense-tp2-row-shard", "moe-ep2-experts-of-rank-0"],
)
def test_control_one_ulp_in_one_ranks_shard_is_caught(models, arch, layout, weight):
    ref = _one_device(models[arch])
    outs = reference_logprobs(models[arch], layout, TOKENS, nudge=(0, weight))
    assert not any(same_bytes(lp, ref) for lp in outs)


def test_the_partitions_fold_as_one_tree_whatever_the_rank_count():
    """gemm.kpart over 8 partitions: one device, 2 and 4 simulated ranks, same bytes; and
    not the bytes of gemm.kblock (the partitions are a new program, not a relabel)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 256, generator=g)).to(torch.bfloat16)
    w = (torch.randn(48, 256, generator=g) * 0.05).to(torch.bfloat16)
    one = P.gemm_kpart(
        x, w, parts=8, out_dtype=torch.float32, bk=KPART_BK
    )  # fp32: no rounding hides
    for ranks in (2, 4, 8):
        shards = [
            P.kpart_partial(xs, ws, parts=8 // ranks, bk=KPART_BK)
            for xs, ws in zip(x.chunk(ranks, -1), w.chunk(ranks, -1), strict=True)
        ]
        assert same_bytes(P.fold_tree(shards), one), ranks
        # input control: the last rank's shard of x, its largest element one ulp off
        xs = x.chunk(ranks, -1)[-1]
        moved = P.kpart_partial(
            nudge_ulp(xs, int(xs.float().argmax())), w.chunk(ranks, -1)[-1],
            parts=8 // ranks, bk=KPART_BK,
        )  # fmt: skip
        assert not same_bytes(P.fold_tree([*shards[:-1], moved]), one), ranks
    assert not same_bytes(P.gemm(x, w, out_dtype=torch.float32, bk=BK), one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kpart_hands_the_gemm_k_slices_with_the_bytes_of_their_copies(dtype):
    """gemm.kpart passes each partition to the gemm as a view of x and w (no copy): the
    bytes are the fold of gemms over the same partitions copied out; one ulp is caught."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 1024, generator=g).to(dtype)
    w = (torch.randn(96, 1024, generator=g) * 0.05).to(dtype)
    size = 1024 // 8
    copies = [
        P.gemm(
            x[..., p * size : (p + 1) * size].contiguous(),
            w[:, p * size : (p + 1) * size].contiguous(),
            out_dtype=torch.float32,
            bk=BK,
        )
        for p in range(8)
    ]
    want = P.fold_tree(copies)
    got = P.kpart_partial(x, w, parts=8, bk=KPART_BK)
    assert same_bytes(got, want)
    # input control: x's largest element one ulp off moves the kpart bytes
    moved = P.kpart_partial(nudge_ulp(x, int(x.float().argmax())), w, parts=8, bk=KPART_BK)
    assert not same_bytes(moved, want)


@pytest.mark.parametrize(("k", "parts"), [(128, 8), (96, 8), (100, 4), (36, 4), (99, 1)])
def test_a_sites_partition_count_is_the_largest_power_of_two_dividing_its_k(k, parts):
    assert k_parts(k) == parts


def test_a_layout_that_does_not_divide_the_partitions_is_refused(models, tmp_path):
    contract = ModelDir(models["qwen3-moe"]).contract()
    check_layout(contract, tp=2, ep=8)  # divides everything: admitted
    with pytest.raises(LayoutRefused, match="tp 3 does not divide the 8 K partitions of op site"):
        check_layout(contract, tp=3)
    with pytest.raises(LayoutRefused, match="ep 3 does not divide the model's 8 experts"):
        check_layout(contract, ep=3)
    odd = make_tiny(
        tmp_path / "odd", arch="qwen3", heads=6, kv_heads=2, head_dim=12, intermediate=100
    )
    c = ModelDir(odd).contract()
    assert c.sites["layers.*.mlp.down_proj"].param("parts") == 4
    assert c.sites["layers.*.self_attn.o_proj"].param("parts") == 8
    with pytest.raises(
        LayoutRefused,
        match="tp 8 does not divide the 4 K partitions of op site 'layers.\\*.mlp.down_proj'",
    ):
        check_layout(c, tp=8)
    with pytest.raises(LayoutRefused, match="ep 2 needs a MoE model"):
        check_layout(c, ep=2)


@pytest.mark.parametrize(
    ("m", "k", "parts", "bk"),
    [(1, 128, 8, 32), (17, 48, 4, 32), (3, 200, 8, 16), (5, 768, 2, 64), (2, 96, 8, 32)],
)
def test_the_cpu_kpart_in_one_call_gives_the_bytes_of_its_partitions_one_by_one(m, k, parts, bk):
    """The cpu backend's one-call gemm.kpart partial (the partitions as a batch dimension, a
    ragged last K block padded as the gemm pads it) against the definition run as it reads:
    each partition through the gemm, folded over the pair tree. Control: one x element of the
    last partition one bf16 ulp away (an input) moves the bytes."""
    from lockstep_exact.programs import cpu

    g = torch.Generator().manual_seed(m * k + parts)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(24, k, generator=g).to(torch.bfloat16)
    size = k // parts

    def one_by_one(x):
        sums = [
            cpu.gemm(
                x[:, p * size : (p + 1) * size],
                w[:, p * size : (p + 1) * size],
                bk=bk,
                out_dtype=torch.float32,
            )  # fmt: skip
            for p in range(parts)
        ]
        return P.fold_tree(sums)

    got = cpu.kpart_partial(x, w, bk=bk, parts=parts)
    assert same_bytes(got, one_by_one(x))
    moved = x.clone()
    moved[0, k - 1] = nudge_ulp(moved[0, k - 1 :], 0)[0]
    assert not same_bytes(cpu.kpart_partial(moved, w, bk=bk, parts=parts), got)
