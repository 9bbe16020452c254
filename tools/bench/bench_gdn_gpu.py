"""gdn.chunked on cuda against a plain torch chunked gated delta rule, at Qwen3-Next's GDN shape.

    PYTHONPATH=packages/shared-exact/src python3 tools/bench/bench_gdn_gpu.py [--reps 5]
        [--json FILE]
    PYTHONPATH=packages/shared-exact/src python3 tools/bench/bench_gdn_gpu.py --device cpu
        # smoke mode: small shapes, the cpu backend, seconds

One GDN layer of Qwen3-Next-80B-A3B (Hk = 16 key heads, Hv = 32 value heads, K = V = 128,
chunk 64), one sequence: a prefill of T = 512 and T = 2048 tokens from position 0, and one
decode step at position 1000 (the state of the first 1000 tokens made beforehand, untimed).
``exact`` is the lane's program, ``P.gdn_chunked`` (on cuda: the cpu program's device-generic
code on CUDA tensors, ``programs/cuda/hybrid.py``). ``torch`` is the stock speed reference
written here (``reference_prefill`` / ``reference_decode``): the chunked form engines use for
prefill (per chunk of 64: cumsum of g, the decay matrix, the UT triangular solve by
``torch.linalg.solve_triangular``, outputs and state update by matmuls, fp32, chunks from the
call's first token) and the recurrent form for decode (one token from the running state).
Both get the same inputs (q, k l2-normalized fp32, v bf16, g <= 0, beta in (0, 1)).

Each time is the median of ``--reps`` timed calls after a warm-up call (CUDA synchronized
around each call; ``time.perf_counter``); the two sides are timed interleaved, and ratio is
torch / exact measured in this run (above 1: exact faster). ``rel_err`` is the reference's
relative distance to the exact output (a check that the reference computes the same rule: a
few 1e-3, the bf16 rounding of the output). Timing only: bytes are checked by
packages/shared-exact/tests/test_hybrid_gpu.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from lockstep_exact import programs as P
from lockstep_exact.programs import Program

F32, BF16 = torch.float32, torch.bfloat16
CHUNK = Program.of("gdn.chunked").param("chunk")  # the contract's value (programs.CATALOG)
# (name, Hk, Hv, K, V, prefill lengths, decode position) per mode.
SHAPES = {
    "cuda": ("qwen3-next-80b GDN layer", 16, 32, 128, 128, (512, 2048), 1000),
    "cpu": ("smoke", 2, 4, 32, 32, (64, 200), 100),
}


# --- the stock reference --------------------------------------------------------------------
def _heads(q, k, h_v):
    """[T, Hk, K] -> [Hv, T, K]: each value head's key head (HF's repeat_interleave)."""
    r = h_v // q.shape[1]
    return (
        q.repeat_interleave(r, dim=1).transpose(0, 1),
        k.repeat_interleave(r, dim=1).transpose(0, 1),
    )


def reference_prefill(q, k, v, g, beta, s0, chunk: int = CHUNK):
    """The chunked gated delta rule as stock engines run a prefill, fp32, matmuls and a
    triangular solve: (out [T, Hv, V] fp32, state [Hv, K, V])."""
    t, h_v = g.shape
    qh, kh = _heads(q * (q.shape[-1] ** -0.5), k, h_v)  # [H, T, K]
    vh = v.to(F32).transpose(0, 1)  # [H, T, V]
    gh, bh = g.transpose(0, 1), beta.transpose(0, 1)  # [H, T]
    s = s0
    outs = []
    eye = torch.eye(chunk, device=q.device, dtype=F32)
    for c0 in range(0, t, chunk):
        sl = slice(c0, min(c0 + chunk, t))
        m = sl.stop - sl.start
        qc, kc, vc, bc = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl]
        gc = gh[:, sl].cumsum(-1)  # [H, m]
        gam = gc.exp()
        decay = (gc[:, :, None] - gc[:, None, :]).tril().exp().tril()  # [H, m, m], j <= i
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        r = bc[:, :, None] * (vc - gam[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(
            eye[:m, :m] + a, r, upper=False, unitriangular=True
        )  # (I + A) u = r
        o = gam[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u
        outs.append(o)
        if m == chunk:
            last = decay[:, -1, :, None] * kc  # [H, C, K]
            s = gam[:, -1, None, None] * s + last.transpose(1, 2) @ u
    return torch.cat(outs, dim=1).transpose(0, 1), s


def reference_decode(q, k, v, g, beta, s):
    """One token of the recurrent form (stock decode): (out [1, Hv, V], state')."""
    h_v = g.shape[1]
    qh, kh = _heads(q * (q.shape[-1] ** -0.5), k, h_v)  # [H, 1, K]
    s = s * g[0].exp()[:, None, None]
    kv = (kh @ s)[:, 0]  # [H, V]
    delta = (v[0].to(F32) - kv) * beta[0][:, None]
    s = s + kh[:, 0, :, None] * delta[:, None, :]
    return (qh @ s).transpose(0, 1), s


# --- inputs and timing ------------------------------------------------------------------------
def inputs(t, h_k, h_v, d_k, d_v, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = P.l2norm(rnd(t, h_k, d_k).to(BF16))
    k = P.l2norm(rnd(t, h_k, d_k).to(BF16))
    v = rnd(t, h_v, d_v).to(BF16)
    a_log = (torch.rand(h_v, generator=gen) * 0.5 + 0.01).log().to(device)
    g, beta = P.gdn_gating(rnd(t, h_v).to(BF16), rnd(t, h_v).to(BF16), a_log, rnd(h_v).to(BF16))
    return q, k, v, g, beta


def timed(fn, device) -> float:
    """Seconds of one call, the device synchronized before and after."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def compare(exact, ref, reps, device) -> tuple[float, float]:
    """Median ms of each side, timed interleaved after one warm-up call each."""
    exact()
    ref()
    te, tr = [], []
    for _ in range(reps):
        te.append(timed(exact, device))
        tr.append(timed(ref, device))
    return statistics.median(te) * 1e3, statistics.median(tr) * 1e3


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gdn_gpu: no CUDA device (use --device cpu for the smoke mode)")
    name, h_k, h_v, d_k, d_v, lengths, at = SHAPES[dev]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    host = platform.processor() or platform.machine()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else host,
        "threads": torch.get_num_threads(),
    }
    print(f"{stamp} {name}: Hk={h_k} Hv={h_v} K={d_k} V={d_v} chunk={CHUNK} {env}", flush=True)
    rows = []
    s0 = torch.zeros(h_v, d_k, d_v, dtype=F32, device=dev)
    for t in lengths:
        q, k, v, g, beta = inputs(t, h_k, h_v, d_k, d_v, dev, seed=t)
        state = P.gdn_state(h_k, h_v, d_k, d_v, chunk=CHUNK, device=dev)

        def exact(q=q, k=k, v=v, g=g, beta=beta, state=state):
            return P.gdn_chunked(q, k, v, g, beta, state, position=0, chunk=CHUNK)[0]

        def ref(q=q, k=k, v=v, g=g, beta=beta):
            return reference_prefill(q, k, v, g, beta, s0)[0]

        te, tr = compare(exact, ref, args.reps, dev)
        rows.append(("prefill", f"T={t}", te, tr, rel_err(exact().float(), ref())))
        print(f"prefill T={t}: exact {te:.2f} ms, torch {tr:.2f} ms", flush=True)
    # A decode step at position ``at``: the states of the first ``at`` tokens made untimed.
    q, k, v, g, beta = inputs(at + 1, h_k, h_v, d_k, d_v, dev, seed=7)
    state = P.gdn_state(h_k, h_v, d_k, d_v, chunk=CHUNK, device=dev)
    _, state = P.gdn_chunked(
        q[:at], k[:at], v[:at], g[:at], beta[:at], state, position=0, chunk=CHUNK
    )
    _, s_ref = reference_prefill(q[:at], k[:at], v[:at], g[:at], beta[:at], s0)
    # the stock running state at ``at`` (its last partial chunk folded in token by token)
    for i in range(at - at % CHUNK, at):
        sl = slice(i, i + 1)
        _, s_ref = reference_decode(q[sl], k[sl], v[sl], g[sl], beta[sl], s_ref)
    last = slice(at, at + 1)

    def exact_step():
        return P.gdn_chunked(
            q[last], k[last], v[last], g[last], beta[last], state, position=at, chunk=CHUNK
        )[0]

    def ref_step():
        return reference_decode(q[last], k[last], v[last], g[last], beta[last], s_ref)[0]

    te, tr = compare(exact_step, ref_step, args.reps, dev)
    rows.append(("decode", f"1 token at {at}", te, tr, rel_err(exact_step().float(), ref_step())))
    print(f"decode at {at}: exact {te:.3f} ms, torch {tr:.3f} ms", flush=True)

    print("\n| op | shape | exact (ms) | torch (ms) | torch / exact | rel_err |")
    print("| --- | --- | --- | --- | --- | --- |")
    for op, shape, te, tr, err in rows:
        print(f"| {op} | {shape} | {te:.3f} | {tr:.3f} | {tr / te:.3f}x | {err:.1e} |")
    if args.json:
        table = [
            {"op": op, "shape": shape, "exact_ms": round(te, 4), "torch_ms": round(tr, 4),
             "ratio_torch_over_exact": round(tr / te, 4), "rel_err": err}
            for op, shape, te, tr, err in rows
        ]  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump(
                {"date": stamp, "mode": dev, "shape": name, "env": env, "rows": table}, fh, indent=1
            )


if __name__ == "__main__":
    main()
