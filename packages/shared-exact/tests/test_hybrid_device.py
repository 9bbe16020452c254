"""The hybrid programs' code is device-generic: what makes the cuda backend's bytes the cpu's.

programs.cuda.hybrid runs the cpu backend's gdn / hybrid code on CUDA tensors. That gives the
cpu bytes when the code (1) creates every tensor on its inputs' device, (2) never divides a
tensor by a Python number or a cpu scalar (CUDA multiplies by the reciprocal), (3) uses no op
a backend may fuse or reorder. Here, without a GPU, the code runs on the ``meta`` device under
a TorchFunctionMode that records every breach of the three rules; each rule's check is shown
to fire on a deliberate breach. The bytes themselves are compared on a GPU
(test_hybrid_gpu.py). Also: the states' device parameters and the refusal of a state on
another device than the tokens.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lockstep_exact import programs as P
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.programs import Program
from lockstep_exact.programs.cpu import gdn as G
from lockstep_exact.programs.cpu import hybrid as H

# The contract's program parameters (programs.CATALOG), never restated here.
CHUNK = Program.of("gdn.chunked").param("chunk")

pytestmark = pytest.mark.slow

BF16, F32 = torch.bfloat16, torch.float32
META = torch.device("meta")

# Ops a backend may fuse, reorder or compute with its own library (the programs use none).
FUSABLE = {
    "addbmm", "addcdiv", "addcmul", "addmm", "addmv", "baddbmm", "bmm", "cumprod", "cumsum",
    "dot", "einsum", "lerp", "linear", "logsumexp", "matmul", "mean", "mm", "mv", "nansum",
    "prod", "softmax", "sum", "exp", "expm1", "log", "log1p", "rsqrt", "sigmoid", "tanh",
    "pow", "silu", "softplus", "sin", "cos",
}  # fmt: skip
TRUE_DIV = {"div", "div_", "divide", "true_divide", "__truediv__", "__itruediv__", "__div__"}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class DeviceRules(TorchFunctionMode):
    """Records every call that breaks a rule of device-generic code for inputs on ``device``:
    a tensor argument or result elsewhere (a 0-dim cpu scalar included), a true division by a
    non-tensor, an op outside the programs' elementwise + tree vocabulary."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.breaches: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name.rstrip("_") in FUSABLE or name in FUSABLE:
            self.breaches.append(f"fusable or library op {name}")
        if name in TRUE_DIV and kwargs.get("rounding_mode") is None and len(args) >= 2:
            divisor = args[1]
            if not isinstance(divisor, torch.Tensor):
                self.breaches.append(f"{name} by the Python number {divisor!r}")
        for t in _tensors((args, kwargs)):
            if t.device != self.device:
                self.breaches.append(f"{name} takes a tensor on {t.device} {tuple(t.shape)}")
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if t.device != self.device:
                self.breaches.append(f"{name} makes a tensor on {t.device} {tuple(t.shape)}")
        return out


def _e(*shape, dtype=F32, device=META):
    return torch.empty(*shape, dtype=dtype, device=device)


def _runs(device):
    """Every hybrid program (the shared code the cuda backend calls) on ``device`` inputs."""
    d = device

    def gdn(t, hk, hv, dk, dv, chunk):
        st = G.gdn_state(hk, hv, dk, dv, chunk=chunk, device=d)
        q, k = _e(t, hk, dk, device=d), _e(t, hk, dk, device=d)
        v, g, beta = _e(t, hv, dv, dtype=BF16, device=d), _e(t, hv, device=d), _e(t, hv, device=d)
        return G.gdn_chunked(q, k, v, g, beta, st, position=0, chunk=chunk)

    x = _e(5, 24, dtype=BF16, device=d)
    w = _e(24, dtype=BF16, device=d)
    return {
        "gdn.chunked T=70 (a chunk and a part)": lambda: gdn(70, 1, 2, 16, 16, 64),
        "gdn.chunked T=3 chunk 16": lambda: gdn(3, 2, 4, 16, 8, 16),
        "gdn.gating": lambda: G.gdn_gating(
            _e(5, 4, dtype=BF16, device=d),
            _e(5, 4, dtype=BF16, device=d),
            _e(4, device=d),
            _e(4, dtype=BF16, device=d),
        ),  # fmt: skip
        "gdn.l2norm": lambda: G.l2norm(_e(5, 2, 16, dtype=BF16, device=d)),
        "conv1d.causal": lambda: G.conv1d_causal(
            _e(5, 7, dtype=BF16, device=d),
            _e(7, 4, dtype=BF16, device=d),
            G.conv1d_window(7, device=d),
        ),  # fmt: skip
        "rmsnorm.zero_centered": lambda: H.rmsnorm_zero_centered(x, w, 1e-6),
        "rmsnorm.gated": lambda: H.rmsnorm_gated(x, x, w, 1e-6),
        "gate.sigmoid": lambda: H.sigmoid_gate(x, x),
        "moe.shared_gate": lambda: H.shared_expert_gate(x, x, _e(5, 1, dtype=BF16, device=d)),
    }


