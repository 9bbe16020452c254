"""tools/bench/bench_vllm_gpu.py refuses arguments it cannot run, naming the problem (no engine
starts and nothing is timed here)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def _bench():
    from tool_support import load_tool

    return load_tool("tools/bench/bench_vllm_gpu.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--device", "cpu", "--engines", "lane-eager,stock-graphs"],
            "--device cpu runs eager engines only: stock-graphs needs --device cuda",
        ),
        (
            ["--engines", "lane-eager,vllm"],
            "--engines: unknown engine 'vllm'; choose from lane-graphs, lane-eager, "
            "stock-graphs, stock-eager, bi-graphs, bi-eager",
        ),
        (
            ["--engines", "lane-eager,lane-eager"],
            "--engines: an engine is named twice in 'lane-eager,lane-eager'",
        ),
        (
            ["--concurrency", "1,x"],
            "--concurrency: 'x' is not a positive whole number (give e.g. 1,16,64,256)",
        ),
        (
            ["--concurrency", "0"],
            "--concurrency: '0' is not a positive whole number (give e.g. 1,16,64,256)",
        ),
        (["--concurrency", "4,4"], "--concurrency: a value is given twice in '4,4'"),
        (
            ["--prompt-len", "32", "--tokens", "1000"],
            "--prompt-len 32 + --tokens 1000 = 1032 exceeds --max-model-len 1024",
        ),
        (
            ["--tokens", "0"],
            "--prompt-len (32) and --tokens (0) must both be at least 1",
        ),
        (["--repeat", "0"], "--repeat: 0 timed calls; give 1 or more"),
    ],
)
def test_bench_vllm_gpu_refuses(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench().main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_vllm_gpu_cpu_defaults_are_eager():
    bench = _bench()
    eager = [n for n in bench.ENGINES if not n.endswith("-graphs")]
    assert bench.parse_engines(",".join(eager), "cpu") == ["lane-eager", "stock-eager", "bi-eager"]
    assert bench.parse_concurrency(bench.DEFAULT_CONCURRENCY["cuda"]) == [1, 16, 64, 256]


def test_a_bench_ended_from_outside_ends_its_engine_child_too():
    """An engine child has a session of its own (so a per-engine timeout can end all it
    started); ending the bench itself (``timeout``, Ctrl-C) must end that child as well, or it
    keeps the GPU busy under the next run's engines."""
    import signal
    import subprocess
    import sys

    bench = _bench()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    bench._CHILDREN.append(child)
    try:
        with pytest.raises(SystemExit) as ended:
            bench._end_children(signal.SIGTERM, None)
        assert ended.value.code == 128 + signal.SIGTERM
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()


def test_a_profiled_call_names_its_kernels_by_time_with_shares_of_the_busy_time():
    import torch

    bench = _bench()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    prof = bench.profile_call(lambda: [torch.mm(a, b) for _ in range(8)], "cpu", top=3)
    names = [k["kernel"] for k in prof["kernels"]]
    assert "aten::mm" in names
    assert len(names) <= 3 and prof["distinct"] >= len(names)
    assert [k["us"] for k in prof["kernels"]] == sorted(
        (k["us"] for k in prof["kernels"]), reverse=True
    )
    total = sum(k["us"] for k in prof["kernels"]) + prof["rest_us"]
    assert abs(total / 1e6 - prof["busy_s"]) < 1e-3
    assert prof["busy_s"] > 0 and prof["wall_s"] > 0
    mm = next(k for k in prof["kernels"] if k["kernel"] == "aten::mm")
    assert mm["calls"] == 8
    text = bench.profile_text("lane-eager", {"requests": 4, "tokens": 2, **prof})
    assert text.startswith("lane-eager at 4 requests x 2 tokens: wall")
    assert "| `aten::mm` | 8 |" in text


