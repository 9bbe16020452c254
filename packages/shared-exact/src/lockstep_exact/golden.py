"""Golden inputs and cases: fixed inputs for every program, for the contract lock.

Inputs come from integer arithmetic (a 64-bit LCG hash of the element index), not from a
torch random generator, so they are the same bytes under every torch version and device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import programs as P
from .parity import bytes_sha256
from .programs import Program

# The contract's program parameters (programs.CATALOG), never restated here.
BK = Program.of("gemm.kblock").param("bk")
BLOCK = Program.of("attention.blocked").param("block")
CHUNK = Program.of("gdn.chunked").param("chunk")
EXPAND_BK = Program.of("lora.expand").param("bk")
KPARTS = Program.of("gemm.kpart").param("parts")
KPART_BK = Program.of("gemm.kpart").param("bk")
SEGMENT = Program.of("attention.blocked").param("segment")
SHRINK_BK = Program.of("lora.shrink").param("bk")

_MUL = 6364136223846793005
_INC = 1442695040888963407


def golden(
    shape: tuple[int, ...], seed: int, scale: float = 1.0, dtype=torch.bfloat16, device: str = "cpu"
) -> torch.Tensor:
    """Deterministic values, roughly N(0, scale^2): a sum of 4 hashed uniforms per element."""
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n * 4, dtype=torch.int64)
    h = idx * _MUL + (seed * 2654435761 + _INC)
    h = h ^ (h >> 29)
    h = h * _MUL
    u = ((h >> 40) & 0xFFFFFF).to(torch.float64) / float(1 << 24) - 0.5  # [-0.5, 0.5)
    x = u.view(n, 4).sum(-1) * (3.0**0.5)  # variance 1
    return (x * scale).view(*shape).to(dtype).to(device)


def _gdn_golden(d: str, part: int) -> torch.Tensor:
    """gdn.chunked over 150 tokens at chunk 64 (two full chunks and a partial one): the output
    (part 0) or the state at position 128 (part 1). Inputs are golden values shaped by exact
    elementwise operations: |k| near 1, g <= 0, beta in [0.3, 0.6)."""
    f32 = torch.float32
    q = golden((150, 1, 16), 50, 0.25, f32, d)
    k = golden((150, 1, 16), 51, 0.25, f32, d)
    v = golden((150, 2, 16), 52, device=d)
    g = -golden((150, 2), 53, 0.05, f32, d).abs()
    beta = golden((150, 2), 54, 0.1, f32, d).abs().clamp(max=0.29) + 0.3
    state = P.gdn_state(1, 2, 16, 16, device=d, chunk=CHUNK)
    out, state = P.gdn_chunked(q, k, v, g, beta, state, position=0, chunk=CHUNK)
    return out if part == 0 else state.s


def _hybrid_cases() -> dict[str, list[tuple[str, Callable[[str], torch.Tensor]]]]:
    """The programs of the hybrid lane (Qwen3-Next), on both backends (cuda: the cpu code on
    CUDA tensors, ``programs.cuda.hybrid``; rope.partial: the cuda rope's bytes)."""
    g = golden
    f32 = torch.float32

    def gating(d):  # (g, beta) of one call: the two outputs are two golden cases
        a, b = g((9, 4), 55, 3.0, device=d), g((9, 4), 56, 3.0, device=d)
        return P.gdn_gating(a, b, g((4,), 57, 1.0, f32, d), g((4,), 58, device=d))

    return {
        "gdn.chunked": [
            ("t150_hk1_hv2_d16_out", lambda d: _gdn_golden(d, 0)),
            ("t150_hk1_hv2_d16_state128", lambda d: _gdn_golden(d, 1)),
        ],
        "gdn.gating": [
            ("t9_hv4_g", lambda d: gating(d)[0]),
            ("t9_hv4_beta", lambda d: gating(d)[1]),
        ],
        "gdn.l2norm": [("t9_h3_d128", lambda d: P.l2norm(g((9, 3, 128), 59, 2.0, device=d)))],
        "conv1d.causal": [
            (
                "t9_d96_k4",
                lambda d: P.conv1d_causal(
                    g((9, 96), 60, device=d),
                    g((96, 4), 61, 0.5, device=d),
                    g((3, 96), 62, device=d),
                )[0],
            ),
        ],
        "rmsnorm.zero_centered": [
            (
                "t9_h96",
                lambda d: P.rmsnorm_zero_centered(
                    g((9, 96), 63, 3.0, device=d), g((96,), 64, 0.1, device=d), 1e-6
                ),
            ),
        ],
        "rmsnorm.gated": [
            (
                "t9_v64",
                lambda d: P.rmsnorm_gated(
                    g((9, 64), 65, device=d),
                    g((9, 64), 66, 2.0, device=d),
                    g((64,), 67, 0.1, device=d) + 1,
                    1e-6,
                ),
            ),
        ],
        "gate.sigmoid": [
            (
                "t9_f96",
                lambda d: P.sigmoid_gate(g((9, 96), 68, device=d), g((9, 96), 69, 3.0, device=d)),
            ),
        ],
        "moe.shared_gate": [
            (
                "t9_h96",
                lambda d: P.shared_expert_gate(
                    g((9, 96), 70, device=d), g((9, 96), 71, device=d), g((9, 1), 72, 2.0, device=d)
                ),
            ),
        ],
        "rope.partial": [
            (
                "t7_h3_d32_r8",
                lambda d: P.rope_partial(
                    g((7, 3, 32), 73, device=d),
                    torch.tensor([0, 1, 2, 31, 32, 1000, 4095], device=d),
                    1e6,
                    8,
                ),
            ),
        ],
    }


def _cases() -> dict[str, list[tuple[str, Callable[[str], torch.Tensor]]]]:
    g = golden
    pos = lambda t, dev: torch.arange(t, device=dev)  # noqa: E731
    return {
        "gemm.kblock": [
            (
                "m1_k128_n96",
                lambda d: P.gemm(g((1, 128), 1, device=d), g((96, 128), 2, device=d), bk=BK),
            ),
            (
                "m67_k100_n33",
                lambda d: P.gemm(g((67, 100), 3, device=d), g((33, 100), 4, device=d), bk=BK),
            ),
            (
                "m5_k96_n1000_fp32",
                lambda d: P.gemm(
                    g((5, 96), 5, device=d),
                    g((1000, 96), 6, device=d),
                    out_dtype=torch.float32,
                    bk=BK,
                ),
            ),
        ],
        "gemm.kpart": [
            (
                "m3_k256_n40_p8",
                lambda d: P.gemm_kpart(
                    g((3, 256), 41, device=d), g((40, 256), 42, device=d), bk=KPART_BK, parts=KPARTS
                ),
            ),
            (
                "m7_k100_n24_p4_fp32",
                lambda d: P.gemm_kpart(
                    g((7, 100), 43, device=d),
                    g((24, 100), 44, device=d),
                    parts=4,
                    out_dtype=torch.float32,
                    bk=KPART_BK,
                ),
            ),
        ],
        "rmsnorm.qwen3": [
            (
                "t9_h96",
                lambda d: P.rmsnorm(
                    g((9, 96), 7, 3.0, device=d), g((96,), 8, 0.1, device=d) + 1, 1e-6
                ),
            ),
        ],
        "residual.add": [
            ("t9_h96", lambda d: P.residual_add(g((9, 96), 9, device=d), g((9, 96), 10, device=d)))
        ],
        "swiglu": [
            (
                "t9_f288",
                lambda d: P.swiglu(g((9, 288), 11, 4.0, device=d), g((9, 288), 12, device=d)),
            )
        ],
        "rope.neox": [
            (
                "t7_h3_d32",
                lambda d: P.rope(
                    g((7, 3, 32), 13, device=d),
                    torch.tensor([0, 1, 2, 31, 32, 1000, 4095], device=d),
                    1e6,
                ),
            ),
        ],
        "attention.blocked": [
            (
                "t45_hq3_hkv1_d32",
                lambda d: P.attention(
                    g((45, 3, 32), 14, device=d),
                    g((45, 1, 32), 15, device=d),
                    g((45, 1, 32), 16, device=d),
                    pos(45, d),
                    block=BLOCK,
                    segment=SEGMENT,
                ),
            ),
            (  # crosses the 512-key segment: the merge of two segments
                "t600_hq2_hkv1_d32",
                lambda d: P.attention(
                    g((600, 2, 32), 34, device=d),
                    g((600, 1, 32), 35, device=d),
                    g((600, 1, 32), 36, device=d),
                    pos(600, d),
                    block=BLOCK,
                    segment=SEGMENT,
                ),
            ),
        ],
        "softmax.tree": [
            ("t3_v1000", lambda d: P.softmax(g((3, 1000), 17, 4.0, torch.float32, d)))
        ],
        "log_softmax.tree": [
            ("t3_v1000", lambda d: P.log_softmax(g((3, 1000), 18, 4.0, torch.float32, d)))
        ],
        "router.softmax_topk": [
            ("t11_e8_k2", lambda d: P.router_topk(g((11, 8), 19, 2.0, device=d), 2)[1]),
        ],
        "moe.fold": [
            (
                "t5_k3_h96",
                lambda d: P.moe_fold(g((5, 3, 96), 20, device=d), g((5, 3), 21, device=d)),
            )
        ],
        "lora.shrink": [
            (
                "t5_k96_r8",
                lambda d: P.lora_shrink(
                    g((5, 96), 22, device=d), g((8, 96), 23, 0.1, device=d), bk=SHRINK_BK
                ),
            )
        ],
        "lora.expand": [
            (
                "t5_r8_n64",
                lambda d: P.lora_expand(
                    g((5, 64), 24, device=d),
                    g((5, 8), 25, device=d),
                    g((64, 8), 26, 0.1, device=d),
                    2.0,
                    bk=EXPAND_BK,
                ),
            ),
        ],
        "sample.gumbel_topp": [
            (
                "t64_v1000_mixed",
                lambda d: P.sample(
                    P.log_softmax(g((64, 1000), 28, 3.0, torch.float32, d)),
                    temperature=[0.0, 1.0, 0.7, 1.3] * 16,
                    top_p=[1.0, 1.0, 0.9, 0.5, 0.01, 1.0, 0.95, 1.0] * 8,
                    seeds=[i * 7919 - 3 for i in range(63)] + [2**40 + 3],
                    positions=[i * 131 for i in range(63)] + [2**32 - 1],
                ),
            ),
        ],
        "embedding.gather": [
            ("v50_h16", lambda d: g((50, 16), 27, device=d)[torch.tensor([3, 49, 0, 3], device=d)]),
        ],
        **_hybrid_cases(),
    }


CASES = _cases()


def case_hashes(device: str = "cpu") -> dict[str, dict[str, str]]:
    """{program: {case: sha256 of the output's raw bytes}} for every golden case of every
    program this backend implements."""
    out = {}
    for name, cases in CASES.items():
        try:
            out[name] = {case: bytes_sha256(fn(device).cpu()) for case, fn in cases}
        except P.BackendUnavailable:
            continue  # not implemented on this backend yet: no hashes to lock there
    return out
