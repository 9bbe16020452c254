"""Compile the hybrid lane's cuda kernels for the H200 (sm_90) without a GPU and read their PTX
(``test_interpret.py`` runs this in a Python that has Triton).

Triton compiles ahead of time for a named target: its front end, layouts, LLVM and ptxas all
run on the host. A kernel that does not compile, or whose PTX holds an instruction that would
round differently from the cpu program's operations, is caught here before any GPU run: a fused
multiply-add (``fma``: one rounding for ``*`` and ``+``), an fp32 ``*``, ``+`` or ``-`` without
an explicit rounding mode (``mul.f32``: ptxas may contract it; with contraction off Triton
writes ``mul.rn.f32``), flush-to-zero (``.ftz``: subnormals read or written as zero) or an
approximate instruction (``.approx``: division, square root, exp). The machine code's own FFMAs
are not counted: the IEEE division and square root are built from them. Register spills are
reported (a speed matter only).

Prints one JSON object: kernel case -> {"compiled": bool, "fma": n, "unrounded": n, "ftz": n,
"approx": n, "registers": n, "spill_bytes": n, "error": str | None}.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lockstep_exact.programs.cuda import (
    arith,
    elementwise,
    gdn,
    grouped,
    hybrid,
    moe,
    plan,
    sampling,
)

attention = importlib.import_module("lockstep_exact.programs.cuda.attention")

TARGET = GPUTarget("cuda", 90, 32)


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every argument: the given pointer (or float scalar: ``fp32``) types, the constexprs,
    the rest int32."""
    return {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32")
        for name in fn.arg_names
    }


def _ptxas(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) that the bundled ptxas reports for sm_90a."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    info = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", info)
    return (int(regs.group(1)) if regs else -1), sum(int(s) for s in spills)