def test_the_gap_summary_finds_where_the_device_waited_between_kernels():
    """Overlapping kernels are one busy interval; each idle interval is named by the kernels
    around it and binned by length. Control: moving one kernel later by 2 ms shows up as a
    gap over 1 ms named by its neighbours."""
    bench = _bench()
    spans = [
        ("a", 0.0, 10.0),
        ("b", 5.0, 20.0),  # overlaps a: no gap
        ("c", 70.0, 80.0),  # 50 us after b
        ("d", 80.0, 90.0),  # back to back
        ("e", 590.0, 600.0),  # 500 us after d
        ("tiny", 595.0, 596.0),  # inside e: the busy interval still ends with e
        ("f", 2600.0, 2610.0),  # 2 ms after e
    ]
    got = bench.gap_summary(list(reversed(spans)), top=2)
    assert got["span_us"] == 2610.0 and got["idle_us"] == 50.0 + 500.0 + 2000.0
    assert got["bins"] == {
        "under_100us": {"gaps": 1, "us": 50.0},
        "100us_to_1ms": {"gaps": 1, "us": 500.0},
        "over_1ms": {"gaps": 1, "us": 2000.0},
    }
    assert got["longest"] == [
        {"us": 2000.0, "after": "e", "before": "f"},
        {"us": 500.0, "after": "d", "before": "e"},
    ]
    moved = [(n, lo + 2000.0, hi + 2000.0) if n == "c" else (n, lo, hi) for n, lo, hi in spans]
    shifted = bench.gap_summary(moved, top=1)
    assert shifted["longest"][0]["after"] in ("b", "e") and shifted["bins"]["over_1ms"]["gaps"] >= 1
    assert bench.gap_summary([]) == {"span_us": 0.0, "idle_us": 0.0, "bins": {}, "longest": []}
    text = bench.profile_text(
        "lane-graphs",
        {"requests": 1, "tokens": 2, "wall_s": 0.01, "busy_s": 0.001, "busy_fraction": 0.1,
         "kernels": [], "rest_us": 0, "distinct": 0, "gaps": got},
    )  # fmt: skip
    assert "GPU idle 2.55 ms of 2.61 ms" in text and "2.00 ms after `e`, before `f`" in text


def test_bench_vllm_gpu_refuses_a_profile_longer_than_the_model():
    with pytest.raises(SystemExit) as exc:
        _bench().main(["--profile", "4", "--profile-tokens", "2000"])
    assert exc.value.code == 2


def row(name: str, *tok: float) -> dict:
    """An engine's result with these tokens/s at 1 and 16 requests (as many as given)."""
    return {
        "engine": name,
        "rows": [{"concurrency": c, "tok_s": t} for c, t in zip((1, 16), tok, strict=False)],
    }


def test_lane_rows_are_set_beside_stock_and_vllms_batch_invariant_mode():
    bench = _bench()
    results = {
        "lane-graphs": row("lane-graphs", 50.0, 800.0),
        "stock-graphs": row("stock-graphs", 100.0, 1000.0),
        "bi-graphs": row("bi-graphs", 25.0),
    }
    assert bench.ratios(results, [1, 16]) == {
        "lane-graphs / stock-graphs": {1: 0.5, 16: 0.8},
        "lane-graphs / bi-graphs": {1: 2.0},
    }


def test_a_lane_that_ran_in_one_mode_is_also_set_against_the_other_mode():
    """The hybrid lane runs eager only: it is compared with stock's graphs too; a lane that ran
    in both modes is compared mode with mode only."""
    bench = _bench()
    results = {
        "lane-eager": row("lane-eager", 50.0, 400.0),
        "stock-eager": row("stock-eager", 100.0, 800.0),
        "stock-graphs": row("stock-graphs", 200.0, 1000.0),
    }
    assert bench.ratios(results, [1, 16]) == {
        "lane-eager / stock-eager": {1: 0.5, 16: 0.5},
        "lane-eager / stock-graphs": {1: 0.25, 16: 0.4},
    }
    results["lane-graphs"] = row("lane-graphs", 100.0, 500.0)
    assert set(bench.ratios(results, [1, 16])) == {
        "lane-eager / stock-eager",
        "lane-graphs / stock-graphs",
    }


