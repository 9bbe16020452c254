"""Tensor-parallel benchmark: all-gather plus a fixed fold against an engine's all-reduce.

A row-parallel linear (o_proj, down_proj) under tensor parallelism holds a share of K on each
rank. An engine multiplies its share in bf16 and sums the ranks' bf16 outputs with the
backend's all-reduce, whose order is the backend's. The exact lane runs gemm.kpart instead:
each rank folds its own canonical K partitions to an fp32 partial, all-gathers the partials in
rank order and folds them over the top of the same tree, then rounds once to bf16
(``programs.gemm_kpart`` with a ``layout.DistGather``). Per site and token count this bench
times, in ``tp`` spawned ranks (gloo on cpu; NCCL with ``--device cuda``, one GPU per rank):

- layer: engine (torch bf16 matmul + bf16 all-reduce) against ours (gemm.kpart over the ranks);
- comm: the collective alone, bf16 all-reduce of [T, N] against fp32 all-gather + fold_tree +
  round_bf16;
- kernel: the local part alone, torch bf16 matmul against ``kpart_partial``.

Every ratio is ours / engine (the cost; 1.0 is as fast), all measured in one run. A time is
the median over reps of the slowest rank's time per call: before each rep the device is
synchronized and the ranks meet at a barrier; each rep runs enough calls back to back to last
a minimum time (the same count on every rank, since the collectives must match); the variants
of one row are timed in turn within each rep. Timing only: bytes are checked by
packages/shared-exact/tests/test_layout.py and test_layout_gpu.py.

    .venv/bin/python tools/bench/bench_layout.py --quick                 # cpu, small shapes
    PYTHONPATH=packages/shared-exact/src python3 tools/bench/bench_layout.py --device cuda \
        --json layout.json                                               # one GPU per rank
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
F32 = torch.float32

# Qwen3-8B-like: hidden 4096, intermediate 12288, 32 query heads of 128.
FULL = {"hidden": 4096, "intermediate": 12288, "heads": 32, "head_dim": 128}
FULL_TOKENS = (1, 16, 256, 2048)
# --quick: shapes small enough for the cpu programs on a 2-core machine.
QUICK = {"hidden": 512, "intermediate": 1536, "heads": 4, "head_dim": 128}
QUICK_TOKENS = (1, 16, 64)


def sites(shape: dict) -> list[tuple[str, int, int]]:
    """(name, K, N) of a layer's row-parallel sites."""
    return [
        ("o_proj", shape["heads"] * shape["head_dim"], shape["hidden"]),
        ("down_proj", shape["intermediate"], shape["hidden"]),
    ]


def _slowest(seconds: float, host) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host)
    return float(t.item())


def _timed(fn, calls: int, sync, host) -> float:
    """Seconds per call of ``fn`` on the slowest rank, the ranks started together."""
    import torch.distributed as dist

    sync()
    dist.barrier(group=host)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return _slowest((time.perf_counter() - t0) / calls, host)


def measure(fns: dict, cfg: dict, sync, host) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, timed in turn within each rep."""
    for fn in fns.values():
        for _ in range(cfg["warmup"]):
            fn()
    calls = {}
    for name, fn in fns.items():
        once = _timed(fn, 1, sync, host)  # the same on every rank: the slowest rank's
        calls[name] = max(1, min(10_000, math.ceil(cfg["min_rep_s"] / max(once, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(cfg["reps"]):
        for name, fn in fns.items():
            samples[name].append(_timed(fn, calls[name], sync, host))
    return {name: statistics.median(v) for name, v in samples.items()}


def _rank_main(rank: int, cfg: dict, port: int, out: str) -> None:
    """One rank: for every site and token count, the three pairs of timings."""
    import torch.distributed as dist

    from lockstep_exact import programs as P
    from lockstep_exact.lanes.qwen3 import k_parts
    from lockstep_exact.layout import DistGather

    tp, device = cfg["tp"], cfg["device"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg["threads"])
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        sync = torch.cuda.synchronize
    else:
        dev = torch.device("cpu")

        def sync():
            return None

    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=tp)
    try:
        # barriers and the slowest-rank exchange go over the host (gloo), never the timed stream
        host = dist.new_group(backend="gloo") if device == "cuda" else None
        gather = DistGather(None, tp)
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)

        def rand(*shape, scale=1.0, dtype=BF16):
            return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

        rows = []
        for site, k_dim, n_dim in cfg["sites"]:
            parts = k_parts(k_dim)  # the contract's partition count of this site
            share = k_dim // tp
            w = rand(n_dim, share, scale=0.02)
            for t in cfg["tokens"]:
                x = rand(t, share)
                y = torch.zeros(t, n_dim, dtype=BF16, device=dev)  # all-reduced in place
                partial = rand(t, n_dim, dtype=F32)

                def engine(x=x, w=w):
                    out = F.linear(x, w)
                    dist.all_reduce(out)
                    return out

                def ours(x=x, w=w, parts=parts):
                    return P.gemm_kpart(x, w, bk=cfg["bk"], parts=parts, gather=gather)

                def all_reduce(y=y):
                    dist.all_reduce(y)

                def gather_fold(partial=partial):
                    return P.round_bf16(P.fold_tree(gather.all(partial)))

                def matmul(x=x, w=w):
                    return F.linear(x, w)

                def kpart(x=x, w=w, parts=parts):
                    return P.kpart_partial(x, w, bk=cfg["bk"], parts=parts // tp)

                s = measure(
                    {
                        "engine": engine,
                        "ours": ours,
                        "all_reduce": all_reduce,
                        "gather_fold": gather_fold,
                        "matmul": matmul,
                        "kpart": kpart,
                    },
                    cfg,
                    sync,
                    host,
                )
                us = {k: round(v * 1e6, 2) for k, v in s.items()}
                row = {
                    "site": site,
                    "K": k_dim,
                    "N": n_dim,
                    "T": t,
                    "tp": tp,
                    "parts": parts,
                    "engine_us": us["engine"],
                    "ours_us": us["ours"],
                    "layer_ratio": round(s["ours"] / s["engine"], 3),
                    "all_reduce_us": us["all_reduce"],
                    "gather_fold_us": us["gather_fold"],
                    "comm_ratio": round(s["gather_fold"] / s["all_reduce"], 3),
                    "matmul_us": us["matmul"],
                    "kpart_us": us["kpart"],
                    "kernel_ratio": round(s["kpart"] / s["matmul"], 3),
                    "all_reduce_bytes": t * n_dim * 2,
                    "gather_bytes": t * n_dim * 4 * tp,
                }
                rows.append(row)
                if rank == 0:
                    print(
                        f"tp={tp} {site:<9} K={k_dim:<6} T={t:<5} layer {row['layer_ratio']:7.3f}x"
                        f"  comm {row['comm_ratio']:7.3f}x  kernel {row['kernel_ratio']:7.3f}x",
                        flush=True,
                    )
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(rows, fh)
    finally:
        dist.destroy_process_group()


def run_tp(cfg: dict) -> list[dict]:
    """Spawn ``cfg['tp']`` ranks and return rank 0's rows."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            _rank_main, args=(cfg, port, out), nprocs=cfg["tp"], start_method="spawn"
        )
        with open(out) as fh:
            return json.load(fh)