@pytest.mark.parametrize("program", list(_runs(META)))
def test_hybrid_program_code_keeps_the_device_rules(program):
    run = _runs(META)[program]
    with DeviceRules(META) as rules:
        out = run()
    assert rules.breaches == [], f"{program}: {rules.breaches[:5]}"
    assert all(t.device == META for t in _tensors(out if isinstance(out, tuple) else (out,)))


def test_the_device_rules_check_catches_each_breach():
    """Negative controls: each rule's check fires on a deliberate breach."""
    x = _e(4, 8)
    cases = {
        "a cpu mask": lambda: torch.where(torch.arange(8) < 3, x, x),
        "a cpu 0-dim scalar": lambda: x + torch.tensor(1.0),
        "a cpu creation": lambda: torch.zeros(3),
        "division by a Python number": lambda: x / 8.0,
        "a fusable reduction": lambda: x.sum(-1),
        "a fused multiply-add": lambda: torch.addcmul(x, x, x),
        "a library transcendental": lambda: torch.exp(x),
    }
    for what, fn in cases.items():
        # a cpu mask with meta tensors may raise as well as be recorded
        with DeviceRules(META) as rules, contextlib.suppress(RuntimeError):
            fn()
        assert rules.breaches, f"the check missed {what}"
    with DeviceRules(META) as rules:
        1.0 / (x + 1.0)  # a Python numerator is the IEEE reciprocal on both backends
        x / torch.tensor(8.0, device=META)
        torch.div(torch.ones(3, dtype=torch.int64, device=META), 2, rounding_mode="floor")
    assert rules.breaches == []


def test_the_old_inv_rms_breaks_the_division_rule():
    """The rule that _inv_rms now keeps (H as a 0-dim tensor on the device) is the one a
    division by float(H), as it was written before, breaks."""
    xf = _e(3, 24)
    with DeviceRules(META) as rules:
        P.cpu.tree_sum(xf * xf) / float(xf.shape[-1])
    assert any("Python number" in b for b in rules.breaches)
    with DeviceRules(META) as rules:
        H._inv_rms(xf, 1e-6)
    assert rules.breaches == []


def test_states_are_made_on_the_asked_device_and_cpu_by_default():
    st = P.gdn_state(2, 4, 16, 8, chunk=16, device=META)
    assert {t.device for t in G.state_tensors(st)} == {META}
    assert P.conv1d_window(7, kernel=4, device=META).device == META
    st = P.gdn_state(2, 4, 16, 8, chunk=16)
    assert {t.device.type for t in G.state_tensors(st)} == {"cpu"}
    assert P.conv1d_window(7).device.type == "cpu"
    assert torch.equal(P.conv1d_window(7), torch.zeros(3, 7, dtype=BF16))


def test_a_state_on_another_device_than_the_tokens_is_refused_naming_both():
    t, hk, hv, dk, dv = 3, 1, 2, 16, 16
    q, k = _e(t, hk, dk), _e(t, hk, dk)
    v, g, beta = _e(t, hv, dv, dtype=BF16), _e(t, hv), _e(t, hv)
    cpu_state = P.gdn_state(hk, hv, dk, dv, chunk=CHUNK)
    with pytest.raises(ValueError, match=r"one device.*'cpu'.*'meta'"):
        P.gdn_chunked(q, k, v, g, beta, cpu_state, position=0, chunk=CHUNK)
    # A state moved in part (s on the tokens' device, its cached window not) is refused too.
    half = P.GdnState(64, 0, cpu_state.s.to(META), *G.state_tensors(cpu_state)[1:])
    with pytest.raises(ValueError, match=r"one device.*'cpu'.*'meta'"):
        P.gdn_chunked(q, k, v, g, beta, half, position=0, chunk=CHUNK)
    # The program itself refuses a mixed call where a caller reaches it past the dispatch.
    with pytest.raises(ValueError, match=r"gdn\.chunked: the tokens and the state must be on one"):
        G.gdn_chunked(q, k, v, g, beta, half, position=0, chunk=CHUNK)


