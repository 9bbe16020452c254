"""The contract is what runs: programs and parameters come from it, and what ran is logged.

Editing one site of the contract moves the bytes; a call that runs another program than the
contract names (behind its back) is caught, naming the site; a site the contract lacks is
refused. One name per site: the contract key is the recorded path with indices as ``*``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.contract import ContractMismatch, contract_from_json, first_difference
from lockstep_exact.lanes import qwen3
from lockstep_exact.lanes.ops import Ops, SiteNotInContract, check_invoked, site_key
from lockstep_exact.parity import same_bytes
from lockstep_exact.programs import Program
from lockstep_exact.sites import recording
from lockstep_exact.testing import nudge_ulp


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def tiny(request, tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, seed=5)
    geom = qwen3.Geometry.from_model_dir(d)
    return geom, load_file(str(d / "model.safetensors"))


TOKENS = torch.arange(37) * 29 % 1000


def _edited(ops: Ops, key: str, program: Program) -> Ops:
    data = ops.contract.to_json()
    assert key in data["sites"], key
    data["sites"][key] = program.ident
    return Ops(contract_from_json(data))


def test_site_keys_replace_every_index():
    assert site_key("layers.3.mlp.experts.12.down_proj") == "layers.*.mlp.experts.*.down_proj"
    assert site_key("layers.10.self_attn.q_proj.lora_shrink") == (
        "layers.*.self_attn.q_proj.lora_shrink"
    )
    assert site_key("lm_head") == "lm_head"


@pytest.mark.parametrize(
    "key,program",
    [
        ("layers.*.input_layernorm", Program.of("rmsnorm.qwen3", eps=1e-5)),
        ("layers.*.self_attn.k_rope", Program.of("rope.neox", base=10000.0)),
        ("lm_head", Program.of("gemm.kblock", bk=16, out="fp32")),
    ],
)
def test_editing_one_site_of_the_contract_moves_the_bytes(tiny, key, program):
    """(A bf16-output gemm's K order often survives the final rounding unchanged on tiny
    shapes, so the sites edited here are ones whose parameters move bytes every time.)"""
    geom, w = tiny
    ops = qwen3.default_ops(geom)
    base = qwen3.forward_logprobs(w, geom, TOKENS, ops=ops)
    # the same contract read back from its JSON gives the same bytes (the control)
    same = Ops(contract_from_json(ops.contract.to_json()))
    assert same_bytes(qwen3.forward_logprobs(w, geom, TOKENS, ops=same), base)
    edited = _edited(ops, key, program)
    assert edited.contract.fingerprint != ops.contract.fingerprint
    assert not same_bytes(qwen3.forward_logprobs(w, geom, TOKENS, ops=edited), base)
    assert edited.invoked[key] == program  # and the invoked log says what ran


def test_the_invoked_contract_lists_what_ran(tiny):
    geom, w = tiny
    ops = qwen3.default_ops(geom)
    qwen3.forward_logprobs(w, geom, TOKENS, ops=ops)
    invoked = ops.invoked_contract()
    check_invoked(ops.contract, invoked, "the reference")
    declared = set(ops.contract.sites)
    lora = {k for k in declared if k.endswith((".lora_shrink", ".lora_expand"))}
    # no adapter: no LoRA site ran; a forward draws no token: the sample site did not run
    assert set(invoked.sites) == declared - lora - {"sample"}
    again = qwen3.default_ops(geom)
    qwen3.forward_logprobs(w, geom, TOKENS[:5], ops=again)
    assert again.invoked_contract().fingerprint == invoked.fingerprint


def test_recorded_sites_use_the_contract_names(tiny):
    geom, w = tiny
    ops = qwen3.default_ops(geom)
    with recording() as sites:
        qwen3.forward_logprobs(w, geom, TOKENS[:9], ops=ops)
    keys = {site_key(name) for name in sites} - {"layers.*.mlp.router.ids"}
    assert keys == set(ops.invoked)


class Skewed(Ops):
    """An engine whose call at one site runs another program than its contract names."""

    def __init__(self, contract, key, program):
        super().__init__(contract)
        self.key, self.skew = key, program

    def program(self, path, expect):
        prog = super().program(path, expect)
        return self.skew if site_key(path) == self.key else prog


def test_a_call_behind_the_contracts_back_is_refused_naming_the_site(tiny):
    geom, w = tiny
    honest = qwen3.default_ops(geom)
    qwen3.forward_logprobs(w, geom, TOKENS, ops=honest)
    key = "layers.*.self_attn.v_proj"
    skewed = Skewed(honest.contract, key, Program.of("gemm.kblock", bk=64, out="bf16"))
    qwen3.forward_logprobs(w, geom, TOKENS, ops=skewed)
    # the engine's own check against the contract it was given
    with pytest.raises(ContractMismatch, match=r"bk=64.*'layers\.\*\.self_attn\.v_proj'.*bk=32"):
        check_invoked(honest.contract, skewed.invoked_contract(), "the skewed engine")
    # and the admission of one half's invoked contract against the other's
    where = first_difference(honest.invoked_contract(), skewed.invoked_contract())
    assert where is not None and "'layers.*.self_attn.v_proj'" in where
    assert honest.invoked_contract().fingerprint != skewed.invoked_contract().fingerprint


def test_a_site_missing_from_the_contract_is_refused(tiny):
    geom, w = tiny
    data = qwen3.default_ops(geom).contract.to_json()
    del data["sites"]["layers.*.self_attn.k_norm"]
    with pytest.raises(SiteNotInContract, match=r"'layers\.\*\.self_attn\.k_norm'"):
        qwen3.forward_logprobs(w, geom, TOKENS, ops=Ops(contract_from_json(data)))


def test_a_site_naming_another_program_is_refused(tiny):
    geom, w = tiny
    ops = qwen3.default_ops(geom)
    bad = _edited(ops, "layers.*.residual_attn", Program.of("swiglu"))
    with pytest.raises(ContractMismatch, match=r"'layers\.\*\.residual_attn'.*swiglu"):
        qwen3.forward_logprobs(w, geom, TOKENS, ops=bad)


def test_invoked_before_any_forward_is_an_error(tiny):
    geom, _ = tiny
    with pytest.raises(RuntimeError, match="no op site has run yet"):
        qwen3.default_ops(geom).invoked_contract()


def test_grad_mode_gives_the_same_forward_bytes(tiny):
    geom, w = tiny
    base = qwen3.forward_logprobs(w, geom, TOKENS)
    grad_ops = Ops(qwen3.default_ops(geom).contract, grad=True)
    wg = {k: v.clone().requires_grad_(k == "model.norm.weight") for k, v in w.items()}
    lp = qwen3.forward_logprobs(wg, geom, TOKENS, ops=grad_ops)
    assert same_bytes(lp.detach(), base)
    # input control: under grad, model.norm.weight[5] one bf16 ulp off moves the bytes
    moved = {**wg, "model.norm.weight": nudge_ulp(w["model.norm.weight"], 5).requires_grad_(True)}
    assert not same_bytes(qwen3.forward_logprobs(moved, geom, TOKENS, ops=grad_ops).detach(), base)
    lp[:, 3].sum().backward()
    assert wg["model.norm.weight"].grad is not None
    assert torch.isfinite(wg["model.norm.weight"].grad).all()
