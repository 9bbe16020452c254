"""The kernels each op site ran: recorded, carried in the invoked contract, gated.

The cuda forms themselves are gated on the GPU (test_programs_gpu.py); what runs here is that
the record is made from the calls that really ran, that a site with no record or with a kernel
no test gates is refused, that every form the cuda backend can note is declared with a gate that
exists, and that the record stays outside the fingerprint.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact import programs as P
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.contract import ContractMismatch, contract_from_json
from lockstep_exact.lanes import qwen3, qwen3_next
from lockstep_exact.lanes.ops import AttentionSite, Ops, check_kernels
from lockstep_exact.programs import kernels as K

CUDA = Path(P.__file__).parent / "cuda"
GPU_TESTS = Path(__file__).parent / "test_programs_gpu.py"


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def ran(request, tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    geom = qwen3.Geometry.from_model_dir(d)
    ops = qwen3.default_ops(geom)
    qwen3.forward_logprobs(load_file(str(d / "model.safetensors")), geom, torch.arange(21), ops=ops)
    return ops


def test_every_site_that_ran_records_the_kernels_it_ran_and_they_are_gated(ran):
    invoked = ran.invoked_contract()
    assert set(invoked.kernels) == set(invoked.sites)
    assert invoked.kernels["embed_tokens"] == ("gather",)
    assert invoked.kernels["layers.*.self_attn.q_proj"] == ("cpu.gemm",)
    assert invoked.kernels["layers.*.self_attn.core"] == ("cpu.attention",)
    # a row-parallel site: the partitions and their fold in one call, rounded once
    assert invoked.kernels["layers.*.self_attn.o_proj"] == ("cpu.kpart_partial", "cpu.round_bf16")
    check_kernels(invoked, "the reference")


def test_the_record_rides_in_the_json_but_not_in_the_fingerprint(ran):
    invoked = ran.invoked_contract()
    data = invoked.to_json()
    assert data["kernels"]["embed_tokens"] == ["gather"]
    back = contract_from_json(data)
    assert back.kernels == invoked.kernels
    assert (
        back.fingerprint
        == invoked.fingerprint
        == ran.contract.with_sites(invoked.sites).fingerprint
    )
    # a different record (another gated form) leaves the fingerprint alone
    data["kernels"]["lm_head"] = ["cuda.gemm", "cuda.gemm:tma"]
    assert contract_from_json(data).fingerprint == invoked.fingerprint


def test_the_many_sequence_attention_is_recorded_under_its_site_and_has_no_vjp(tmp_path):
    """``AttentionSite.varlen`` (the engines' one call for every sequence) runs inside the
    attention op site: its kernel is recorded there and is one the site may run; a trainer's
    Ops (grad) refuses it."""
    d = make_tiny(tmp_path, arch="qwen3", seed=5)
    geom = qwen3.Geometry.from_model_dir(d)
    ops = qwen3.default_ops(geom)
    site = AttentionSite(ops, "layers.0.self_attn.core")
    g = torch.Generator().manual_seed(1)
    hq, hkv, dh = geom.heads, geom.kv_heads, geom.head_dim
    q = torch.randn(7, hq, dh, generator=g).bfloat16()
    k = torch.randn(9, hkv, dh, generator=g).bfloat16()
    pos = torch.tensor([0, 1, 2, 3, 2, 3, 4])
    starts_q, starts_k = torch.tensor([0, 4, 7]), torch.tensor([0, 4, 9])
    out = site.varlen(q, k, k, pos, starts_q, starts_k, max_rows=4)
    assert torch.equal(out[:4], site(q[:4], k[:4], k[:4], pos[:4]))
    assert ops.kernels["layers.*.self_attn.core"] == {"cpu.attention_varlen", "cpu.attention"}
    assert ops.kernels["layers.*.self_attn.core"] <= K.allowed("attention.blocked", "cpu")
    assert K.gate_of("cuda.attention_varlen") == K.ONE_LAUNCH["attention_varlen"]
    grad = AttentionSite(Ops(ops.contract, grad=True), "layers.0.self_attn.core")
    with pytest.raises(ContractMismatch, match="many-sequence form has no VJP"):
        grad.varlen(q, k, k, pos, starts_q, starts_k, max_rows=4)


def test_a_kernel_no_test_gates_is_refused_naming_the_site_and_the_kernel(ran):
    data = ran.invoked_contract().to_json()
    data["kernels"]["lm_head"].append("cpu.attention")
    with pytest.raises(ContractMismatch, match=r"ran kernel 'cpu\.attention', which no test gates"):
        check_kernels(contract_from_json(data), "the sampler")


def test_a_site_with_no_record_is_refused(ran):
    data = ran.invoked_contract().to_json()
    data["kernels"]["lm_head"] = []
    with pytest.raises(ContractMismatch, match=r"'lm_head' \(gemm.kblock\) ran no recorded"):
        check_kernels(contract_from_json(data), "the sampler")
    del data["kernels"]
    with pytest.raises(ContractMismatch, match=r"records no kernels"):
        check_kernels(contract_from_json(data), "the sampler")


def test_a_program_reached_around_the_dispatch_point_leaves_no_record(tmp_path):
    """The record is made from what ran: a site whose program is called without the dispatch
    point (here an engine whose rmsnorm calls the cpu backend directly) records nothing, and
    is refused."""

    class Around(Ops):
        def rmsnorm(self, path, x, w):
            prog = self.program(path, "rmsnorm.qwen3")
            self._ran(path, prog)
            return P.cpu.rmsnorm(x, w, prog.param("eps"))

    d = make_tiny(tmp_path, arch="qwen3", seed=4)
    geom = qwen3.Geometry.from_model_dir(d)
    ops = Around(qwen3.default_ops(geom).contract)
    qwen3.forward_logprobs(load_file(str(d / "model.safetensors")), geom, torch.arange(7), ops=ops)
    with pytest.raises(ContractMismatch, match=r"layernorm' \(rmsnorm.qwen3\) ran no recorded"):
        check_kernels(ops.invoked_contract(), "the engine")


def test_the_hybrid_lanes_sites_record_their_kernels(tmp_path):
    d = make_tiny(tmp_path, arch="qwen3-next", seed=2)
    geom = qwen3_next.Geometry.from_model_dir(d)
    ops = qwen3_next.default_ops(geom)
    qwen3_next.forward_logprobs(
        load_file(str(d / "model.safetensors")), geom, torch.arange(9), ops=ops
    )
    invoked = ops.invoked_contract()
    check_kernels(invoked, "the reference")
    gdn = [k for k, p in invoked.sites.items() if p.name == "gdn.chunked"]
    assert gdn and all(invoked.kernels[k] == ("cpu.gdn_chunked",) for k in gdn)


def _noted_in_cuda() -> set[str]:
    """Every kernel name the cuda backend passes to ``note`` (f-strings expanded by hand)."""
    names: set[str] = set()
    for path in sorted(CUDA.glob("*.py")):
        tree = ast.parse(path.read_text())
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "note":
                for node in ast.walk(call.args[0]):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        names.add(node.value)
    return names


def test_every_form_the_cuda_backend_notes_is_declared_with_a_gate_that_exists():
    noted = _noted_in_cuda()
    # the softmax's f-string: its two halves and two forms, spelled out
    assert {"cuda.gemm:tma", "cuda.gemm:pointer", "cuda.attention:hopper"} <= noted
    plain = {n for n in noted if n.startswith("cuda.") and ":" in n}
    declared = {f"cuda.{fn}:{form}" for fn, forms in K.FORMS.items() for form in forms}
    assert plain <= declared, sorted(plain - declared)
    for fn in ("softmax", "log_softmax"):
        assert set(K.FORMS[fn]) == {"split", "one-program"}
    source = GPU_TESTS.read_text()
    defined = set(re.findall(r"^def (test_\w+)", source, flags=re.M))
    gates = {g for forms in K.FORMS.values() for g in forms.values()} | set(K.ONE_LAUNCH.values())
    assert gates <= defined, sorted(gates - defined)
    for fn in K.ONE_LAUNCH:  # a one-launch function the dispatch point notes
        assert any(fn in K.REACHES[p] for p in K.REACHES)


def test_every_program_of_the_catalog_has_its_reach_declared():
    assert set(K.REACHES) == set(P.CATALOG)
    # the cuda backend needs triton: its exported names are read from its source
    tree = ast.parse((CUDA / "__init__.py").read_text())
    cuda = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    named = {fn for fns in K.REACHES.values() for fn in fns} - {"gather"}
    missing = sorted(fn for fn in named if not hasattr(P.cpu, fn) and fn not in cuda)
    assert not missing, missing
    assert set(K.ONE_LAUNCH) <= cuda


def test_the_gate_of_a_form_is_found_and_a_plain_kernel_has_none():
    assert K.gate_of("cuda.gemm:tma") == K.FORMS["gemm"]["tma"]
    assert K.gate_of("cuda.kpart_partial") == K.ONE_LAUNCH["kpart_partial"]
    assert K.gate_of("cpu.gemm") is None
    assert K.allowed("lora.shrink", "cuda") >= {"cuda.lora_shrink", "cuda.gemm:tma"}
    assert "cuda.gemm:tma" not in K.allowed("lora.shrink", "cpu")