def test_a_sequence_cache_is_made_on_the_models_device():
    from lockstep_exact.app.tiny import tiny_config

    geom = N.Geometry.from_hf_config(tiny_config("qwen3-next"))
    cache = N.NextCache.empty(geom, META)
    tensors = [*cache.conv.values(), *cache.keys.values(), *cache.values.values()]
    tensors += [t for st in cache.gdn.values() for t in G.state_tensors(st)]
    assert cache.gdn and cache.keys and {t.device for t in tensors} == {META}
    assert {t.device.type for t in N.NextCache.empty(geom).conv.values()} == {"cpu"}


# The cuda module's wiring, without a GPU or triton: a child process stubs triton (its kernels
# are never called here), imports programs.cuda, and runs programs.cuda.hybrid on meta tensors
# with its CUDA check recorded instead of enforced.
_WIRING = r"""
import sys
from unittest import mock

import torch

torch.empty(2, device="meta") * torch.empty(2, device="meta")  # torch's own lazy imports first
stub = mock.MagicMock()
stub.__version__ = "stub"
sys.modules.update(
    {"triton": stub, "triton.language": stub.language, "triton.language.extra": stub.language.extra}
)
from lockstep_exact.programs import cuda
from lockstep_exact.programs.cpu import gdn as G
from lockstep_exact.programs.cuda import hybrid as H

BF16, M = torch.bfloat16, "meta"
names = ["gdn_chunked", "gdn_gating", "l2norm", "conv1d_causal", "rmsnorm_zero_centered",
         "rmsnorm_gated", "sigmoid_gate", "shared_expert_gate", "rope_partial"]
assert all(n in cuda.__all__ and getattr(cuda, n) is getattr(H, n) for n in names), "exports"
try:
    H.sigmoid_gate(torch.zeros(2, dtype=BF16), torch.zeros(2, dtype=BF16))
    raise SystemExit("a cpu tensor was not refused")
except ValueError as err:
    assert "expected a CUDA device" in str(err), err
checked = []
H.require_cuda = lambda *ts: checked.append(len(ts))
e = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device=M)
from lockstep_exact.programs import Program
CHUNK = Program.of("gdn.chunked").param("chunk")
st = G.gdn_state(1, 2, 16, 16, chunk=CHUNK, device=M)
# gdn.chunked's chunk pass is the one-launch kernel (Triton is stubbed here: the cpu pass
# stands in for it on meta tensors, recording each chunk's rows)
from lockstep_exact.programs.cuda import gdn as KERNEL
assert H.chunk_pass is KERNEL.chunk, "chunk pass"
passes = []
H.chunk_pass = lambda *a: passes.append(a[2].shape[0]) or G._chunk_heads(*a)
out, st2 = H.gdn_chunked(e(70, 1, 16), e(70, 1, 16), e(70, 2, 16, dtype=BF16), e(70, 2),
                         e(70, 2), st, position=0, chunk=CHUNK)
assert out.shape == (70, 2, 16) and st2.start == 64 and checked[-1] == 10, checked
assert passes == [64, 6], passes
g, beta = H.gdn_gating(e(5, 4, dtype=BF16), e(5, 4, dtype=BF16), e(4), e(4, dtype=BF16))
assert g.shape == beta.shape == (5, 4)
assert H.l2norm(e(5, 2, 16, dtype=BF16)).shape == (5, 2, 16)
y, win = H.conv1d_causal(e(5, 7, dtype=BF16), e(7, 3, dtype=BF16), e(2, 7, dtype=BF16), kernel=3)
assert y.shape == (5, 7) and win.shape == (2, 7)
x, w = e(5, 24, dtype=BF16), e(24, dtype=BF16)
assert H.rmsnorm_zero_centered(x, w, 1e-6).shape == (5, 24)
assert H.rmsnorm_gated(x, x, w, 1e-6).shape == (5, 24)
assert H.sigmoid_gate(x, x).shape == (5, 24)
assert H.shared_expert_gate(x, x, e(5, 1, dtype=BF16)).shape == (5, 24)
# every tensor of each call, the state's five included, went through the CUDA check
assert checked == [10, 4, 1, 3, 2, 3, 2, 3], checked
seen = []
H.rope = lambda a, p, base: seen.append((tuple(a.shape), a.is_contiguous(), base)) or a
r = H.rope_partial(e(3, 2, 32, dtype=BF16), torch.arange(3), 1e6, 8)
assert r.shape == (3, 2, 32) and seen == [((3, 2, 8), True, 1e6)], seen
assert checked[-1] == 1, checked
print("wiring ok")
"""


def test_the_cuda_module_exports_and_wires_the_hybrid_programs_without_a_gpu():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run(
        [sys.executable, "-c", _WIRING], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0 and "wiring ok" in res.stdout, res.stderr[-3000:]
