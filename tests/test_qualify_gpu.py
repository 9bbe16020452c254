"""``lockstep qualify --backend cuda``: the whole ladder on the GPU (issue 11, item 3).

Run on the GPU machine with ``pytest -m gpu tests/test_qualify_gpu.py`` (skipped elsewhere by
the repository conftest, and where vLLM 0.26.0 is not the installed vLLM). For a tiny dense
model and a tiny MoE (``lockstep tiny``'s default shapes) the five gates run with vLLM 0.26 on
cuda as the sampler and megatron-core on one GPU as the trainer (replays and the LoRA training
step); the report must pass, name the cuda lane, the device and every engine's version. The
ladder's own controls (the sampler or the trainer on adapter A moved by 2^-9) must differ, and
a trainer whose final-norm weight is one ulp off must not reproduce the promotion trace.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

# The lane's sampler lives on vLLM's V1 model runner (vllm/model.py refuses V2, naming this).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

GATES = ["base ruler", "adapter A join", "training gate", "adapter B join", "promotion"]


def _vllm_026():
    vllm = pytest.importorskip("vllm")
    if vllm.__version__ != "0.26.0":
        pytest.skip(f"vLLM {vllm.__version__} here; the cuda lane is served by vLLM 0.26.0")
    return vllm


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_the_whole_ladder_qualifies_on_cuda(arch, tmp_path, capfd):
    _ladder_on_cuda(arch, tmp_path, capfd)


def test_the_hybrid_ladder_qualifies_on_cuda(tmp_path, capfd):
    """``lockstep qualify --tiny qwen3-next --backend cuda``: vLLM 0.26 serves the hybrid lane
    on cuda, Megatron replays and trains it there, every gate exact."""
    _ladder_on_cuda("qwen3-next", tmp_path, capfd)


def _ladder_on_cuda(arch, tmp_path, capfd):
    _vllm_026()
    import megatron.core

    from lockstep_exact.app.cli import main

    out = tmp_path / "q"
    argv = ["qualify", "--tiny", arch, "--backend", "cuda", "--out", str(out)]
    rc = main(argv)
    printed = capfd.readouterr().out
    report = json.loads((out / "report.json").read_text())
    failed = [(g["name"], g["error"], g["bisect"]) for g in report["gates"] if not g["passed"]]
    assert rc == 0 and report["passed"], (failed, printed[-3000:])
    assert [g["name"] for g in report["gates"]] == GATES

    # the report names the backend, the cuda lane, the device and every engine's version
    assert report["backend"] == "cuda" and report["lane"].endswith("/cuda"), report["lane"]
    assert report["device"] == torch.cuda.get_device_name()
    engines = {e["engine"]: e for e in report["engines"]}
    assert engines["vllm"]["engine_version"] == "0.26.0"
    assert engines["megatron-core"]["engine_version"] == megatron.core.__version__
    for name in ("vllm", "megatron-core"):
        assert engines[name]["torch_version"] == torch.__version__
        assert "cuda" in engines[name]["backends"], engines[name]
    assert f"QUALIFIED: {report['lane']}" in printed
    assert f"backend: cuda on {report['device']}" in printed
    engines_line = next(ln for ln in printed.splitlines() if ln.startswith("engines: "))
    assert "sampler vllm 0.26.0" in engines_line, engines_line
    assert "trainer megatron-core" in engines_line, engines_line

    # every decision of the promotion byte-equal, K3 = 0
    promotion = report["gates"][-1]["checks"][0]
    assert promotion["decisions"] == promotion["byte_equal"] == 64
    assert promotion["k3"] == [0.0] * 64
    # the ladder's controls differ, and the trainer's step moved the adapter repeatably
    controls = [c for g in report["gates"] for c in g["checks"] if not c["expect_exact"]]
    assert len(controls) == 2 and all(c["byte_equal"] < c["decisions"] for c in controls)
    training = report["gates"][2]["checks"]
    assert all(c["passed"] for c in training), training

    # control: the promotion trace against a trainer with one weight moved by ulps (dense: the
    # final norm; hybrid: a Gated DeltaNet input projection, its norms scale by 1 + w)
    from lockstep_exact.k3 import compare
    from lockstep_exact.lanes import qwen3_next as N
    from lockstep_exact.testing import nudge_ulp
    from lockstep_exact.trace import Trace
    from lockstep_megatron import export
    from lockstep_megatron.convert import build
    from lockstep_megatron.replay import score

    model_dir = out / f"tiny-{arch}"
    trace = Trace.load(promotion["trace"])
    model = build(model_dir).eval()
    export.load_into(model, promotion["adapter"], model_dir, "cuda")
    model = model.cuda()
    assert compare(torch.as_tensor(trace.logprobs), score(model, trace)).exact
    if arch == "qwen3-next":
        i = model.geom.layer_types.index(N.LINEAR)
        w = model.gpt.decoder.layers[i].self_attention.in_proj.weight
    else:
        w = model.gpt.decoder.final_layernorm.weight
    with torch.no_grad():
        w.copy_(nudge_ulp(w, 3))
    assert not compare(torch.as_tensor(trace.logprobs), score(model, trace, control=True)).exact