def check_shape(shape: dict, tps: list[int]) -> None:
    """Refuse a tensor-parallel size the lane would refuse for these shapes."""
    from lockstep_exact.lanes.qwen3 import k_parts

    for tp in tps:
        if tp < 2:
            raise SystemExit(f"bench_layout: tp must be >= 2 (a collective to time), got {tp}")
        for name, k_dim, _ in sites(shape):
            if k_parts(k_dim) % tp:
                raise SystemExit(
                    f"bench_layout: tp {tp} does not divide the {k_parts(k_dim)} K partitions "
                    f"of {name} (K = {k_dim})"
                )


def machine(device: str) -> str:
    if device == "cuda":
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}" if n else "no cuda device"
    return f"{os.cpu_count()} cpu cores, {platform.processor() or platform.machine()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, fewer and shorter reps")
    ap.add_argument("--tp", type=int, nargs="*", help="tensor-parallel sizes (default 2 and 4 "
                    "where the machine has the ranks)")  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts T")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--bk", type=int, default=32, help="gemm.kpart's block (the contract's: 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (cpu)")
    ap.add_argument("--json", default="", help="write the table here")
    args = ap.parse_args()

    shape = dict(QUICK if args.quick else FULL)
    for key in shape:
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else FULL_TOKENS))
    ranks = torch.cuda.device_count() if args.device == "cuda" else (os.cpu_count() or 1)
    tps = args.tp or [t for t in (2, 4) if t <= ranks]
    if not tps or max(tps) > ranks:
        raise SystemExit(
            f"bench_layout: {ranks} {'GPUs' if args.device == 'cuda' else 'cpu cores'} here, "
            f"tp {args.tp or 2} needs one per rank"
        )
    check_shape(shape, tps)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared hosts
    timing = (
        {"reps": 3, "warmup": 1, "min_rep_s": 0.01}
        if args.quick
        else {"reps": 9, "warmup": 3, "min_rep_s": 0.05}
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    env = {
        "torch": torch.__version__,
        "machine": machine(args.device),
        "device": args.device,
        "threads_per_rank": args.threads,
    }
    print(f"{stamp} {env} shape {shape} T {tokens} tp {tps} {timing}", flush=True)
    rows: list[dict] = []
    for tp in tps:
        cfg = {
            "tp": tp,
            "device": args.device,
            "threads": args.threads,
            "bk": args.bk,
            "tokens": tokens,
            "sites": sites(shape),
            **timing,
        }
        rows.extend(run_tp(cfg))

    print(
        "\n| tp | site | K | T | engine (us) | ours (us) | layer | all-reduce bf16 (us) "
        "| all-gather fp32 + fold (us) | comm | matmul (us) | kpart (us) | kernel |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tp']} | {r['site']} | {r['K']} | {r['T']} | {r['engine_us']} "
            f"| {r['ours_us']} | {r['layer_ratio']}x | {r['all_reduce_us']} "
            f"| {r['gather_fold_us']} | {r['comm_ratio']}x | {r['matmul_us']} "
            f"| {r['kpart_us']} | {r['kernel_ratio']}x |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"date": stamp, "env": env, "shape": shape, "timing": timing, "rows": rows},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