def _case(fn, pointers, constexprs, num_warps=4, fusion=False, num_stages=None) -> dict:
    options = {"enable_fp_fusion": fusion, "num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    try:
        src = ASTSource(
            fn=fn, signature=_signature(fn, pointers, constexprs), constexprs=constexprs
        )
        kernel = triton.compile(src, target=TARGET, options=options)
    except Exception as err:  # noqa: BLE001 - reported, the test names it
        return {"compiled": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    ptx = kernel.asm["ptx"]
    regs, spill = _ptxas(ptx)
    return {
        "compiled": True,
        "fma": len(re.findall(r"\bfma\.", ptx)),
        # fp32 * + - without an explicit rounding mode: ptxas may contract those into an fma
        "unrounded": len(re.findall(r"\b(?:mul|add|sub)\.f32\b", ptx)),
        "ftz": ptx.count(".ftz"),
        "approx": ptx.count(".approx"),
        "ex2_approx": len(re.findall(r"\bex2\.approx\.", ptx)),
        "registers": regs,
        "spill_bytes": spill,
        "error": None,
    }


def main() -> dict:
    f32 = "*fp32"
    i16 = "*i16"
    out: dict = {}
    chunk_ptrs = {n: f32 for n in gdn._chunk_kernel.arg_names if n.endswith("_ptr")}
    chunk_ptrs.update(seq_ptr="*i32", o_ptr="*fp32", pv_ptr="*i16")
    paged_ptrs = {**chunk_ptrs, "v_ptr": "*i16", "o_ptr": "*i16"}
    for c, kp, paged in ((64, 128, False), (64, 128, True), (16, 16, True), (64, 32, False)):
        out[f"gdn chunk pass C={c} K={kp} paged={paged}"] = _case(
            gdn._chunk_kernel,
            paged_ptrs if paged else chunk_ptrs,
            {"C": c, "LOGC": c.bit_length() - 1, "KP": kp, "LOGK": kp.bit_length() - 1,
             "BV": gdn._BV, "PAGED": paged},
            num_warps=gdn._warps(c, kp),
        )  # fmt: skip
    out["gdn.gating"] = _case(
        hybrid._gating_kernel,
        {"a_ptr": i16, "b_ptr": i16, "alog_ptr": f32, "dtb_ptr": f32, "g_ptr": f32,
         "beta_ptr": f32},
        {"BLOCK": hybrid._BLOCK},
    )  # fmt: skip
    for width in (128, 32):
        per = max(1, min(16, 4096 // width))
        out[f"gdn.l2norm D={width}"] = _case(
            hybrid._l2norm_kernel,
            {"x_ptr": i16, "o_ptr": f32, "s_ptr": f32, "eps": "fp32"},
            {"ROWS": per, "W": width, "LOG": width.bit_length() - 1,
             "LEAF": hybrid._leaf(width)},
        )  # fmt: skip
    out["conv1d.causal kernel 4"] = _case(
        hybrid._conv1d_kernel,
        {"f_ptr": i16, "w_ptr": i16, "o_ptr": i16},
        {"BD": 128, "WP": 4, "LOG": 2},
    )
    out["conv1d.causal paged kernel 4"] = _case(
        hybrid._conv1d_paged_kernel,
        {"x_ptr": i16, "win_ptr": i16, "w_ptr": i16, "o_ptr": i16, "seq_ptr": "*i32"},
        {"BD": 128, "WP": 4, "LOG": 2},
    )  # fmt: skip
    for gated, width in ((False, 2048), (True, 128)):
        per = max(1, min(16, 4096 // width))
        out[f"rmsnorm gated={gated} H={width}"] = _case(
            hybrid._rms_kernel,
            {"x_ptr": i16, "z_ptr": i16, "w_ptr": i16, "o_ptr": i16, "s_ptr": f32,
             "h_f32": "fp32", "eps": "fp32"},
            {"GATED": gated, "ROWS": per, "W": width, "LOG": width.bit_length() - 1,
             "LEAF": hybrid._leaf(width)},
        )  # fmt: skip
    for shared in (False, True):
        out[f"gate shared={shared}"] = _case(
            hybrid._gate_kernel,
            {"x_ptr": i16, "g_ptr": i16, "s_ptr": i16, "o_ptr": i16},
            {"SHARED": shared, "BLOCK": hybrid._BLOCK},
        )
    for bf16, e, k in ((True, 128, 8), (False, 60, 4), (True, 512, 10)):
        ep, kp = 1 << (e - 1).bit_length(), 1 << (k - 1).bit_length()
        out[f"router.softmax_topk E={e} k={k} bf16={bf16}"] = _case(
            moe._router_kernel,
            {"x_ptr": i16 if bf16 else f32, "ids_ptr": "*i64", "w_ptr": i16, "s_ptr": f32},
            {"BF16_IN": bf16, "EP": ep, "LOGE": ep.bit_length() - 1, "KP": kp,
             "LOGK": kp.bit_length() - 1, "NORMALIZE": True},
            num_warps=moe.router_warps(ep),
        )  # fmt: skip
    for acc_bf16, k in ((True, 8), (False, 8), (True, 3)):
        kp = 1 << (k - 1).bit_length()
        out[f"moe.fold k={k} acc_bf16={acc_bf16}"] = _case(
            moe._fold_kernel,
            {"y_ptr": i16, "w_ptr": i16, "o_ptr": i16},
            {"KP": kp, "LOGK": kp.bit_length() - 1, "BH": moe._BLOCK_H, "ACC_BF16": acc_bf16},
        )
    out["expert plan counts E<=128"] = _case(
        plan._count_kernel, {"ids_ptr": "*i64", "hist_ptr": "*i32"}, {"EP": 128, "BP": 64}
    )
    for ep, bp in ((128, 64), (512, 32)):
        out[f"expert plan places E<={ep}"] = _case(
            plan._place_kernel,
            {"ids_ptr": "*i64", "hist_ptr": "*i32", "order_ptr": "*i64", "src_ptr": "*i64",
             "bounds_ptr": "*i64", "tiles_ptr": "*i32"},
            {"EP": ep, "BP": bp, "BH": plan._BH, "BT": plan._BT, "TILE": 64},
            num_warps=8,
        )  # fmt: skip
    out["sample.gumbel_topp one-kernel rounds=3"] = _case(
        sampling._sample_kernel,
        {"lp_ptr": f32, "temp_ptr": f32, "seed_ptr": "*i64", "pos_ptr": "*i64",
         "out_ptr": "*i64"},
        {"ROUNDS": 3, "BLOCK": sampling._BLOCK},
        num_warps=8,
    )  # fmt: skip
    out["residual.add one launch"] = _case(
        elementwise._residual_kernel,
        {"a_ptr": i16, "b_ptr": i16, "y_ptr": i16},
        {"BLOCK": elementwise._BLOCK},
    )
    out["round_bf16 one launch"] = _case(
        arith._round_kernel, {"x_ptr": f32, "y_ptr": i16}, {"BLOCK": arith.ROUND_BLOCK}
    )
    out["gemm.kpart fold of 8 stacked partials"] = _case(
        grouped._fold_kernel,
        {"s_ptr": f32, "y_ptr": f32},
        {"PARTS": 8, "BLOCK": grouped._FOLD_BLOCK},
    )
    # attention.blocked: the one-pass kernel and the many-sequence one, with the launch's
    # tiling (programs/cuda/attention.py: _TILE, _NUM_STAGES)
    block_m, warps = attention._TILE
    attn_ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
                 "pos_ptr": "*i64", "m_buf": f32, "l_buf": f32, "a_buf": f32, "qs_ptr": "*i64",
                 "ks_ptr": "*i64", "scale": "fp32"}  # fmt: skip
    for d, block, segment in ((128, 64, 512), (64, 32, 256)):
        shape = {"G": 4, "D": d, "BLOCK_M": block_m, "BLOCK_N": block,
                 "SEG_BLOCKS": segment // block, "SEG": segment}  # fmt: skip
        out[f"attention: one-pass D={d} block {block}"] = _case(
            attention._attn_kernel, attn_ptrs, {**shape, "SPLIT": False, "ONE_SEG": False},
            num_warps=warps, num_stages=attention._NUM_STAGES,
        )  # fmt: skip
        out[f"attention: varlen D={d} block {block}"] = _case(
            attention._varlen_kernel, attn_ptrs, shape, num_warps=warps,
            num_stages=attention._NUM_STAGES,
        )  # fmt: skip
    # The control: the same kernel with contraction on shows what the checks look for.
    out["control: rmsnorm gated=True H=128, contraction on"] = _case(
        hybrid._rms_kernel,
        {"x_ptr": i16, "z_ptr": i16, "w_ptr": i16, "o_ptr": i16, "s_ptr": f32,
         "h_f32": "fp32", "eps": "fp32"},
        {"GATED": True, "ROWS": 16, "W": 128, "LOG": 7, "LEAF": 5},
        fusion=True,
    )  # fmt: skip
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
