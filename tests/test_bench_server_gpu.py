"""tools/bench/bench_server_gpu.py's own steps, against a stand-in HTTP server (no engine, no
GPU): both servers start, take turns burst by burst, and lane / stock pairs the rounds. The
figures the bench reports come from real servers on the GPU machine (docs/cost.md)."""

from __future__ import annotations

import json
import sys

import pytest

# Answers /health, /v1/models and /v1/completions as vLLM's server does, the completion's
# tokens being the request's max_tokens.
STAND_IN = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self._send({} if self.path == "/health" else {"data": [{"id": "m"}]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send({"usage": {"completion_tokens": body["max_tokens"]}})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture()
def bench(monkeypatch, tmp_path):
    from tool_support import load_tool

    mod = load_tool("tools/bench/bench_server_gpu.py")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    seen = []

    def cmd(name, model, port, max_model_len, memory, arch):
        seen.append((name, memory))
        return [sys.executable, str(script), "--port", str(port)]

    monkeypatch.setattr(mod, "server_cmd", cmd)
    monkeypatch.setattr(mod, "model_for", lambda args: (tmp_path / "model", {"vocab": 1000}))
    mod.seen = seen
    return mod


@pytest.mark.parametrize("together", [False, True])
def test_the_servers_take_turns_and_the_ratio_pairs_the_rounds(bench, tmp_path, together):
    out = tmp_path / "server.json"
    argv = ["--burst", "4", "--tokens", "5", "--rounds", "3", "--json", str(out)]
    argv += ["--logs", str(tmp_path / "logs")] + (["--start-together"] if together else [])
    bench.main(argv)
    got = json.loads(out.read_text())
    assert [n for n, _ in bench.seen] == ["lane", "stock"]
    assert all(m == 0.4 for _, m in bench.seen)  # both up at once: 0.4 of the GPU each
    for name in ("lane", "stock"):
        bursts = got[name]["bursts"]
        assert len(bursts) == 3 and all(b["tokens"] == 4 * 5 for b in bursts)
        assert got[name]["tok_s"] == sorted(b["tok_s"] for b in bursts)[1]  # the median
    lane, stock = got["lane"]["bursts"], got["stock"]["bursts"]
    pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(lane, stock, strict=True)]
    assert got["lane_over_stock"] == round(sorted(pairs)[1], 3)


def test_the_paired_ratio_is_the_median_of_the_rounds(bench):
    lane = [{"tok_s": 50.0}, {"tok_s": 30.0}, {"tok_s": 60.0}]
    stock = [{"tok_s": 100.0}, {"tok_s": 60.0}, {"tok_s": 120.0}]
    assert bench.paired(lane, stock) == 0.5
    assert bench.paired(lane[:2], stock) is None  # rounds that do not pair up


def test_more_of_the_gpu_than_there_is_is_refused(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--gpu-memory-utilization", "0.6"])
    assert exc.value.code == 2
    assert "--gpu-memory-utilization: 2 servers at 0.6 each" in capsys.readouterr().err