def test_the_qwen3_next_shape_is_qwen3_next_80bs_layer_mix():
    from lockstep_exact.app.tiny import tiny_config
    from lockstep_exact.lanes.config import check_next_config

    bench = _bench()
    cfg = tiny_config("qwen3-next", **bench.SHAPES["cuda"]["qwen3-next"])
    geom = check_next_config(cfg)
    assert geom["layer_types"] == ("linear_attention",) * 3 + ("full_attention",)
    assert (geom["linear_key_heads"], geom["linear_value_heads"]) == (16, 32)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["head_dim"]) == (512, 10, 256)


def test_stock_qwen3_next_on_cuda_runs_vllms_triton_gdn_prefill():
    """vLLM 0.26 picks FlashInfer's GDN prefill on sm_90, a package the staged wheels lack
    (the stock engine failed at its first prefill); only the hybrid on cuda is changed."""
    bench = _bench()
    assert bench.stock_extra_args("qwen3-next", "cuda") == {"gdn_prefill_backend": "triton"}
    assert bench.stock_extra_args("qwen3-moe", "cuda") == {}
    assert bench.stock_extra_args("qwen3-next", "cpu") == {}
    from tool_support import load_tool

    server = load_tool("tools/bench/bench_server_gpu.py")
    cmd = server.server_cmd("stock", Path("/m"), 1, 1024, 0.4, "qwen3-next")
    assert "--gdn-prefill-backend=triton" in cmd
    assert not any("gdn" in c for c in server.server_cmd("stock", Path("/m"), 1, 1024, 0.4))


def test_a_ratio_pairs_the_rounds_that_ran_back_to_back():
    """The host slowed in round 2 for both engines alike: the paired ratio stays 0.5, while
    the ratio of the two medians would mix rounds (lane's median is round 3's, stock's round
    1's)."""
    bench = _bench()
    lane = {"tok_s": 60.0, "runs_tok_s": [50.0, 30.0, 60.0]}
    stock = {"tok_s": 100.0, "runs_tok_s": [100.0, 60.0, 120.0]}
    assert bench.paired_ratio(lane, stock) == 0.5
    assert bench.paired_ratio({"tok_s": 60.0}, stock) == 0.6  # unpaired: the medians


def test_the_host_side_of_a_call_counts_each_threads_cpu_time():
    import hashlib
    import os
    import threading

    bench = _bench()
    before = bench._thread_ticks()
    assert os.getpid() in before  # the main thread's id is the process's
    done = threading.Event()

    def hash_away():  # sha256 of a large buffer runs without the GIL: a second busy thread
        data = b"x" * (1 << 22)
        while not done.is_set():
            hashlib.sha256(data).digest()

    t0 = time.perf_counter()
    worker = threading.Thread(target=hash_away)
    worker.start()
    while time.perf_counter() < t0 + 0.5:  # the main thread busy too
        pass
    after = bench._thread_ticks()  # while the worker lives (an ended thread's time is gone)
    wall = time.perf_counter() - t0
    done.set()
    worker.join()
    use = bench.cpu_use(before, after, wall)
    assert use["threads"] >= 2 and 0.3 < use["main"] <= 1.1
    assert use["process"] >= use["main"] + 0.1  # the worker's time counted beside it
    assert bench.probe_ms(1000) > 0
    row = {"concurrency": 4, "tok_s": 10.0, "runs": [
        {"tok_s": 10.0, "probe_ms": 12.5, "cpu": use},
    ]}  # fmt: skip
    text = bench.host_text({"lane-eager": {"rows": [row]}}, [4])
    assert "| lane-eager | 4 | 12.5 |" in text


def test_a_host_profile_names_the_python_functions_that_took_the_time():
    bench = _bench()

    def busy():
        return sum(i * i for i in range(200_000))

    prof = bench.host_profile(busy, top=5)
    assert prof["wall_s"] > 0 and len(prof["own"]) <= 5
    assert any("busy" in r["function"] for r in prof["inside"])
    text = bench.host_profile_text("lane-graphs", {"requests": 1, "tokens": 2, **prof})
    assert text.startswith("lane-graphs at 1 requests x 2 tokens under cProfile: wall")
